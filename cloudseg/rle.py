"""Kaggle run-length encoding of binary masks: decoded where train.csv enters the Dataset,
encoded where the submission is written (the two ends of the data path).

Pixels are numbered from 1, top to bottom, then left to right (column-major), and a mask
is written as sorted, non-overlapping `start length` pairs: `1 3 10 5` is pixels 1-3 and
10-14. The empty string means an empty mask.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from cloudseg.task import IMAGE_SHAPE


def is_empty(rle) -> bool:
    """True for "", whitespace, None and NaN: the ways a CSV spells "no mask"."""
    if rle is None:
        return True
    if isinstance(rle, float):
        return math.isnan(rle)
    return not str(rle).strip()


def parse(rle) -> tuple[np.ndarray, np.ndarray]:
    """Validated 0-based run starts and run lengths (int64); ValueError says what is wrong."""
    if is_empty(rle):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    tokens = str(rle).split()
    if len(tokens) % 2:
        raise ValueError(f"RLE has an odd number of values ({len(tokens)}); expected 'start length' pairs")
    try:
        values = np.array(tokens, dtype=np.int64)
    except (ValueError, OverflowError):
        raise ValueError(f"RLE has a non-integer value {_first_non_integer(tokens)!r}") from None
    starts, lengths = values[0::2] - 1, values[1::2]
    if (bad := _first_true(starts < 0)) is not None:
        raise ValueError(f"RLE pair {bad + 1} has start {starts[bad] + 1}; starts count from 1")
    if (bad := _first_true(lengths < 1)) is not None:
        raise ValueError(f"RLE pair {bad + 1} has length {lengths[bad]}; lengths are at least 1")
    ends = starts + lengths
    if (bad := _first_true(starts[1:] < ends[:-1])) is not None:
        raise ValueError(
            f"RLE pairs {bad + 1} and {bad + 2} are unsorted or overlapping "
            f"(start {starts[bad + 1] + 1} comes before the end of run {starts[bad] + 1} {lengths[bad]})"
        )
    return starts, lengths


def _first_true(flags: np.ndarray) -> int | None:
    return int(np.argmax(flags)) if flags.any() else None


def _first_non_integer(tokens: list[str]) -> str:
    for token in tokens:
        try:
            np.int64(int(token))
        except (ValueError, OverflowError):
            return token
    return tokens[0]


def decode(rle, shape: tuple[int, int] = IMAGE_SHAPE) -> np.ndarray:
    """Mask of `shape` (uint8, 0/1) from a Kaggle RLE string.

    Runs are written in RLE (column-major) order into a W×H buffer, which OpenCV transposes
    several times faster than NumPy does.
    """
    height, width = shape
    starts, lengths = parse(rle)
    ends = starts + lengths
    if len(ends) and ends[-1] > height * width:
        raise ValueError(
            f"RLE run {int(starts[-1]) + 1} {int(lengths[-1])} ends past the last pixel "
            f"{height * width} of a {height}x{width} image"
        )
    # Alternate 0-runs (the gaps) and 1-runs, then let np.repeat write them in one pass.
    counts = np.empty(2 * len(starts) + 1, np.int64)
    counts[0:-1:2] = starts - np.concatenate(([0], ends[:-1]))
    counts[1::2] = lengths
    counts[-1] = height * width - (ends[-1] if len(ends) else 0)
    values = np.zeros(len(counts), np.uint8)
    values[1::2] = 1
    return cv2.transpose(np.repeat(values, counts).reshape(width, height))


def encode(mask) -> str:
    """Kaggle RLE string of a 2-D mask (any nonzero pixel counts); "" for an empty mask."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"encode takes a 2-D mask, got shape {mask.shape}")
    column_major = cv2.transpose(np.ascontiguousarray(mask != 0).view(np.uint8)).ravel()
    zero = np.zeros(1, np.uint8)
    padded = np.concatenate((zero, column_major, zero))
    edges = np.flatnonzero(padded[1:] != padded[:-1]) + 1
    edges[1::2] -= edges[0::2]
    return " ".join(map(str, edges.tolist()))
