"""A checkpoint is one dict: model, optimizer, scheduler, scaler, epoch, step, RNG states, config, metrics."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from cloudseg.files import atomic_path

REQUIRED_KEYS = ("model", "config", "epoch", "step")


def save_checkpoint(path: str | Path, state: dict) -> None:
    """torch.save through a temporary file, so a crash never leaves a half-written checkpoint."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path) -> dict:
    """The state dict saved by `save_checkpoint`, on CPU; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ValueError(f"{path}: not a readable checkpoint ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise ValueError(f"{path}: not a cloudseg checkpoint (expected keys {', '.join(REQUIRED_KEYS)})")
    return state


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
