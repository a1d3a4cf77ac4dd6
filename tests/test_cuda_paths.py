"""The CUDA branches of the memory planner, run on the CPU.

Two kinds of test: the calls into torch.cuda run against the strict fake of tests/fake_cuda.py
(a GPU that refuses what torch refuses) with no tensor involved; the steps that compute on
tensors run on the CPU, their allocator reading (`memory.peak_bytes`) replaced by a number.
"""

import json
import logging

import pytest
import torch
import torch.multiprocessing as mp

from cloudseg import distributed, memory
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.model import build_model, norm_statistics, prepare_for_training, set_checkpointing
from tests.fake_cuda import H100, Card, FakeCuda

GPU0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
GiB = 2**30
MEASURED_ON_THE_H100 = {"none": 9.70 * GiB, "encoder": 7.72 * GiB, "full": 5.91 * GiB}  # micro-batch 4, bf16


@pytest.fixture
def tiny_model():
    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]",
                                               "train.device=cpu"])
    torch.manual_seed(0)
    return build_model(config.model, pretrained=False).train(), config


def test_the_fake_refuses_what_torch_refuses(fake_cuda):
    """The crash found on the H100: set_per_process_memory_fraction given torch.device("cuda").
    Would catch: a fake as lax as the one that let that crash through (it took any device)."""
    fake_cuda(H100)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.max_memory_allocated(CPU)
    with pytest.raises(TypeError, match="must be `float`"):
        torch.cuda.set_per_process_memory_fraction(1, GPU0)
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.cuda.get_device_properties(1)
    with pytest.raises(RuntimeError):  # the allocator's own check, in C++
        torch.cuda.max_memory_allocated(1)
    torch.cuda.set_per_process_memory_fraction(0.5, GPU0)
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    assert torch.cuda.mem_get_info(torch.device("cuda")) == (H100.total_memory, H100.total_memory)  # optional index


class Recorder:
    """Stands in for monkeypatch: records the torch.cuda names FakeCuda.install replaces, replaces nothing."""

    def __init__(self):
        self.names = set()

    def setattr(self, target, name, value, raising=True):
        if target is torch.cuda:
            self.names.add(name)


def test_every_faked_function_is_held_to_torch_on_a_gpu():
    """tests/test_gpu.py compares each faked function with the real one on a GPU machine. Would
    catch: a function faked later without being added to that comparison."""
    from tests.test_gpu import DEVICE_CALLS, WITHOUT_DEVICE

    recorder = Recorder()
    FakeCuda([H100]).install(recorder)
    assert recorder.names == set(DEVICE_CALLS) | WITHOUT_DEVICE


def test_peak_bytes_reads_the_allocator_after_the_run_has_finished(fake_cuda):
    """Would catch: the peak read before the run or before synchronizing, or never reset."""
    cuda = fake_cuda(H100)
    cuda.cards[0].peak = 99

    def run():
        cuda.calls.append(("run",))
        cuda.cards[0].peak = 5 * GiB

    assert memory.peak_bytes(GPU0, run) == 5 * GiB
    assert [call[0] for call in cuda.calls] == ["empty_cache", "reset_peak_memory_stats", "run", "synchronize",
                                                "empty_cache"]


def test_measured_peak_measures_one_real_backward_without_cudnn_s_search_and_leaves_the_model_as_it_was(
        tiny_model, monkeypatch):
    """Issue #60: a probe runs with cuDNN's benchmark mode off (it timed every algorithm of every
    probed shape, about 10 s a probe at full resolution) and its deterministic mode on (so that
    the heuristics' picks are cached under another key than training's), and training's modes are
    back after it. Would catch: a planted `benchmark = True` in the probe (or the search left on),
    the heuristics' picks cached under training's key (deterministic left off), the modes not
    restored for training, a warm-up step before the measured one (a second step, the search's
    old reason), no backward in the measured run, forgetting AdamW's two states, and a probe that
    trains (gradients or BatchNorm statistics left behind)."""
    model, config = tiny_model
    statistics = norm_statistics(model)
    backwards, searching = [], []
    next(model.parameters()).register_hook(lambda grad: backwards.append(1))

    def peak_bytes(device, run):
        assert device == CPU and not backwards  # no step before the measured one
        searching.append((torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic))
        run()
        assert len(backwards) == 1
        return 3 * GiB

    monkeypatch.setattr(memory, "peak_bytes", peak_bytes)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as speed_switches leaves it for training
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    assert memory.measured_peak(model, config, 2, (64, 96), CPU) == 3 * GiB + 2 * memory.parameter_bytes(model)
    assert searching == [(False, True)]
    assert torch.backends.cudnn.benchmark is True and torch.backends.cudnn.deterministic is False
    assert all(p.grad is None for p in model.parameters())
    for name, value in norm_statistics(model).items():
        assert torch.equal(value, statistics[name]), name


