"""Out-of-fold probabilities: each held-out image's probabilities at 350×525, stored once, so
tuning and ensembling never need the model again.

Data path: checkpoint → **probabilities at 350×525 of the held-out fold** (oof.npz) → the
post-processing search (tune.py).

An every-fold run (every_fold.py) also writes RUN/insample.npz, the same format: the folds'
ensemble (predict's) on every training image, which the run's rule is tuned on beside the
out-of-fold images (tune.py), so that the rule fits the ensemble it is applied to.

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

from cloudseg.checkpoint import fold_checkpoints
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
IN_SAMPLE_FILE = "insample.npz"


def predict_oof(model, config: Config, device, *, stop_requested=None) -> tuple[list[str], np.ndarray, np.ndarray,
                                                                               np.ndarray | None]:
    """(ids, uint8 probabilities, true masks, uint8 head probabilities or None) of the held-out
    fold of `config`, at 350×525; `stop_requested` is asked before every batch (StopRequested)."""
    _, valid_ids = fold_ids(config.data, config.seed)
    return predict_images([model], config, valid_ids, device, stop_requested=stop_requested)


def predict_in_sample(checkpoints: list[Path], device) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
    """As `predict_oof`, for the ensemble of an every-fold run's folds (`checkpoints`, combined
    as predict combines them) on every training image: each image was in the training set of
    all folds but one."""
    loaded = [load_model(path, device) for path in checkpoints]
    config = loaded[0][1]
    train_ids, valid_ids = fold_ids(config.data, config.seed)
    return predict_images([model for model, _ in loaded], config, sorted(train_ids + valid_ids), device,
                          desc="in-sample")


@torch.no_grad()
def predict_images(models: list, config: Config, image_ids: list[str], device, *, stop_requested=None,
                   desc: str = "out-of-fold") -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids, uint8 probabilities, true masks, uint8 head probabilities or None) of the training
    images `image_ids` (those readable) by the models' `batch_probabilities`, at 350×525."""
    dataset = CloudDataset(config.data.dir, "train", image_ids, None, config.data.image_size, config.data.on_bad_sample,
                           decode=resolve_decode(config.data.decode, device))
    loader = make_loader(dataset, config.data, config.predict.batch_size, device)
    dtype = autocast_dtype(config.train.precision, device)
    for model in models:
        model.eval()
    ids, probs, truth, classes = [], [], [], []
    batches = readable(until_stopped(loader, stop_requested), [])  # validation reported the skips
    for batch in tqdm(batches, desc=desc, unit="batch", total=len(loader), disable=None):
        ids.extend(batch["image_id"])
        batch = decode_batch(batch, device)
        out = batch_probabilities(models, batch["image"].to(device), dtype, config.predict)
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
    computed on `device` (auto, cpu or cuda); for an every-fold run's best.pt, its folds'
    ensemble on every training image (RUN/insample.npz)."""
    device = resolve_device(device, "--device")
    speed_switches(device, inference=True)
    if folds := fold_checkpoints(checkpoint):
        out = Path(out) if out else Path(checkpoint).parent / IN_SAMPLE_FILE
        write_oof(out, *predict_in_sample(folds, device))
        return out
    model, config = load_model(checkpoint, device)
    out = Path(out) if out else Path(checkpoint).parent / OOF_FILE
    write_oof(out, *predict_oof(model, config, device))
    return out
