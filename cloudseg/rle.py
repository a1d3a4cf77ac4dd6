"""Kaggle run-length encoding of binary masks: decoded where train.csv enters the Dataset,
encoded where the submission is written (the two ends of the data path).

Pixels are numbered from 1, top to bottom, then left to right (column-major), and a mask
is written as sorted, non-overlapping `start length` pairs: `1 3 10 5` is pixels 1-3 and
10-14. The empty string means an empty mask.

`decode` gives one mask as a NumPy array (the Dataset's CPU path). With `data.decode=gpu`
the workers hand over `runs` instead, and `decode_runs` decodes a whole batch of masks at
once with torch, on the batch's device.
"""

from __future__ import annotations

import math
import re

import cv2
import numpy as np
import torch

from cloudseg.task import IMAGE_SHAPE


def is_empty(rle) -> bool:
    """True for "", whitespace, None and NaN: the ways a CSV spells "no mask"."""
    if rle is None:
        return True
    if isinstance(rle, float):
        return math.isnan(rle)
    return not str(rle).strip()


MAX_VALUE = 2**62  # far above any image's pixels; two of them add up without overflowing int64
# Kaggle's RLE is ASCII digits; NumPy's int parsing would also take "+5", "1_000" and other
# scripts' digits ("５"), which no encoder writes. A minus passes here so that "-2" is told
# as a bad start, not as a non-integer.
NOT_RLE_CHARACTER = re.compile(r"[^0-9\s-]")
RLE_BYTES = b"0123456789-" + bytes(c for c in range(128) if chr(c).isspace())  # the same set in ASCII


def has_non_rle_character(text: str) -> bool:
    """Whether `text` holds a character NOT_RLE_CHARACTER matches; ASCII text (all of Kaggle's)
    by bytes.translate: 15 µs against the regular expression's 201 µs for a mask of 3,385 runs (2-core VM)."""
    if text.isascii():
        return bool(text.encode("ascii").translate(None, RLE_BYTES))
    return NOT_RLE_CHARACTER.search(text) is not None


def parse(rle) -> tuple[np.ndarray, np.ndarray]:
    """Validated 0-based run starts and run lengths (int64); ValueError says what is wrong."""
    if is_empty(rle):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    text = str(rle)
    tokens = text.split()
    if has_non_rle_character(text):  # before the count: a lone "NaN" is not one value short
        raise ValueError(f"RLE has a non-integer value {_first_non_integer(tokens)!r}")
    if len(tokens) % 2:
        raise ValueError(f"RLE has an odd number of values ({len(tokens)}); expected 'start length' pairs")
    try:
        values = np.array(tokens, dtype=np.int64)
    except (ValueError, OverflowError):
        raise ValueError(f"RLE has a non-integer value {_first_non_integer(tokens)!r}") from None
    if (bad := _first_true(values > MAX_VALUE)) is not None:  # start + length must not wrap around int64
        raise ValueError(f"RLE value {values[bad]} is larger than any image's pixel count")
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
            if NOT_RLE_CHARACTER.search(token):
                return token
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
    starts, ends = runs(rle, shape)
    lengths = ends - starts
    # Alternate 0-runs (the gaps) and 1-runs, then let np.repeat write them in one pass.
    counts = np.empty(2 * len(starts) + 1, np.int64)
    counts[0:-1:2] = starts - np.concatenate(([0], ends[:-1]))
    counts[1::2] = lengths
    counts[-1] = height * width - (ends[-1] if len(ends) else 0)
    values = np.zeros(len(counts), np.uint8)
    values[1::2] = 1
    return cv2.transpose(np.repeat(values, counts).reshape(width, height))


def runs(rle, shape: tuple[int, int] = IMAGE_SHAPE) -> np.ndarray:
    """2×K int64: the 0-based first pixel and the pixel after the last of each run of a mask
    of `shape`, validated (`parse`, and the last run ends inside the image)."""
    height, width = shape
    starts, lengths = parse(rle)
    ends = starts + lengths
    if len(ends) and ends[-1] > height * width:
        raise ValueError(
            f"RLE run {int(starts[-1]) + 1} {int(lengths[-1])} ends past the last pixel "
            f"{height * width} of a {height}x{width} image"
        )
    return np.stack((starts, ends))


def concat_runs(masks_runs: list[torch.Tensor], pixels: int) -> torch.Tensor:
    """The `runs` of several masks of `pixels` pixels each as the runs of one long mask, the
    masks numbered one after another (what `decode_runs` takes)."""
    return torch.cat([mask_runs + index * pixels for index, mask_runs in enumerate(masks_runs)], dim=1)


def decode_runs(all_runs: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Masks of `shape` (…×H×W, uint8 0/1) from the runs of all of them numbered one mask after
    another (`concat_runs`), each mask column-major as in `decode`, on the runs' device.

    Each run adds 1 at its first pixel and takes 1 away after its last; a cumulative sum then
    counts the runs covering each pixel: 0 or 1, as runs do not overlap. It runs in uint8,
    where -1 is 255 and sums wrap at 256, so the count is exact and the buffer one byte a pixel.
    """
    *masks, height, width = shape
    edges = torch.zeros(math.prod(shape) + 1, dtype=torch.uint8, device=all_runs.device)
    # starts are distinct, and so are ends. Not `edges[starts] = 1`: on CUDA, torch < 2.15 copies
    # that 1 from the host and waits for every queued kernel (an H100 showed it, once per micro-batch)
    edges.index_fill_(0, all_runs[0], 1)
    edges[all_runs[1]] -= 1  # where a run starts right after another ends, 1 - 1 = 0
    covered = edges.cumsum(0, dtype=torch.uint8)[:-1]
    return covered.view(*masks, width, height).transpose(-1, -2).contiguous()


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