def test_a_probe_is_remembered_for_the_same_gpu_shape_precision_and_model(tiny_model, fake_cuda, monkeypatch, tmp_path):
    """Issue #60: `cloudseg train` probes again only what it never probed on this GPU. Would catch:
    a remembered peak taken for another micro-batch, precision, deterministic mode, image size,
    checkpointing mode, GPU or code of the step (each is a new probe here), a probe run though it is remembered, an out-of-memory probe
    remembered (what fits depends on the cap), a damaged file that stops the run, and a probe kept
    when the user set no file (None)."""
    model, config = tiny_model
    cuda = fake_cuda(H100)
    measured = []

    def measured_peak(model, config, n, image_size, device):
        measured.append((n, image_size, config.train.precision))
        if n == 8:
            raise torch.cuda.OutOfMemoryError("simulated")
        return float(len(measured) * GiB)

    monkeypatch.setattr(memory, "measured_peak", measured_peak)
    cache = tmp_path / "probes.json"
    bf16 = config.model_copy(deep=True)
    bf16.train.precision = "bf16"
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 1 * GiB
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 1 * GiB and len(measured) == 1
    assert memory.probed_peak(model, bf16, 2, (64, 96), GPU0, cache) == 2 * GiB  # another micro-batch
    assert memory.probed_peak(model, bf16, 4, (64, 128), GPU0, cache) == 3 * GiB  # another size
    fp16 = config.model_copy(deep=True)
    fp16.train.precision = "fp16"
    assert memory.probed_peak(model, fp16, 4, (64, 96), GPU0, cache) == 4 * GiB  # another precision
    set_checkpointing(model, "full")
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 5 * GiB  # another mode
    set_checkpointing(model, "none")
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 1 * GiB and len(measured) == 5
    exact = bf16.model_copy(deep=True)
    exact.train.deterministic = True
    assert memory.probed_peak(model, exact, 4, (64, 96), GPU0, cache) == 6 * GiB  # other algorithms
    with monkeypatch.context() as patch:
        patch.setattr(memory, "step_code", lambda: "the step's code changed")
        assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 7 * GiB
    with pytest.raises(torch.cuda.OutOfMemoryError):
        memory.probed_peak(model, bf16, 8, (64, 96), GPU0, cache)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        memory.probed_peak(model, bf16, 8, (64, 96), GPU0, cache)
    assert len(json.loads(cache.read_text())) == 7
    cuda.cards[0] = Card("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB)
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 10 * GiB  # another GPU
    cache.write_text("{not json")
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, cache) == 11 * GiB
    assert len(json.loads(cache.read_text())) == 1
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, None) == 12 * GiB
    assert memory.probed_peak(model, bf16, 4, (64, 96), GPU0, None) == 13 * GiB


