"""A non-finite loss or gradient skips the window, is counted, and K in a row stop the run."""

import copy

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from cloudseg.checkpoint import load_checkpoint
from cloudseg.config import load_config
from cloudseg.engine import StepContext, train_step, windows
from cloudseg.train import train
from tests.conftest import assert_same_parameters
from tests.test_accumulation import CPU, Images, model_and_sgd
from tests.conftest import TINY


def poison(model, calls_to_poison):
    """Make the model's forward return NaN logits on the given (1-based) training calls."""
    forward, calls = model.forward, []

    def poisoned(images):
        out = forward(images)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) in calls_to_poison:
                return out * float("nan")
        return out

    model.forward = poisoned
    return model


@pytest.mark.parametrize("fp16", [False, True])
def test_a_nan_window_makes_no_update(fp16):
    model, optimizer = model_and_sgd(dtype=torch.float32)
    before = copy.deepcopy(model)
    poison(model, {2})  # the second micro-batch of the window
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=fp16)
    (window,) = list(windows(DataLoader(Images(4), batch_size=2), 2))
    step = train_step(StepContext(model, optimizer, scaler, CPU, torch.float16 if fp16 else None, 1.0, 1.0), window)
    assert step.skipped
    assert_same_parameters(model, before, tol=0)
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into the next window
    if fp16:
        assert scaler.get_scale() == 2.0**7  # the scaler's own skip: it backs off
    healthy = train_step(StepContext(model, optimizer, scaler, CPU, torch.float16 if fp16 else None, 1.0, 1.0), window)
    assert not healthy.skipped


def test_one_bad_window_is_skipped_and_counted(data_copy, tmp_path, wrap_built_models, caplog):
    data = data_copy
    wrap_built_models(lambda model: poison(model, {3}))
    train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY]), tmp_path / "run")
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert metrics["skipped_windows"].tolist() == [1, 0]  # micro-batch 3 lies in epoch 1's second window
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    windows_per_epoch = -(-int(len(pd.read_csv(data / "folds.csv").query("fold != 0"))) // 4)
    assert state["step"] == 2 * windows_per_epoch - 1 == state["scheduler"]["last_epoch"]
    assert torch.isfinite(torch.cat([t.flatten().float() for t in state["model"].values()])).all()
    assert "not finite, window skipped (1 in a row)" in caplog.text


def test_k_bad_windows_in_a_row_stop_the_run(data_copy, tmp_path, wrap_built_models):
    data = data_copy
    wrap_built_models(lambda model: poison(model, set(range(1, 100))))
    with pytest.raises(RuntimeError, match="2 windows in a row had a non-finite loss or gradient"):
        train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY, "train.max_skipped_windows=2"]), tmp_path / "run")


def test_fp16_overflow_in_several_micro_batches_halves_the_scale_once_per_window():
    """Would catch: unscaling, stepping or updating the GradScaler per micro-batch (the scale
    would halve once for each overflowing micro-batch, and a step could be taken with the
    healthy micro-batches alone)."""
    model, optimizer = model_and_sgd(dtype=torch.float32)
    before = copy.deepcopy(model)
    poison(model, {1, 3})  # two of the window's four micro-batches overflow
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    (window,) = list(windows(DataLoader(Images(8), batch_size=2), 4))
    step = train_step(StepContext(model, optimizer, scaler, CPU, torch.float16, 1.0, 1.0), window)
    assert step.skipped and scaler.get_scale() == 2.0**7
    assert_same_parameters(model, before, tol=0)
    healthy = train_step(StepContext(model, optimizer, scaler, CPU, torch.float16, 1.0, 1.0), window)
    assert not healthy.skipped and scaler.get_scale() == 2.0**8  # grows back once (growth_interval=1)
