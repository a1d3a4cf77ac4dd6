"""SIGINT or SIGTERM finishes the window, saves a resumable checkpoint, and resume equals a straight run."""

import os
import re
import shutil
import signal

import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.train import Interrupted, train
from tests.test_train import TINY


def signal_during(model, call, signum, training=True):
    """Deliver `signum` to this process at the `call`-th forward with gradients (training,
    mid-window) or without (validation, out-of-fold). A forward pre-hook, not a replaced
    `forward`: a deep copy of the model (train.ema's average) must not run this model's forward."""
    calls = []

    def hook(module, args):
        if torch.is_grad_enabled() == training:
            calls.append(1)
            if len(calls) == call:
                os.kill(os.getpid(), signum)

    model.register_forward_pre_hook(hook)
    return model


def signal_on_call(model, call, signum):
    return signal_during(model, call, signum)


def signal_on_evaluation(model, call, signum=signal.SIGTERM):
    return signal_during(model, call, signum, training=False)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_mid_epoch_then_resume_equals_a_straight_run(tiny_data, tmp_path, monkeypatch, capsys, signum):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    options = [f"data.dir={data}", *TINY]
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")

    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: signal_on_call(real_build(*a, **k), 3, signum))
    with pytest.raises(Interrupted, match=r"stopped after window 2 of epoch 1; continue with: cloudseg train --resume"):
        train(load_config("configs/demo.yaml", options), tmp_path / "stopped")
    saved = load_checkpoint(tmp_path / "stopped" / "last.pt")
    assert saved["epoch"] == 0 and saved["progress"]["windows"] == 2 and saved["step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    monkeypatch.setattr(train_module, "build_model", real_build)

    assert main(["train", "--resume", str(tmp_path / "stopped")]) == 0
    straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / "stopped/last.pt")
    assert straight["step"] == resumed["step"]
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    a, b = pd.read_csv(tmp_path / "straight/metrics.csv"), pd.read_csv(tmp_path / "stopped/metrics.csv")
    for column in ("epoch", "step", "train_loss", "valid_loss", "dice", "skipped_windows"):
        assert a[column].tolist() == pytest.approx(b[column].tolist()), column


def test_the_cli_says_how_to_resume(tiny_data, tmp_path, monkeypatch, capsys):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: signal_on_call(real_build(*a, **k), 1, signal.SIGINT))
    run = tmp_path / "run"
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *TINY]) == 130
    assert f"continue with: cloudseg train --resume {run}" in capsys.readouterr().err
    assert (run / "last.pt").is_file() and not (run / "best.pt").exists()


def test_progress_round_trips_through_plain_types_and_reads_the_earlier_unversioned_dict():
    """Would catch: a to_dict that leaves Problem tuples in (not loadable with weights_only=True),
    a from_dict that drops a tally, and a resume that no longer reads checkpoints written before
    Progress had a version (their key for skipped windows was "skipped")."""
    from cloudseg.data import Problem
    from cloudseg.train import Progress

    progress = Progress(windows=3, losses=[0.5, 0.25], images=12, skipped_windows=1, seconds=2.5,
                        skipped_samples=[Problem("a.jpg", "a.jpg: truncated JPEG")])
    raw = progress.to_dict()
    assert raw["version"] == Progress.VERSION
    assert raw["skipped_samples"] == [["a.jpg", "a.jpg: truncated JPEG"]]  # plain lists, no NamedTuple
    assert Progress.from_dict(raw) == progress
    earlier = {"windows": 3, "losses": [0.5, 0.25], "images": 12, "skipped": 1, "seconds": 2.5,
               "skipped_samples": [Problem("a.jpg", "a.jpg: truncated JPEG")]}
    assert Progress.from_dict(earlier) == progress
    with pytest.raises(ValueError, match="version 99"):
        Progress.from_dict({**raw, "version": 99})


def test_a_stop_during_validation_or_the_out_of_fold_pass_is_honoured_within_a_batch(tiny_data, tmp_path,
                                                                                     monkeypatch):
    """Would catch: a stop that waits for validation (and a save and one more window) to
    finish, a stop ignored in the final out-of-fold pass, and a checkpoint from which resume
    does not give the straight run's model, metrics and oof.npz."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    options = [f"data.dir={data}", *TINY]  # 8 validation images in micro-batches of 2: 4 forwards per epoch
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")
    real_build = train_module.build_model
    stops = {"validation": (2, "stopped while validating of epoch 1"),
             "oof": (9, "stopped while writing oof.npz (training is done)")}
    for where, (call, message) in stops.items():
        seen = []
        monkeypatch.setattr(train_module, "build_model",
                            lambda *a, **k: seen.append(signal_on_evaluation(real_build(*a, **k), call)) or seen[-1])
        with pytest.raises(Interrupted, match=re.escape(message)):
            train(load_config("configs/demo.yaml", options), tmp_path / where)
        monkeypatch.setattr(train_module, "build_model", real_build)
        assert main(["train", "--resume", str(tmp_path / where)]) == 0
        straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / where / "last.pt")
        for name, tensor in straight["model"].items():
            assert torch.equal(tensor, resumed["model"][name]), (where, name)
        a, b = pd.read_csv(tmp_path / "straight/metrics.csv"), pd.read_csv(tmp_path / where / "metrics.csv")
        assert a["dice"].tolist() == b["dice"].tolist() and a["valid_loss"].tolist() == b["valid_loss"].tolist()
        with np.load(tmp_path / "straight/oof.npz") as x, np.load(tmp_path / where / "oof.npz") as y:
            assert np.array_equal(x["probs"], y["probs"]) and np.array_equal(x["image_ids"], y["image_ids"])


def test_fp16_resume_mid_epoch_restores_the_grad_scaler_and_continues_bit_exactly(tiny_data, tmp_path, monkeypatch):
    """The pre-Ampere path (fp16 + GradScaler) on the CPU. Would catch: a checkpoint without
    the scaler state (the resumed scaler would restart at 65536 with no growth count), and a
    scaler restored after its first use."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    options = [f"data.dir={data}", *TINY, "train.precision=fp16", "train.device=cpu"]
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model",
                        lambda *a, **k: signal_on_call(real_build(*a, **k), 5, signal.SIGTERM))
    with pytest.raises(Interrupted, match="after window 3 of epoch 1"):
        train(load_config("configs/demo.yaml", options), tmp_path / "stopped")
    monkeypatch.setattr(train_module, "build_model", real_build)
    saved = load_checkpoint(tmp_path / "stopped/last.pt")["scaler"]
    assert saved["_growth_tracker"] > 0 or saved["scale"] != 2.0**16  # not a fresh scaler
    assert main(["train", "--resume", str(tmp_path / "stopped")]) == 0
    straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / "stopped/last.pt")
    assert straight["scaler"] == resumed["scaler"]
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