def test_the_probe_file_is_the_one_the_user_names_or_none(monkeypatch, tmp_path):
    """Would catch: the variable ignored, an empty one taken as a file named '' rather than none,
    and the default not beside inductor's cache in the user's cache folder."""
    monkeypatch.setenv(memory.PROBE_CACHE, str(tmp_path / "mine.json"))
    assert memory.probe_cache() == tmp_path / "mine.json"
    monkeypatch.setenv(memory.PROBE_CACHE, "")
    assert memory.probe_cache() is None
    monkeypatch.delenv(memory.PROBE_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert memory.probe_cache() == tmp_path / "cloudseg" / "probes.json"


def fake_probes(monkeypatch, peak_of):
    """memory.measured_peak replaced: `peak_of(mode, n)` bytes (or None: out of memory), where
    the mode is read off the wrappers the model carries now. Returns the (mode, n) probed."""
    probed = []

    def measured_peak(model, config, n, image_size, device):
        wrapped = {name for name, m in model.named_modules() if "forward" in vars(m)}
        mode = "full" if "unet.decoder.blocks.0" in wrapped else "encoder" if "unet.encoder" in wrapped else "none"
        probed.append((mode, n))
        if peak_of(mode, n) is None:
            raise torch.cuda.OutOfMemoryError("simulated")
        return peak_of(mode, n)

    monkeypatch.setattr(memory, "measured_peak", measured_peak)
    return probed


def test_auto_probes_against_free_plus_reserved_memory(tiny_model, fake_cuda, monkeypatch):
    """Would catch: probing against the card's total memory (another process holds most of
    it here) or ignoring what this process has reserved already."""
    model, config = tiny_model
    config.train.micro_batch, config.train.effective_batch = "auto", 16
    fake_cuda(Card("a shared GPU", (8, 6), 80 * GiB, free=5 * GiB, reserved=1 * GiB))
    probed = fake_probes(monkeypatch, lambda mode, n: None if n > 8 else 0.3 * GiB + n * GiB)
    # room = 0.9 × 6 GiB = 5.4 GiB: 5 images need 5.3 GiB, but only divisors of 16 are candidates
    assert memory.resolve_micro_batch(config, model, (64, 96), GPU0) == 4
    assert [n for _, n in probed] == [16, 8, 4]  # largest first; 16 and 8 do not fit (16 runs out of memory)


def test_auto_under_ddp_counts_the_gradient_buckets_and_takes_every_rank_s_smallest(tiny_model, fake_cuda,
                                                                                      monkeypatch):
    """Would catch: a probe that forgets DDP's bucket copy of the gradients, and ranks that
    keep their own answers (the sampler would cut windows differently on each)."""
    model, config = tiny_model
    config.train.micro_batch, config.train.effective_batch = "auto", 16
    buckets = memory.parameter_bytes(model)
    fake_cuda(Card("a small GPU", (8, 6), 4 * GiB))
    fake_probes(monkeypatch, lambda mode, n: n * (0.9 * GiB - buckets / 8))
    # per rank 8 images a window: 4 images need 3.6 GiB - buckets/2, plus the buckets > 0.9 × 4 GiB
    asked = []
    monkeypatch.setattr(distributed, "smallest", lambda value, device: asked.append(value) or 1)
    assert memory.resolve_micro_batch(config, model, (64, 96), GPU0, world=2) == 1
    assert asked == [2]


@pytest.mark.parametrize("card_gb, expected, shrinks", [
    (80, "none", False), (11, "encoder", False), (8, "full", False), (6, "full", True)])
def test_checkpointing_auto_takes_the_least_recomputation_that_fits(tiny_model, fake_cuda, monkeypatch, caplog,
                                                                    card_gb, expected, shrinks):
    """The H100's measured peaks at micro-batch 4 on cards of 80, 11, 8 and 6 GB (10% kept free).
    Would catch: trying the modes in another order (always full), comparing against the card's
    total rather than the margin (none on 11 GB), probing at another micro-batch than the
    configured one, and shrinking the micro-batch while some mode still fits."""
    model, config = tiny_model
    config.train.checkpointing, config.train.micro_batch, config.train.effective_batch = "auto", 4, 16
    fake_cuda(Card("a card", (8, 6), card_gb * 10**9))
    probed = fake_probes(monkeypatch, lambda mode, n: MEASURED_ON_THE_H100[mode])
    with caplog.at_level(logging.INFO, logger="cloudseg"):
        assert memory.resolve_checkpointing(config, model, (64, 96), GPU0) == expected
    assert {n for _, n in probed} == {4}
    assert [mode for mode, _ in probed] == list(memory.CHECKPOINTING_MODES[:memory.CHECKPOINTING_MODES.index(expected) + 1])
    assert (config.train.micro_batch == "auto") == shrinks
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.checkpointing=auto")]
    assert len(lines) == 1 and f"auto: {expected} (micro-batch 4: none 9.70 GiB" in lines[0]


def test_checkpointing_auto_plans_for_four_images_when_the_micro_batch_is_auto_too(tiny_model, fake_cuda, monkeypatch):
    """Would catch: probing checkpointing at micro-batch 16 (the whole window: always full) when
    micro_batch is auto; auto then takes the largest micro-batch under the chosen mode."""
    model, config = tiny_model
    config.train.checkpointing, config.train.micro_batch, config.train.effective_batch = "auto", "auto", 16
    fake_cuda(Card("an 11 GB card", (7, 5), 11 * 10**9))
    probed = fake_probes(monkeypatch, lambda mode, n: MEASURED_ON_THE_H100[mode] / 4 * n)
    assert memory.resolve_checkpointing(config, model, (64, 96), GPU0) == "encoder"
    assert probed == [("none", 4), ("encoder", 4)]


def test_checkpointing_auto_agrees_across_processes_on_the_most_recomputation(tiny_model, fake_cuda, monkeypatch):
    """This GPU fits none, another rank's needs full and even then must shrink its micro-batch.
    Would catch: each rank keeping its own mode or micro-batch (the ranks' windows and all-reduces
    would not pair up), or the least of them winning."""
    model, config = tiny_model
    config.train.checkpointing, config.train.micro_batch = "auto", 4
    fake_cuda(H100)
    fake_probes(monkeypatch, lambda mode, n: MEASURED_ON_THE_H100[mode])
    asked = []

    def largest(value, device):  # the other rank: full (index 2), and it must shrink (1)
        asked.append(value)
        return max(value, 2 if len(asked) == 1 else 1)

    monkeypatch.setattr(distributed, "largest", largest)
    assert memory.resolve_checkpointing(config, model, (64, 96), GPU0, world=2) == "full"
    assert asked == [0, 0]  # this rank: none fits; and it need not shrink, but another rank does:
    assert config.train.micro_batch == "auto"  # every rank probes the micro-batch, or the all-reduces would hang


# The assumed bytes outside PyTorch's allocator that the hand-computed figures below use.
FULL_IMAGE = (1400, 2100)
NVJPEG_PER_IMAGE = 3 * 1400 * 2100  # 8.82 MB


def test_the_assumed_figures_outside_the_allocator_are_the_documented_ones(tiny_model):
    """Would catch: a change of the assumed figures without the docs (docs/memory-and-gpus.md
    states 256 MiB, 128 MiB and H×W×3 per image), nvJPEG counted where images decode on the CPU,
    and its buffers not growing with the micro-batch."""
    _, config = tiny_model
    assert (memory.LIBRARY_BYTES, memory.NVJPEG_STATE_BYTES) == (256 * 2**20, 128 * 2**20)
    config.data.decode = "auto"  # gpu on CUDA
    assert memory.outside_allocator(config, FULL_IMAGE, 4) == 384 * 2**20 + 4 * NVJPEG_PER_IMAGE
    config.data.decode = "cpu"
    assert memory.outside_allocator(config, FULL_IMAGE, 4) == 256 * 2**20


@pytest.mark.parametrize("decode, expected", [("auto", "encoder"), ("cpu", "none")])
def test_checkpointing_auto_keeps_room_for_memory_outside_the_allocator(tiny_model, fake_cuda, monkeypatch,
                                                                        decode, expected):
    """10 GiB free: 9 GiB under the margin. none's allocator peak, 8.70 GiB, fits beside the
    libraries' 0.25 GiB (8.75 GiB left) but not beside nvJPEG's too (0.375 GiB + 4 × 8.82 MB:
    8.59 GiB left), which data.decode auto brings on CUDA. Would catch: the margin alone (none
    with the GPU decode: nvJPEG's buffers, outside the allocator and the cap, would be a crash
    under DDP), and nvJPEG counted for a CPU decode. Device: fake CUDA."""
    model, config = tiny_model
    config.train.checkpointing, config.train.micro_batch, config.data.decode = "auto", 4, decode
    fake_cuda(Card("a shared GPU", (9, 0), 80 * GiB, free=10 * GiB))
    fake_probes(monkeypatch, lambda mode, n: {"none": 8.70 * GiB, "encoder": 7 * GiB, "full": 6 * GiB}[mode])
    assert memory.resolve_checkpointing(config, model, FULL_IMAGE, GPU0) == expected


@pytest.mark.parametrize("decode, expected", [("auto", 4), ("cpu", 8)])
def test_micro_batch_auto_keeps_room_for_nvjpeg_s_buffers_per_image(tiny_model, fake_cuda, monkeypatch,
                                                                   decode, expected):
    """Allocator peaks of 1.08 GiB per image, 9 GiB under the margin: 8 images (8.64 GiB) fit
    beside the libraries' 0.25 GiB (8.89), not beside nvJPEG's state and eight buffers too
    (0.44 GiB: 9.08). Would catch: the margin alone (8 with the GPU decode) and nvJPEG's
    per-image buffers left out. Device: fake CUDA."""
    model, config = tiny_model
    config.train.micro_batch, config.train.effective_batch, config.data.decode = "auto", 16, decode
    fake_cuda(Card("a shared GPU", (9, 0), 80 * GiB, free=10 * GiB))
    fake_probes(monkeypatch, lambda mode, n: n * 1.08 * GiB)
    assert memory.resolve_micro_batch(config, model, FULL_IMAGE, GPU0) == expected


@pytest.mark.parametrize("deterministic", [False, True])
def test_cloudseg_memory_measures_with_the_switches_training_uses(fake_cuda, monkeypatch, capsys, deterministic):
    """train.start turns cuDNN's benchmark on (off with train.deterministic) before its probes;
    `cloudseg memory` must measure the same step. Would catch: the memory command leaving the
    switches as they were (benchmark off: other algorithms and workspaces than training's), and
    ignoring train.deterministic. Device: fake CUDA, the report itself replaced."""
    fake_cuda(H100)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kwargs: seen.append(("algorithms", mode)))
    seen = []
    monkeypatch.setattr(memory, "report", lambda config, n, device: seen.append(
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)) or "report")
    assert main(["memory", "-c", "configs/demo.yaml", "train.device=cuda",
                 f"train.deterministic={str(deterministic).lower()}"]) == 0
    assert seen == ([("algorithms", True)] if deterministic else []) + [(not deterministic, deterministic)]


