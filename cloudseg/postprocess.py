"""From probabilities at submission size to binary masks, and the search for the rule's parameters.

The rule, per class: quantize probabilities to uint8 (as out-of-fold files store them), keep
pixels above the threshold, drop 8-connected components smaller than the minimum area, and
empty the mask unless the mean of its image's `top_k` highest probabilities clears the gate.
Tuning and prediction apply this same rule to the same uint8 values.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from cloudseg.task import LABELS

TOP_K = 1000  # pixels whose mean probability the empty-mask gate looks at (0.5% of 350x525)
THRESHOLDS = tuple(round(0.20 + 0.03 * i, 2) for i in range(20))
MIN_AREAS = (0, 1000, 2500, 5000, 7500, 10000, 12500, 15000, 20000, 25000)
GATES = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


RULE_KEYS = ("threshold", "min_area", "gate")


def read_rule_file(path: str | Path) -> dict:
    """A postprocess.json written by `cloudseg tune` (the rule, under RULE_KEYS, and its CV figures)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: post-processing file not found (cloudseg tune writes it)")
    try:
        result = json.loads(path.read_text())
        missing = [key for key in RULE_KEYS if key not in result]
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a cloudseg postprocess.json ({type(error).__name__}: {error})") from None
    if missing:
        raise ValueError(f"{path}: not a cloudseg postprocess.json (no {', '.join(missing)})")
    return result


def quantize(probs) -> np.ndarray:
    """Probabilities in [0, 1] as uint8 0-255 (the compact form of out-of-fold files)."""
    return np.clip(np.rint(np.asarray(probs, np.float32) * 255), 0, 255).astype(np.uint8)


def postprocess(probs, thresholds, min_areas, gates=(0.0,) * len(LABELS), top_k: int = TOP_K) -> np.ndarray:
    """(N, 4, H, W) probabilities (float or uint8) -> uint8 masks by the rule above."""
    probs8 = probs if probs.dtype == np.uint8 else quantize(probs)
    masks = np.zeros(probs8.shape, np.uint8)
    top_means = top_k_mean(probs8, top_k) if any(gates) else np.ones(probs8.shape[:2])
    for index in np.ndindex(probs8.shape[:2]):
        label = index[1]
        if top_means[index] < gates[label]:
            continue
        mask = (probs8[index] > thresholds[label] * 255).view(np.uint8)
        if min_areas[label] > 0 and mask.any():
            mask = remove_small_components(mask, min_areas[label])
        masks[index] = mask
    return masks


def top_k_mean(probs8: np.ndarray, top_k: int = TOP_K) -> np.ndarray:
    """Mean of the `top_k` highest probabilities of each mask (shape probs8.shape[:-2]), in [0, 1]."""
    flat = probs8.reshape(*probs8.shape[:-2], -1)
    top_k = min(top_k, flat.shape[-1])
    top = np.partition(flat, flat.shape[-1] - top_k, axis=-1)[..., -top_k:]
    return top.mean(-1, dtype=np.float64) / 255


def remove_small_components(mask: np.ndarray, min_area: int) -> np.ndarray:
    """The mask without its 8-connected components smaller than `min_area` pixels."""
    count, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    keep = stats[:, cv2.CC_STAT_AREA] >= min_area
    keep[0] = False  # background
    return keep[labels].astype(np.uint8)


# ---------------------------------------------------------------------------------- search


def grid_scores(probs8: np.ndarray, truth: np.ndarray, thresholds=THRESHOLDS, min_areas=MIN_AREAS,
                gates=GATES, top_k: int = TOP_K) -> np.ndarray:
    """Mean Dice of one class over N images for every (threshold, min area, gate): shape (T, A, G).

    Components are labelled once per image and threshold, and their areas compared with all
    minimum areas at once; a threshold that empties a mask ends that image's loop (higher
    ones are empty too).
    """
    thresholds, min_areas, gates = (np.asarray(v, np.float64) for v in (thresholds, min_areas, gates))
    pred_area = np.zeros((len(probs8), len(thresholds), len(min_areas)))
    overlap = np.zeros_like(pred_area)
    for i in range(len(probs8)):
        pred_area[i], overlap[i] = _areas(probs8[i], truth[i], thresholds, min_areas)
    truth_area = truth.reshape(len(truth), -1).sum(1).astype(np.float64)[:, None, None]
    total = pred_area + truth_area
    dice = np.where(total == 0, 1.0, 2 * overlap / np.maximum(total, 1))  # (N, T, A)
    open_gate = top_k_mean(probs8, top_k)[:, None] >= gates[None, :]  # (N, G)
    empty_dice = (truth_area[:, 0, 0] == 0).astype(np.float64)  # what a gated-out mask scores
    scores = np.where(open_gate[:, None, None, :], dice[..., None], empty_dice[:, None, None, None])
    return scores.mean(0)


def _areas(probs8, truth, thresholds, min_areas) -> tuple[np.ndarray, np.ndarray]:
    """Kept area and kept overlap with the truth, per (threshold, min area), for one mask."""
    pred_area = np.zeros((len(thresholds), len(min_areas)))
    overlap = np.zeros_like(pred_area)
    smallest_positive = min_areas[min_areas > 0].min(initial=np.inf)
    for t, threshold in enumerate(thresholds):
        mask = (probs8 > threshold * 255).view(np.uint8)
        x, y, w, h = cv2.boundingRect(mask)
        if w == 0:
            break  # empty, and so is every higher threshold
        mask, crop_truth = mask[y : y + h, x : x + w], truth[y : y + h, x : x + w]
        area, hits = float(mask.sum()), float(np.count_nonzero(mask & crop_truth))
        if area < smallest_positive:  # every positive minimum area empties it; no labelling needed
            pred_area[t] = np.where(min_areas == 0, area, 0)
            overlap[t] = np.where(min_areas == 0, hits, 0)
            continue
        count, labels, stats, _ = cv2.connectedComponentsWithStatsWithAlgorithm(mask, 8, cv2.CV_16U, cv2.CCL_SPAGHETTI)
        areas = stats[1:, cv2.CC_STAT_AREA].astype(np.float64)
        hits_per = np.bincount(labels[crop_truth], minlength=count)[1:].astype(np.float64)
        keep = areas[:, None] >= min_areas[None, :]  # (components, A)
        pred_area[t], overlap[t] = areas @ keep, hits_per @ keep
    return pred_area, overlap
