"""Checkpoints: what one may hold, and what loading one promises (the data path's
**checkpoint** step, between the accumulated steps and the probabilities at 350×525).

A cloudseg checkpoint is one dict written by `torch.save`: the model, optimizer, scheduler and
scaler state dicts (and later possibly an `ema` state dict), `epoch`, `step`, `rng` (the Python,
NumPy and torch random states, and every process's CUDA state of its own GPU, see `rng_states`),
`config` (a JSON-able dict), `metrics`
(a list of dicts of numbers) and `progress` (how far into an epoch a stopped run got, or None).

Every value in it is a tensor or a plain Python value: None, bool, int, float, str, bytes, and
lists, tuples and dicts of these (a state dict's OrderedDict included). `save_checkpoint` turns
NumPy scalars into Python numbers and NamedTuples into lists (a `cloudseg.data.Problem` is saved
as `[image_id, message]`: whoever reads `progress` back rebuilds it), and refuses anything else
with a TypeError naming the file and the key, so whatever it writes loads under weights_only=True.
The random states are stored as lists (see `plain_rng`) and restore every stream exactly.

Loading promises that the file's contents cannot run code: `load_checkpoint` uses
`torch.load(weights_only=True)`, which rebuilds only tensors and plain values and refuses any other
object before creating it (a pickle's `__reduce__` is never called). Such a file is refused with a
one-line ValueError (an `UnsafeCheckpoint`) naming the file and, where this torch can list them
without loading, the functions and classes it would have imported. The promise is torch's:
weights_only had known bypasses before torch 2.6 (CVE-2025-32434) and 2.10 (CVE-2026-24747).

Checkpoints written by cloudseg before this format (NumPy arrays in `rng`, NumPy floats in
`metrics`, Problems in `progress`) are refused the same way, with the command that converts them:
`cloudseg convert-checkpoint OLD --trust`. That loads the file unsafely, running any code it holds,
so it is for files the user wrote themselves; without --trust it explains this and stops.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from cloudseg.files import atomic_path

REQUIRED_KEYS = ("model", "config", "epoch", "step")
# An every-fold run's best.pt (cloudseg/every_fold.py) holds no model: under this key, its folds'
# checkpoints, relative to its folder, which prediction loads in its place (`fold_checkpoints`).
FOLDS = "folds"
PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
# What loading a checkpoint of an older cloudseg needs beyond plain values: NumPy arrays and scalars
# (the RNG states, metrics) and the Problems of an interrupted epoch.
OLD_FORMAT_CLASSES = ("cloudseg.data.Problem",)


class UnsafeCheckpoint(ValueError):
    """A file that torch.load(weights_only=True) refused: loading it could run code."""


def save_checkpoint(path: str | Path, state: dict) -> None:
    """torch.save of `state` in plain values (see the module docstring) through a temporary file,
    so a crash never leaves a half-written checkpoint."""
    state = plain(state, f"{path}: state")
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def plain(value, where: str = "value"):
    """`value` with NumPy scalars as Python numbers and NamedTuples as lists, so that it loads
    under weights_only=True; a TypeError naming `where` (a key path) for any other object."""
    if isinstance(value, torch.Tensor) or type(value) in PLAIN_SCALARS:
        return value
    if isinstance(value, np.generic) and type(value.item()) in PLAIN_SCALARS:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return tuple(items) if type(value) is tuple else items  # a NamedTuple becomes a list
    if type(value) in (dict, collections.OrderedDict):
        converted = copy.copy(value)  # a state dict's OrderedDict keeps its _metadata (module versions)
        for key, item in value.items():
            if type(key) not in PLAIN_SCALARS:
                raise TypeError(f"{where} has a key of type {type(key).__name__}: checkpoint keys are plain values")
            converted[key] = plain(item, f"{where}[{key!r}]")
        return converted
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a checkpoint holds only "
                    "tensors, None, bool, int, float, str, bytes, and lists, tuples and dicts of them")


def load_checkpoint(path: str | Path) -> dict:
    """The state dict saved by `save_checkpoint`, on CPU, loaded without running any code the
    file may hold; errors are one line naming the file."""
    return checked(torch_load(path, weights_only=True), Path(path))


def fingerprint(state: dict) -> str:
    """What tells a checkpoint from another without reading its weights again: a digest of how it
    was trained (its config, epoch, step, metrics and, after train.swa, the epochs it averages),
    the same wherever the file lies or is copied to. A run's best.pt and last.pt of one epoch share
    it, as they share their weights; a run trained on, or again on other data, has another."""
    trained = {key: state.get(key) for key in ("config", "epoch", "step", "metrics", "swa")}
    return hashlib.sha256(json.dumps(trained, sort_keys=True, default=str).encode()).hexdigest()[:16]


def torch_load(path: str | Path, *, weights_only: bool, mmap: bool = False):
    """torch.load on CPU (`mmap`: tensors mapped from the file, read when used); errors are one
    line naming the file."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a folder, not a checkpoint; name the file (a run's is {path / 'best.pt'})")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as error:
        # an object it will not build, in a torch.save file (a web page or random bytes fail to unpickle too)
        if weights_only and isinstance(error, pickle.UnpicklingError) and zipfile.is_zipfile(path):
            raise UnsafeCheckpoint(refusal(path)) from None
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"{path}: not a readable checkpoint ({type(error).__name__}: {first_line})") from None


