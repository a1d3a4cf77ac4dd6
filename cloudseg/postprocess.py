"""From probabilities at submission size to binary masks: threshold, then drop small components."""

from __future__ import annotations

import cv2
import numpy as np


def postprocess(probs: np.ndarray, thresholds, min_areas) -> np.ndarray:
    """(N, 4, H, W) probabilities -> uint8 masks: per-class threshold, then per-class minimum
    connected-component area (8-connectivity, in pixels)."""
    masks = (probs > np.asarray(thresholds, np.float32)[None, :, None, None]).astype(np.uint8)
    for index in np.ndindex(masks.shape[:2]):
        min_area = min_areas[index[1]]
        if min_area > 0 and masks[index].any():
            masks[index] = remove_small_components(masks[index], min_area)
    return masks


def remove_small_components(mask: np.ndarray, min_area: int) -> np.ndarray:
    """The mask without its connected components smaller than `min_area` pixels."""
    count, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    keep = stats[:, cv2.CC_STAT_AREA] >= min_area
    keep[0] = False  # background
    return keep[labels].astype(np.uint8)
