"""Loading a checkpoint runs no code; what is saved loads under weights_only=True, RNG states exactly."""

import collections
import contextlib
import os
import pickle
import random
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from cloudseg.checkpoint import load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from cloudseg.cli import main
from cloudseg.data import Problem

PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, dict, collections.OrderedDict)


def draws() -> list:
    """Numbers from every random stream a run uses, Gaussian caches included."""
    return [random.random(), random.gauss(0, 1), *np.random.rand(3), np.random.standard_normal(),
            *torch.rand(3).tolist()]


def old_style_state() -> dict:
    """A checkpoint as cloudseg wrote it before the safe format: the libraries' RNG tuples (NumPy's
    holds an array), NumPy floats in the metrics, a Problem in an interrupted epoch's progress."""
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached Gaussian in both states
    return {"model": {"weight": torch.arange(4.0)}, "config": {"seed": 3}, "epoch": 0, "step": 2,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "metrics": [{"epoch": 1, "dice": np.float64(0.5)}],
            "progress": {"windows": 2, "skipped_samples": [Problem("0000001.jpg", "train_images/0000001.jpg: unreadable")]}}


def assert_plain(value, where="state"):
    """The independent check: only the types weights_only=True rebuilds without any import."""
    assert isinstance(value, torch.Tensor) or type(value) in PLAIN_TYPES, f"{where}: {type(value)}"
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            assert_plain(item, f"{where}[{index}]")
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) in (str, int), f"{where} key {key!r}"
            assert_plain(item, f"{where}[{key!r}]")


def test_saved_rng_states_restore_every_stream_exactly(tmp_path):
    """Catches storing a seed instead of the state, dropping Python's or NumPy's cached Gaussian,
    and losing bits of NumPy's uint32 key (e.g. through float32 or int32)."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in both states
    state = {"model": {}, "config": {}, "epoch": 0, "step": 0, "rng": rng_states()}
    save_checkpoint(tmp_path / "last.pt", state)
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_states(load_checkpoint(tmp_path / "last.pt")["rng"])
    assert draws() == expected


def test_a_training_state_saves_as_plain_values_that_load_safely(tmp_path):
    """Catches NumPy floats left in the metrics, a NamedTuple kept as such (both make
    weights_only=True refuse the file), and a state dict losing its _metadata (module versions)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.rand(2, 3, 8, 8)).mean().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {**old_style_state(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
             "rng": rng_states()}
    save_checkpoint(tmp_path / "last.pt", state)
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert_plain(loaded)
    assert loaded["metrics"] == [{"epoch": 1, "dice": 0.5}] and type(loaded["metrics"][0]["dice"]) is float
    assert loaded["progress"]["skipped_samples"] == [["0000001.jpg", "train_images/0000001.jpg: unreadable"]]
    assert loaded["model"]._metadata == model.state_dict()._metadata
    nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).load_state_dict(loaded["model"])


@pytest.mark.parametrize("bad, where, kind", [({"seen": {1, 2}}, "['seen']", "builtins.set"),
                                              ({"array": np.zeros(3)}, "['array']", "numpy.ndarray"),
                                              ({"dirs": [Path("run")]}, "['dirs'][0]", "pathlib.")])
def test_save_refuses_what_would_not_load_safely(tmp_path, bad, where, kind):
    """Catches pickling any object as it is (the file would be refused on load), converting an
    array silently, and an error that does not say where the object is."""
    state = {"model": {}, "config": {}, "epoch": 0, "step": 0, "progress": bad}
    with pytest.raises(TypeError, match=re.escape(f"{tmp_path / 'last.pt'}: state['progress']{where} is a {kind}")):
        save_checkpoint(tmp_path / "last.pt", state)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- old checkpoints


def test_an_old_checkpoint_is_refused_with_the_command_that_converts_it(tmp_path):
    """Catches loading it with pickle behind the user's back, and an error that does not say what to do."""
    torch.save(old_style_state(), tmp_path / "last.pt")
    with pytest.raises(ValueError) as refused:
        load_checkpoint(tmp_path / "last.pt")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'last.pt'}: ")
    assert f"cloudseg convert-checkpoint {tmp_path / 'last.pt'} --trust" in message


