"""The Kaggle metric: mean Dice over every (image, label) pair, compared at 350×525.

Data path: the score of the last steps (probabilities at 350×525 → post-process →
submission), in validation, tuning and `cloudseg evaluate`.

Resize rule (how anything reaches 350×525 before it is compared or encoded):
  - binary masks: nearest neighbour, sampling each output pixel's centre
    (`nearest-exact`). Resizing a mask bilinearly and thresholding at > 0 dilates it.
  - probabilities: when shrinking, the area average (each output pixel is the mean
    probability of the block it covers: exactly the 4×4 block for 1400×2100 -> 350×525);
    when enlarging (small synthetic images), bilinear. Threshold only after resizing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cloudseg.data import decode_masks, read_label_csv
from cloudseg.task import LABELS, SUBMISSION_SHAPE


def dice(pred, truth):
    """Dice of each pair of binary masks over the last two dims; 1 where both are empty.

    NumPy arrays give a float64 array, torch tensors a float64 tensor, of shape
    `pred.shape[:-2]`. Any nonzero pixel counts as part of the mask.
    """
    if tuple(pred.shape) != tuple(truth.shape):
        raise ValueError(f"dice needs masks of equal shape, got {tuple(pred.shape)} and {tuple(truth.shape)}")
    if isinstance(pred, torch.Tensor):
        pred, truth = pred != 0, truth != 0
        overlap = (pred & truth).sum((-2, -1)).double()
        total = (pred.sum((-2, -1)) + truth.sum((-2, -1))).double()
        return torch.where(total == 0, 1.0, 2 * overlap / total.clamp(min=1))
    pred, truth = np.asarray(pred) != 0, np.asarray(truth) != 0
    overlap = (pred & truth).sum((-2, -1), dtype=np.float64)
    total = pred.sum((-2, -1), dtype=np.float64) + truth.sum((-2, -1), dtype=np.float64)
    return np.where(total == 0, 1.0, 2 * overlap / np.maximum(total, 1))


def summarize(pair_dice) -> dict[str, float]:
    """`{"dice": mean over all pairs, "Fish": mean over Fish pairs, ...}` from an (N, 4) array."""
    pair_dice = np.asarray(pair_dice, dtype=np.float64)
    if pair_dice.ndim != 2 or pair_dice.shape[1] != len(LABELS):
        raise ValueError(f"expected per-pair Dice of shape (N, {len(LABELS)}), got {pair_dice.shape}")
    summary = {"dice": float(pair_dice.mean())}
    summary.update({label: float(v) for label, v in zip(LABELS, pair_dice.mean(axis=0))})
    return summary


def score(pred, truth) -> dict[str, float]:
    """Kaggle score of (N, 4, H, W) predicted masks against true masks: see `summarize`."""
    return summarize(np.asarray(dice(pred, truth)))


def resize_masks(masks, shape: tuple[int, int] = SUBMISSION_SHAPE):
    """Binary masks (..., H, W) to `shape`, nearest neighbour; returns the input's type (uint8)."""
    return _resize(masks, shape, mode="nearest-exact", dtype=torch.uint8)


def resize_probs(probs, shape: tuple[int, int] = SUBMISSION_SHAPE):
    """Probabilities (..., H, W) to `shape` (area when shrinking, else bilinear); float32, input's type."""
    shrinking = all(new <= old for new, old in zip(shape, probs.shape[-2:]))
    return _resize(probs, shape, mode="area" if shrinking else "bilinear", dtype=torch.float32)


def _resize(x, shape, mode, dtype):
    is_numpy = not isinstance(x, torch.Tensor)
    out = torch.as_tensor(np.ascontiguousarray(x) if is_numpy else x)  # also flipped views
    if tuple(out.shape[-2:]) != tuple(shape):
        lead = out.shape[:-2]
        flat = out.reshape(-1, 1, *out.shape[-2:]).float()
        options = {"align_corners": False} if mode == "bilinear" else {}
        out = F.interpolate(flat, size=tuple(shape), mode=mode, **options).reshape(*lead, *shape)
    # Already at `shape`, the input still gets the output's type: float32, or uint8 0/1 masks.
    out = out.to(dtype) if dtype == torch.float32 else (out != 0).to(dtype)
    return out.numpy() if is_numpy else out


def evaluate_submission(submission_path: str | Path, truth_path: str | Path) -> dict[str, float]:
    """Kaggle score of a submission CSV against a truth CSV, both encoded at 350×525."""
    submission, truth = read_label_csv(submission_path), read_label_csv(truth_path)
    missing = truth.index.difference(submission.index)
    extra = submission.index.difference(truth.index)
    if len(missing) or len(extra):
        raise ValueError(
            f"{submission_path}: {len(missing)} image(s) missing (e.g. {list(missing[:3])}) and "
            f"{len(extra)} not in the truth file (e.g. {list(extra[:3])})"
        )
    pair_dice = np.empty((len(truth), len(LABELS)))
    for row, image_id in enumerate(truth.index):
        pred = np.stack(decode_masks(submission, image_id, SUBMISSION_SHAPE, submission_path))
        pair_dice[row] = dice(pred, np.stack(decode_masks(truth, image_id, SUBMISSION_SHAPE, truth_path)))
    return summarize(pair_dice)