def test_checkpointing_auto_on_the_cpu_is_none_and_explicit_modes_pass(tiny_model):
    """Would catch: probing on a CPU (no allocator to read) and overriding an explicit choice."""
    model, config = tiny_model
    config.train.checkpointing = "auto"
    assert memory.resolve_checkpointing(config, model, (64, 96), CPU) == "none"
    config.train.checkpointing = "encoder"
    assert memory.resolve_checkpointing(config, model, (64, 96), GPU0) == "encoder"


def _extreme_on_rank(rank, world, init_file, values, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import os

    os.environ["WORLD_SIZE"] = str(world)
    results[rank] = (distributed.smallest(values[rank], CPU), distributed.largest(values[rank], CPU))
    torch.distributed.destroy_process_group()


def test_smallest_and_largest_agree_across_processes(tmp_path):
    """Would catch: each rank keeping its own value, or the reductions swapped."""
    results = mp.Manager().dict()
    mp.spawn(_extreme_on_rank, args=(2, tmp_path / "init", [4, 2], results), nprocs=2)
    assert dict(results) == {0: (2, 4), 1: (2, 4)}


def test_memory_limit_gb_caps_the_gpu_it_names_and_reports_every_precision_and_mode(fake_cuda, monkeypatch, capsys):
    """`cloudseg memory --limit-gb 11` on a (fake) H100, the steps themselves replaced. Would catch
    the crash of 2026-11-23 (the cap given torch.device("cuda"), which torch refuses), a cap
    computed against something other than the card's total, and a precision or mode left out."""
    cuda = fake_cuda(H100)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # restored after
    steps = []
    monkeypatch.setattr(memory, "capped_steps", lambda config, n, size, device: steps.append(
        (config.train.precision, config.train.checkpointing, n, device)) or (3 * GiB, n, 4))
    monkeypatch.setattr(memory, "auto_under_cap", lambda config, precision, n, size, device: "encoder")
    assert main(["memory", "-c", "configs/fullres.yaml", "--limit-gb", "11", "model.encoder_weights=null"]) == 0
    assert cuda.calls[0] == ("set_per_process_memory_fraction", pytest.approx(11e9 / H100.total_memory), 0)
    assert steps == [(p, m, 4, GPU0) for p in ("fp16", "bf16") for m in memory.CHECKPOINTING_MODES]
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("fp16", "bf16"))]
    assert [row[:2] for row in rows] == [[p, m] for p in ("fp16", "bf16") for m in (*memory.CHECKPOINTING_MODES, "auto")]
    assert all(row[2:] == ["3.00", "4", "4", "yes"] for row in rows if row[1] != "auto")
    assert all(row[2:] == ["->", "encoder"] for row in rows if row[1] == "auto")


