"""SIGINT or SIGTERM finishes the window, saves a resumable checkpoint, and resume equals a straight run."""

import os
import re
import signal

import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg.checkpoint import load_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.train import Interrupted, train
from tests.conftest import TINY, signal_during


def signal_on_call(model, call, signum):
    return signal_during(model, call, signum)


def signal_on_evaluation(model, call, signum=signal.SIGTERM):
    return signal_during(model, call, signum, training=False)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_mid_epoch_then_resume_equals_a_straight_run(data_copy, tmp_path, wrap_built_models, capsys, signum):
    options = [f"data.dir={data_copy}", *TINY]
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN in a background job
    wrap_built_models(lambda model: signal_on_call(model, 3, signum))
    with pytest.raises(Interrupted, match=r"stopped after window 2 of epoch 1; continue with: cloudseg train --resume"):
        train(load_config("configs/demo.yaml", options), tmp_path / "stopped")
    saved = load_checkpoint(tmp_path / "stopped" / "last.pt")
    assert saved["epoch"] == 0 and saved["progress"]["windows"] == 2 and saved["step"] == 2
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the handlers are restored
    wrap_built_models(None)

    assert main(["train", "--resume", str(tmp_path / "stopped")]) == 0
    straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / "stopped/last.pt")
    assert straight["step"] == resumed["step"]
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    a, b = pd.read_csv(tmp_path / "straight/metrics.csv"), pd.read_csv(tmp_path / "stopped/metrics.csv")
    for column in ("epoch", "step", "train_loss", "valid_loss", "dice", "skipped_windows"):
        assert a[column].tolist() == pytest.approx(b[column].tolist()), column


def test_the_cli_says_how_to_resume(data_copy, tmp_path, wrap_built_models, capsys):
    wrap_built_models(lambda model: signal_on_call(model, 1, signal.SIGINT))
    run = tmp_path / "run"
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data_copy}", *TINY]) == 130
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


@pytest.mark.slow  # several training runs: make test-all
def test_a_stop_during_validation_or_the_out_of_fold_pass_is_honoured_within_a_batch(data_copy, tmp_path,
                                                                                     wrap_built_models):
    """Would catch: a stop that waits for validation (and a save and one more window) to
    finish, a stop ignored in the final out-of-fold pass, and a checkpoint from which resume
    does not give the straight run's model, metrics and oof.npz."""
    options = [f"data.dir={data_copy}", *TINY]  # 8 validation images in micro-batches of 2: 4 forwards per epoch
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")
    stops = {"validation": (2, "stopped while validating of epoch 1"),
             "oof": (9, "stopped while writing oof.npz (training is done)")}
    for where, (call, message) in stops.items():
        wrap_built_models(lambda model: signal_on_evaluation(model, call))
        with pytest.raises(Interrupted, match=re.escape(message)):
            train(load_config("configs/demo.yaml", options), tmp_path / where)
        wrap_built_models(None)
        assert main(["train", "--resume", str(tmp_path / where)]) == 0
        straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / where / "last.pt")
        for name, tensor in straight["model"].items():
            assert torch.equal(tensor, resumed["model"][name]), (where, name)
        a, b = pd.read_csv(tmp_path / "straight/metrics.csv"), pd.read_csv(tmp_path / where / "metrics.csv")
        assert a["dice"].tolist() == b["dice"].tolist() and a["valid_loss"].tolist() == b["valid_loss"].tolist()
        with np.load(tmp_path / "straight/oof.npz") as x, np.load(tmp_path / where / "oof.npz") as y:
            assert np.array_equal(x["probs"], y["probs"]) and np.array_equal(x["image_ids"], y["image_ids"])


@pytest.mark.slow  # several training runs: make test-all
def test_fp16_resume_mid_epoch_restores_the_grad_scaler_and_continues_bit_exactly(data_copy, tmp_path, wrap_built_models):
    """The pre-Ampere path (fp16 + GradScaler) on the CPU. Would catch: a checkpoint without
    the scaler state (the resumed scaler would restart at 65536 with no growth count), and a
    scaler restored after its first use."""
    options = [f"data.dir={data_copy}", *TINY, "train.precision=fp16", "train.device=cpu"]
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")
    wrap_built_models(lambda model: signal_on_call(model, 5, signal.SIGTERM))
    with pytest.raises(Interrupted, match="after window 3 of epoch 1"):
        train(load_config("configs/demo.yaml", options), tmp_path / "stopped")
    wrap_built_models(None)
    saved = load_checkpoint(tmp_path / "stopped/last.pt")["scaler"]
    assert saved["_growth_tracker"] > 0 or saved["scale"] != 2.0**16  # not a fresh scaler
    assert main(["train", "--resume", str(tmp_path / "stopped")]) == 0
    straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / "stopped/last.pt")
    assert straight["scaler"] == resumed["scaler"]
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks as the DataLoader's workers are forked on Linux")
def test_a_forked_worker_leaves_ctrl_c_to_the_process_that_asked(caplog):
    """CPU. Ctrl-C reaches the terminal's whole process group: the DataLoader's workers, forked
    with stop_requests' handler, got it too. Would catch: each worker taking it as its own stop
    request (the 'finishing the current window' warning said once per worker: three times in
    `make cv` with one worker), a worker that a second Ctrl-C no longer stops (the main process then
    waits out the loader's shutdown), or the process that asked no longer stopping."""
    from cloudseg.stopping import stop_requests

    with stop_requests() as stop_requested:
        child = os.fork()
        if child == 0:  # the worker: exit 3 if it took the signal as a request of its own, 4 if the second
            os.kill(os.getpid(), signal.SIGINT)  # did not stop it (the main process would wait out the loader)
            if stop_requested():
                os._exit(3)
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                os._exit(0)
            os._exit(4)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not stop_requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_requested() and "finishing the current window" in caplog.text