def fold_checkpoints(path: str | Path) -> list[Path] | None:
    """The checkpoints an every-fold run's best.pt names (FOLDS), each there, or None for any other
    file. Its tensors are mapped, not read: a model's checkpoint costs this call little."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return None  # told by whoever loads it
    state = torch_load(path, weights_only=True, mmap=True)
    if not isinstance(state, dict) or FOLDS not in state:
        return None
    folds = [path.parent / fold for fold in state[FOLDS]]
    if missing := [str(fold) for fold in folds if not fold.is_file()]:
        raise FileNotFoundError(f"{path} predicts with the models of its {len(folds)} folds, and "
                                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    return folds


def checked(state, path: Path) -> dict:
    """`state` if it is a cloudseg checkpoint's dict, else a one-line error naming `path`."""
    if isinstance(state, dict) and FOLDS in state:
        raise ValueError(f"{path}: an every-fold run's best.pt, naming its folds' models ({', '.join(state[FOLDS])}); "
                         "predict and segment take it whole, anything else one fold's: give its folder's foldK/best.pt")
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise ValueError(f"{path}: not a cloudseg checkpoint (expected keys {', '.join(REQUIRED_KEYS)})")
    return state


def refusal(path: Path) -> str:
    """Why `path` did not load under weights_only=True, in one line: the code it would import,
    and for a checkpoint of an older cloudseg, how to convert it."""
    needed = unsafe_imports(path)
    if needed and all(name.startswith("numpy.") or name in OLD_FORMAT_CLASSES for name in needed):
        return (f"{path}: a checkpoint of an older cloudseg (it holds NumPy arrays), which loads only by running "
                f"the file's code; if you wrote it yourself, convert it: cloudseg convert-checkpoint {path} --trust")
    what = f"it would import {', '.join(needed)}" if needed else "it holds objects other than tensors and plain values"
    return f"{path}: refused: loading it could run code ({what}); a cloudseg checkpoint holds only tensors and plain values"