def test_capped_steps_retry_down_to_what_fits_and_read_the_peak_of_two_steps(monkeypatch):
    """On the CPU, a model that runs out of memory above one image. Would catch: a retry that is
    not run (nothing trained), the peak read around one step only, and micro_batch auto not asked."""
    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]",
                                               "train.effective_batch=4",
                                               "train.micro_batch=auto", "train.checkpointing=none"])
    real_build, forwards = memory.build_model, []

    def one_image_at_most(*args, **kwargs):
        model = real_build(*args, **kwargs)

        def refuse(module, args):
            if torch.is_grad_enabled():
                forwards.append(len(args[0]))
                if len(args[0]) > 1:
                    raise torch.cuda.OutOfMemoryError("simulated")

        model.register_forward_pre_hook(refuse)
        return model

    def peak_bytes(device, run):
        before = len(forwards)
        run()
        assert forwards[before:] == [2, 1, 1, 1, 1]  # refused at 2, then two steps of 2 micro-batches of 1
        return 3 * GiB

    monkeypatch.setattr(memory, "build_model", one_image_at_most)
    monkeypatch.setattr(memory, "peak_bytes", peak_bytes)
    assert memory.capped_steps(config, 2, (64, 96), CPU) == (3 * GiB, 1, 4)  # auto on a CPU: largest divisor <= 4


