"""Micro-batch auto, out-of-memory recovery and the memory report."""


import pytest
import torch
from torch.utils.data import DataLoader

from cloudseg.checkpoint import load_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.memory import StepMemory, largest_fitting, resolve_micro_batch
from cloudseg.engine import StepContext, resilient_step, windows
from cloudseg.train import train
from tests.conftest import assert_same_parameters
from tests.test_accumulation import CPU, Images, model_and_sgd
from tests.conftest import TINY


def limit_memory(model, limit, after=0):
    """A fake allocator limit: micro-batches above `limit` images that need gradients raise CUDA
    out-of-memory, from the `after`-th such forward on. Patches `model.forward` in place."""
    forward, calls = model.forward, []

    def limited(images):
        if torch.is_grad_enabled() and len(images) > limit:
            calls.append(1)
            if len(calls) > after:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(images)

    model.forward = limited
    return model


def run_windows(model, optimizer, micro_batch, n_images=8, accumulation=2, loader_batch=4):
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    config = load_config(None, [f"train.effective_batch={loader_batch * accumulation}",
                                f"train.micro_batch={loader_batch}", "train.grad_clip=null"])
    for window in windows(DataLoader(Images(n_images), batch_size=loader_batch), accumulation):
        _, micro_batch = resilient_step(StepContext(model, optimizer, scaler, CPU, None, config.train.grad_clip, config.train.dice_weight), window, micro_batch)
    return micro_batch


def test_oom_mid_window_halves_the_micro_batch_and_redoes_the_window_exactly():
    reference, reference_sgd = model_and_sgd()
    run_windows(reference, reference_sgd, micro_batch=1)
    net, sgd = model_and_sgd()
    limit_memory(net, limit=1, after=1)  # the second micro-batch of the first window fails
    assert run_windows(net, sgd, micro_batch=4) == 1  # 4 -> 2 -> 1
    assert_same_parameters(net, reference)


def test_oom_at_micro_batch_one_is_raised():
    net, sgd = model_and_sgd()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_windows(limit_memory(net, limit=0), sgd, micro_batch=2)


def test_training_run_that_hits_oom_ends_like_one_that_never_did(data_copy, tmp_path, wrap_built_models, caplog):
    data = data_copy
    options = [f"data.dir={data}", *TINY, "model.norm=group"]  # no batch statistics: exact comparison
    train(load_config("configs/demo.yaml", options + ["train.micro_batch=1"]), tmp_path / "never")
    wrap_built_models(lambda model: limit_memory(model, 1, after=1))
    train(load_config("configs/demo.yaml", options + ["train.micro_batch=2"]), tmp_path / "recovered")
    never, recovered = load_checkpoint(tmp_path / "never/last.pt"), load_checkpoint(tmp_path / "recovered/last.pt")
    assert never["step"] == recovered["step"]
    for name, tensor in never["model"].items():
        assert torch.equal(tensor, recovered["model"][name]), name
    assert "micro-batch now 1, accumulation 4; redoing the window" in caplog.text


def test_largest_fitting_takes_the_biggest_candidate_under_the_margin():
    peaks = {1: 3e9, 2: 5e9, 4: 9e9, 8: 17e9, 16: None}  # None: out of memory

    def peak_of(n):
        if peaks[n] is None:
            raise torch.cuda.OutOfMemoryError("simulated")
        return peaks[n]

    assert largest_fitting([1, 2, 4, 8, 16], peak_of, capacity_bytes=11e9) == 4  # 9 <= 0.9 * 11
    assert largest_fitting([1, 2, 4, 8, 16], peak_of, capacity_bytes=9.5e9) == 2  # 9 > 0.9 * 9.5
    with pytest.raises(RuntimeError, match="not even a micro-batch of 1"):
        largest_fitting([1, 2], peak_of, capacity_bytes=2e9)