def unsafe_imports(path: Path) -> list[str]:
    """The functions and classes `path` would import to load, read without loading it ([] when
    this torch cannot tell, or the file is not a torch.save zip)."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # absent from older torch
    try:
        return sorted(find(path)) if find else []
    except Exception:  # not a zip checkpoint: the caller reports the refusal without names
        return []


def convert_checkpoint(old: str | Path, out: str | Path | None = None, *, trust: bool = False) -> Path:
    """Rewrite a checkpoint of an older cloudseg (NumPy arrays, Problems inside) in the safe format,
    at `out` (default: in place). Loading it runs any code the file holds, hence `trust`: the user's
    word that they wrote the file. A file that already loads safely needs no trust."""
    old = Path(old)
    out = Path(out) if out else old
    try:
        state = load_checkpoint(old)
    except UnsafeCheckpoint:
        if not trust:
            needed = unsafe_imports(old)
            what = f" (it would import {', '.join(needed)})" if needed else ""
            raise ValueError(f"{old}: converting loads the file with pickle, which runs any code it holds{what}; "
                             "if you wrote it yourself, rerun with --trust") from None
        state = checked(torch_load(old, weights_only=False), old)
        state["rng"] = plain_rng(state["rng"])
    save_checkpoint(out, state)
    return out


# ---------------------------------------------------------------------------------- random states


def rng_states(cuda_by_rank: list[torch.Tensor] | None = None) -> dict:
    """This process's random states (Python, NumPy, torch's CPU generator) in plain values, and
    under "cuda_by_rank" each process's state of its own GPU's generator, in rank order
    (`cuda_rng_state` of every rank, gathered by the caller; absent on a CPU)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if cuda_by_rank is not None:
        states["cuda_by_rank"] = list(cuda_by_rank)
    return plain_rng(states)


def cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of `device`'s CUDA generator (None on a CPU)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def plain_rng(states: dict) -> dict:
    """States as the libraries give them (Python's a tuple of ints, NumPy's a tuple holding a
    uint32 array) as lists, exactly: `restore_rng_states` turns them back."""
    version, internal, gauss_next = states["python"]
    algorithm, key, position, has_gauss, cached_gaussian = states["numpy"]
    return {**states, "python": [version, list(internal), gauss_next],
            "numpy": [algorithm, np.asarray(key).tolist(), int(position), int(has_gauss), float(cached_gaussian)]}


def restore_rng_states(states: dict, device: torch.device = torch.device("cpu"), rank: int = 0, world: int = 1,
                       fresh_cuda: torch.Tensor | None = None, where: str = "checkpoint") -> None:
    """Set this process's random states to `states` (from `rng_states`): this process (`rank`
    of `world`, on `device`) takes its own GPU's state (see `cuda_state_for`, which may refuse)."""
    cuda = cuda_state_for(states, device, rank, world, fresh_cuda, where)  # refused before anything is set
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    algorithm, key, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((algorithm, np.array(key, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def cuda_state_for(states: dict, device: torch.device, rank: int, world: int, fresh: torch.Tensor | None,
                   where: str) -> torch.Tensor | None:
    """The CUDA random state process `rank` of `world` continues from on `device`, or None
    (a CPU, or a run saved on CPUs: the generator stays as seeded).

    With as many processes as saved, each takes its own. With another number the streams
    cannot be dealt out again; that is still exact where no process's stream has moved since
    seeding (`fresh`: a generator's state right after the run's seed), that is where training
    draws nothing on the GPU (no dropout): then each continues from the seed. Otherwise a
    ValueError says to resume with the saved number. Checkpoints from before "cuda_by_rank"
    hold rank 0's states of every visible GPU under "cuda": each GPU takes its entry, as it
    did then, where the list has one.
    """
    if device.type != "cuda":
        return None
    if "cuda_by_rank" not in states:
        legacy = states.get("cuda", [])
        return legacy[device.index] if device.index < len(legacy) else None
    saved = states["cuda_by_rank"]
    if len(saved) == world:
        return saved[rank]
    if fresh is not None and all(torch.equal(state, fresh) for state in saved):
        return fresh
    raise ValueError(f"{where}: saved by {len(saved)} process(es) whose GPU random streams have moved (dropout or "
                     f"another random op on the GPU), and this run has {world}: it continues exactly only with "
                     f"{len(saved)}; resume with {len(saved)} (make train NPROC={len(saved)}, or torchrun "
                     f"--nproc_per_node {len(saved)} -m cloudseg train --resume ...)")
