"""Out-of-fold probabilities: each held-out image's probabilities at 350×525, stored once, so
tuning and ensembling never need the model again.

Data path: checkpoint → **probabilities at 350×525 of the held-out fold** (oof.npz) → the
post-processing search (tune.py).

An OOF file (`oof.npz`) holds `image_ids`, `probs` (N×4×350×525 uint8, probability × 255)
and `truth` (the true masks at 350×525, bit-packed along the last axis); for a model with a
classification head (model.cls_head) also `class_probs` (N×4 uint8, the head's probability × 255).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cloudseg.config import Config
from cloudseg.data import CloudDataset, fold_ids, make_loader, readable
from cloudseg.decode import decode_batch, resolve_decode
from cloudseg.files import atomic_path
from cloudseg.hardware import autocast_dtype, resolve_device, speed_switches
from cloudseg.metrics import resize_masks
from cloudseg.postprocess import quantize
from cloudseg.predict import batch_probabilities, load_model
from cloudseg.stopping import until_stopped
from cloudseg.task import SUBMISSION_SHAPE

OOF_FILE = "oof.npz"


@torch.no_grad()
def predict_oof(model, config: Config, device, *, stop_requested=None) -> tuple[list[str], np.ndarray, np.ndarray,
                                                                               np.ndarray | None]:
    """(ids, uint8 probabilities, true masks, uint8 head probabilities or None) of the held-out
    fold of `config`, at 350×525; `stop_requested` is asked before every batch (StopRequested)."""
    _, valid_ids = fold_ids(config.data, config.seed)
    dataset = CloudDataset(config.data.dir, "train", valid_ids, None, config.data.image_size, config.data.on_bad_sample,
                           decode=resolve_decode(config.data.decode, device))
    loader = make_loader(dataset, config.data, config.predict.batch_size, device)
    dtype = autocast_dtype(config.train.precision, device)
    model.eval()
    ids, probs, truth, classes = [], [], [], []
    batches = readable(until_stopped(loader, stop_requested), [])  # validation reported the skips
    for batch in tqdm(batches, desc="out-of-fold", unit="batch", total=len(loader), disable=None):  # validation reported skips
        ids.extend(batch["image_id"])
        batch = decode_batch(batch, device)
        out = batch_probabilities([model], batch["image"].to(device), dtype, config.predict)
        probs.append(quantize(out.submission.cpu().numpy()))
        truth.append(resize_masks(batch["mask"]).cpu().numpy().astype(bool))
        classes.append(None if out.classes is None else quantize(out.classes.cpu().numpy()))
    return ids, np.concatenate(probs), np.concatenate(truth), None if classes[0] is None else np.concatenate(classes)


def write_oof(path: str | Path, image_ids, probs: np.ndarray, truth: np.ndarray,
              class_probs: np.ndarray | None = None) -> None:
    if probs.dtype != np.uint8 or probs.shape[-2:] != SUBMISSION_SHAPE or probs.shape != truth.shape:
        raise ValueError(f"OOF arrays must be uint8 probs and masks of equal shape (N, 4, 350, 525), "
                         f"got {probs.dtype} {probs.shape} and {truth.shape}")
    if class_probs is not None and (class_probs.dtype != np.uint8 or class_probs.shape != probs.shape[:2]):
        raise ValueError(f"OOF head probabilities must be uint8 of shape {probs.shape[:2]}, "
                         f"got {class_probs.dtype} {class_probs.shape}")
    head = {} if class_probs is None else {"class_probs": class_probs}
    with atomic_path(path) as tmp, open(tmp, "wb") as file:
        np.savez(file, image_ids=np.asarray(image_ids, dtype=str), probs=probs, truth=np.packbits(truth, axis=-1),
                 **head)


def read_oof(path: str | Path, with_classes: bool = False):
    """(image ids, uint8 probabilities, boolean true masks) of an OOF file; `with_classes`: also
    the uint8 head probabilities (N×4), None for a model without a head."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no out-of-fold file (training writes it; or run cloudseg oof)")
    try:
        with np.load(path) as data:
            ids, probs, packed = data["image_ids"], data["probs"], data["truth"]
            classes = data["class_probs"] if "class_probs" in data.files else None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:  # empty, cut short, damaged
        raise ValueError(f"{path}: not a cloudseg OOF file ({error or type(error).__name__})") from None
    truth = np.unpackbits(packed, axis=-1, count=probs.shape[-1]).astype(bool)
    return (ids, probs, truth, classes) if with_classes else (ids, probs, truth)


def oof_from_checkpoint(checkpoint: str | Path, out: str | Path | None = None, device: str = "auto") -> Path:
    """`cloudseg oof`: the held-out fold of a checkpoint's run, written beside it by default,
    computed on `device` (auto, cpu or cuda)."""
    device = resolve_device(device, "--device")
    speed_switches(device, inference=True)
    model, config = load_model(checkpoint, device)
    out = Path(out) if out else Path(checkpoint).parent / OOF_FILE
    write_oof(out, *predict_oof(model, config, device))
    return out
