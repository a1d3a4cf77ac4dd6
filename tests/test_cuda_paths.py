"""The CUDA branches of the memory planner, run on the CPU with the CUDA allocator faked.

No GPU is needed: `torch.cuda`'s memory statistics are replaced by fakes that record how
they were used, so the probing logic itself (what is measured, when, against what) is tested.
"""

import pytest
import torch
import torch.multiprocessing as mp

from cloudseg import distributed, memory
from cloudseg.config import load_config
from cloudseg.model import build_model, norm_statistics

CUDA = torch.device("cuda")
GiB = 2**30


@pytest.fixture
def tiny_model():
    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]"])
    torch.manual_seed(0)
    return build_model(config.model, pretrained=False).train(), config


def test_measured_peak_reads_the_peak_after_a_real_backward_and_leaves_the_model_as_it_was(tiny_model, monkeypatch):
    """Would catch: reading the peak before backward, forgetting AdamW's two states, leaving
    gradients or updated BatchNorm statistics behind (the probe must not train)."""
    model, config = tiny_model
    statistics = norm_statistics(model)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def peak(device=None):
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), "backward has not run"
        calls.append("peak")
        return 3 * GiB

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    result = memory.measured_peak(model, config, 2, (64, 96), torch.device("cpu"))
    assert calls == ["reset", "sync", "peak"]
    assert result == 3 * GiB + 2 * memory.parameter_bytes(model)
    assert all(p.grad is None for p in model.parameters())
    for name, value in norm_statistics(model).items():
        assert torch.equal(value, statistics[name]), name


def fake_gpu(monkeypatch, free, reserved, peak_per_image, fixed, oom_above=None):
    """A GPU with `free` + `reserved` bytes for this process, and a step that needs
    `fixed + n × peak_per_image` (out of memory above `oom_above` images)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0, raising=False)
    probed = []

    def measured_peak(model, config, n, image_size, device):
        probed.append(n)
        if oom_above is not None and n > oom_above:
            raise torch.cuda.OutOfMemoryError("simulated")
        return fixed + n * peak_per_image

    monkeypatch.setattr(memory, "measured_peak", measured_peak)
    return probed


def test_auto_probes_against_free_plus_reserved_memory(tiny_model, monkeypatch):
    """Would catch: probing against the card's total memory (another process holds most of
    it here) or ignoring what this process has reserved already."""
    model, config = tiny_model
    config.train.micro_batch, config.train.effective_batch = "auto", 16
    probed = fake_gpu(monkeypatch, free=5 * GiB, reserved=1 * GiB, peak_per_image=1 * GiB, fixed=0.3 * GiB,
                      oom_above=8)
    # room = 0.9 × 6 GiB = 5.4 GiB: 5 images need 5.3 GiB, but only divisors of 16 are candidates
    assert memory.resolve_micro_batch(config, model, (64, 96), CUDA) == 4
    assert probed == [16, 8, 4]  # largest first; 16 and 8 do not fit (16 runs out of memory)


def test_auto_under_ddp_counts_the_gradient_buckets_and_takes_every_rank_s_smallest(tiny_model, monkeypatch):
    """Would catch: a probe that forgets DDP's bucket copy of the gradients, and ranks that
    keep their own answers (the sampler would cut windows differently on each)."""
    model, config = tiny_model
    config.train.micro_batch, config.train.effective_batch = "auto", 16
    buckets = memory.parameter_bytes(model)
    fake_gpu(monkeypatch, free=4 * GiB, reserved=0, peak_per_image=0.9 * GiB - buckets / 8, fixed=0)
    # per rank 8 images a window: 4 images need 3.6 GiB - buckets/2, plus the buckets > 0.9 × 4 GiB
    asked = []
    monkeypatch.setattr(distributed, "smallest", lambda value, device: asked.append(value) or 1)
    assert memory.resolve_micro_batch(config, model, (64, 96), CUDA, world=2) == 1
    assert asked == [2]


def _smallest_on_rank(rank, world, init_file, values, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import os

    os.environ["WORLD_SIZE"] = str(world)
    results[rank] = distributed.smallest(values[rank], torch.device("cpu"))
    torch.distributed.destroy_process_group()


def test_smallest_agrees_across_processes(tmp_path):
    """Would catch: each rank keeping its own value, or the largest one winning."""
    results = mp.Manager().dict()
    mp.spawn(_smallest_on_rank, args=(2, tmp_path / "init", [4, 2], results), nprocs=2)
    assert dict(results) == {0: 2, 1: 2}


def test_limit_gb_caps_the_process_and_reports_every_precision_and_mode(monkeypatch):
    """`cloudseg memory --limit-gb` with the CUDA calls faked and a model that runs out of
    memory above one image. Would catch: a cap computed against something other than the
    card's total, a precision or checkpointing mode left out, and a retry that is not run."""
    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]",
                                               "data.image_size=[64,96]", "train.effective_batch=4"])
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 80e9}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    real_build = memory.build_model

    def one_image_at_most(*args, **kwargs):
        model = real_build(*args, **kwargs)

        def refuse(module, args):
            if torch.is_grad_enabled() and len(args[0]) > 1:
                raise torch.cuda.OutOfMemoryError("simulated")

        model.register_forward_pre_hook(refuse)
        return model

    monkeypatch.setattr(memory, "build_model", one_image_at_most)
    table = memory.capped(config, 11, 2, torch.device("cpu"))
    assert fractions == [pytest.approx(11 / 80)]
    rows = [line.split() for line in table.splitlines() if line.startswith(("fp16", "bf16"))]
    assert [(row[0], row[1]) for row in rows] == [(p, m) for p in ("fp16", "bf16") for m in memory.CHECKPOINTING_MODES]
    for row in rows:
        assert row[2:] == ["3.00", "1", "4", "no"]  # retried down to 1 image; auto on a CPU device: largest divisor <= 4