def test_convert_checkpoint_needs_trust_then_writes_the_safe_format_with_the_same_streams(tmp_path, capsys):
    """Catches converting without the user's word, a conversion that changes the RNG streams
    (e.g. re-seeding, or dropping the cached Gaussians), and one whose output still needs pickle."""
    old, new = tmp_path / "last.pt", tmp_path / "converted.pt"
    state = old_style_state()
    torch.save(state, old)
    before = old.read_bytes()
    assert main(["convert-checkpoint", str(old), "--out", str(new)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and str(old) in error and "--trust" in error
    assert old.read_bytes() == before and not new.exists()

    assert main(["convert-checkpoint", str(old), "--out", str(new), "--trust"]) == 0
    converted = load_checkpoint(new)
    assert_plain(torch.load(new, weights_only=True))
    assert converted["progress"]["skipped_samples"] == [list(state["progress"]["skipped_samples"][0])]
    random.setstate(state["rng"]["python"]), np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    expected = draws()
    restore_rng_states(converted["rng"])
    assert draws() == expected


# ---------------------------------------------------------------------------------- planted code


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path, marker, how="torch.save"):
    """A file that looks like a checkpoint and creates `marker` when unpickled."""
    state = {"model": {}, "config": {}, "epoch": 0, "step": 0, "metrics": [RunsCode(marker)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "torch.save":
        torch.save(state, path)
    else:  # an old-style bare pickle, which torch.load also accepts
        path.write_bytes(pickle.dumps(state))
    return path


@pytest.mark.parametrize("how", ["torch.save", "bare pickle"])
def test_the_planted_file_does_run_code_when_unpickled(tmp_path, how):
    """Without this, the refusal tests below could pass because the plant is inert."""
    planted = plant(tmp_path / "evil.pt", tmp_path / "MARKER", how)
    with contextlib.suppress(RuntimeError):  # a bare pickle: torch complains only after unpickling it
        torch.load(planted, weights_only=False)
    assert (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("how", ["torch.save", "bare pickle"])
@pytest.mark.parametrize("command", ["predict", "oof", "train --resume", "convert-checkpoint"])
def test_every_command_refuses_a_planted_checkpoint_without_running_it(tmp_path, capsys, command, how):
    """Catches any of the commands loading with weights_only=False (the marker would exist), and
    a refusal that is a traceback or does not name the file."""
    marker = tmp_path / "MARKER"
    if command == "train --resume":
        planted = plant(tmp_path / "run" / "last.pt", marker, how)
        argv = ["train", "--resume", str(planted.parent)]
    else:
        planted = plant(tmp_path / "best.pt", marker, how)
        argv = {"predict": ["predict", "--checkpoint", str(planted), "--out", str(tmp_path / "submission.csv")],
                "oof": ["oof", "--checkpoint", str(planted)],
                "convert-checkpoint": ["convert-checkpoint", str(planted)]}[command]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith(f"cloudseg: error: {planted}: "), error
    if how == "torch.save":
        assert "posix.system" in error
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_is_called_unreadable_not_dangerous(tmp_path):
    """A web page saved as best.pt (a failed download) and random bytes: 'not a readable checkpoint',
    not the refusal of code (which would send the user to convert-checkpoint --trust). Would
    catch every unpickling error of weights_only taken for an object it refuses to build."""
    from cloudseg.checkpoint import UnsafeCheckpoint

    for name, content in (("page.pt", b"<!DOCTYPE html><html><body>Not Found</body></html>"),
                          ("noise.pt", bytes(range(256)) * 4)):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}: not a readable checkpoint") as raised:
            load_checkpoint(path)
        assert not isinstance(raised.value, UnsafeCheckpoint)


@pytest.mark.parametrize("command", ["predict", "oof", "swa"])
def test_a_run_folder_given_as_a_checkpoint_names_the_file_to_give(tmp_path, capsys, command):
    """Would catch: 'checkpoint not found' for a folder that is there (the user gave the run, not
    its best.pt)."""
    run = tmp_path / "run"
    run.mkdir()
    argv = {"predict": ["predict", "--checkpoint", str(run), "--out", str(tmp_path / "submission.csv")],
            "oof": ["oof", "--checkpoint", str(run)],
            "swa": ["swa", str(run), str(run), "--out", str(tmp_path / "swa.pt")]}[command]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"cloudseg: error: {run}: a folder, not a checkpoint; name the file (a run's is {run / 'best.pt'})")