def test_every_cuda_only_test_is_marked_gpu():
    """`make test-gpu` runs the tests marked `gpu`: a test that skips itself without CUDA by its
    own skipif would never run there (the compiled step's test was marked slow so, until issue
    #22). Would catch such a skipif anywhere in tests/."""
    from pathlib import Path

    own_skip = "skipif(not torch.cuda" + ".is_available()"  # split, so that this file does not match itself
    offenders = [path.name for path in Path("tests").glob("test_*.py") if own_skip in path.read_text()]
    assert offenders == []


def test_a_probe_s_random_draws_leave_that_gpu_s_generator_as_it_was(fake_cuda):
    """The CUDA branch of `memory.random_states_kept` (probe_step's), against the strict fake: two
    cards, the probe on the second, whose generator its draws move (set here as a draw would); on
    leaving, card 1's state is back and card 0's untouched. Would catch the CUDA generator left
    out of the fork (devices=[]), or the wrong card's forked (the current one, 0)."""
    cuda = fake_cuda(H100, H100)
    before = [card.rng.clone() for card in cuda.cards]
    with memory.random_states_kept(torch.device("cuda", 1)):
        torch.cuda.set_rng_state(torch.full((16,), 7, dtype=torch.uint8), torch.device("cuda", 1))
        assert not torch.equal(cuda.cards[1].rng, before[1])
    assert all(torch.equal(card.rng, state) for card, state in zip(cuda.cards, before))