def test_auto_keeps_the_effective_batch():
    config = load_config("configs/demo.yaml", ["train.micro_batch=auto", "train.effective_batch=12"])
    micro_batch = resolve_micro_batch(config, None, (64, 96), CPU)
    assert micro_batch == 4 and 12 % micro_batch == 0


def test_step_memory_arithmetic():
    step = StepMemory(weights=1e9, gradients=1e9, optimizer=2e9, activations_per_image=2e9)
    assert step.peak(3) == 10e9
    assert step.largest_micro_batch(11e9) == 2  # 0.9 * 11 - 4 = 5.9 -> 2 images
    assert step.largest_micro_batch(4e9) == 0


def test_step_memory_counts_what_lies_outside_the_allocator():
    """Would catch: the outside bytes left out of the peak or the fit, or counted once rather
    than per image."""
    step = StepMemory(weights=1e9, gradients=1e9, optimizer=2e9, activations_per_image=1e9, outside=0.5e9,
                      outside_per_image=0.1e9)
    assert step.peak(3) == pytest.approx(4e9 + 0.5e9 + 3 * 1.1e9)
    assert step.largest_micro_batch(11e9) == 4  # 0.9 * 11 - 4 - 0.5 = 5.4 -> 4 images of 1.1 (5 without outside)


def test_memory_command_runs_on_cpu_for_the_demo_config(capsys):
    """The CPU's report (train.device=cpu: on a GPU machine the command measures instead)."""
    assert main(["memory", "-c", "configs/demo.yaml", "--micro-batch", "4", "data.image_size=[128,192]",
                 "train.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "estimated on CPU" in out and "breakdown at micro-batch 4" in out
    for mode in ("none", "encoder", "full"):
        assert any(line.startswith(mode) for line in out.splitlines())
    assert "80 GB" in out and "11 GB" in out


def test_the_fit_table_keeps_its_columns_apart_when_a_cell_is_wide(capsys):
    """CPU, a micro-batch no card fits: every 'auto picks' cell is full/N. Would catch cells of
    ten characters in columns of nine ('full/1682full/2294...'), a table no one can read."""
    assert main(["memory", "-c", "configs/demo.yaml", "--micro-batch", "100000", "data.image_size=[64,96]",
                 "train.device=cpu"]) == 0
    table = capsys.readouterr().out.split("largest micro-batch that fits")[1].splitlines()[1:6]
    cells = [line[14:].split() for line in table]
    assert [len(row) for row in cells] == [14, 7, 7, 7, 7]  # the header's "6 GB" is two words
    assert all(cell.startswith("full/") for cell in cells[4])

    def ends(line):  # the columns where the row's cells end (right-aligned: the table's columns)
        return {i for i, char in enumerate(line) if i >= 14 and char != " " and line[i + 1:i + 2] in ("", " ")}

    assert ends(table[1]) == ends(table[2]) == ends(table[3]) == ends(table[4]) <= ends(table[0])


def test_the_retry_frees_the_failed_attempt_s_tensors_before_emptying_the_cache(monkeypatch):
    """On the CPU, the cache's release replaced by a probe: when the retry returns cached memory,
    a tensor that the failed forward held (as activations are held by the error's traceback)
    must already be gone, or torch.cuda.empty_cache() could not give its memory back. Would
    catch: empty_cache called inside the except block (so until issue #22)."""
    import weakref

    from cloudseg import engine

    held, alive_at_release = [], []

    def failing_forward(module, args):
        if torch.is_grad_enabled() and len(args[0]) > 1:
            activation = torch.empty(1000)  # a local of the failing frame, which the traceback keeps
            held.append(weakref.ref(activation))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine, "return_cached_memory",
                        lambda device: alive_at_release.append(any(ref() is not None for ref in held)))
    net, sgd = model_and_sgd()
    net.register_forward_pre_hook(failing_forward)
    assert run_windows(net, sgd, micro_batch=2, n_images=4, accumulation=1, loader_batch=2) == 1
    assert held and alive_at_release == [False]
