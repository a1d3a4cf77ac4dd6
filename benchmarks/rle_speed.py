"""RLE codec speed at full resolution (1400×2100) on one core; prints a table.

Targets (issue 2): decode of a mask with ~2,000 runs ≤ 1 ms, encode ≤ 3 ms.
Usage: python benchmarks/rle_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import platform
import timeit

os.environ.setdefault("OMP_NUM_THREADS", "1")

import cv2  # noqa: E402
import numpy as np  # noqa: E402

from cloudseg import rle  # noqa: E402
from cloudseg.task import IMAGE_SHAPE  # noqa: E402


def box_mask(n_boxes: int, seed: int = 0) -> np.ndarray:
    """Crowd-label-like mask: a few large boxes (about n_boxes runs per column they cross)."""
    rng = np.random.default_rng(seed)
    height, width = IMAGE_SHAPE
    mask = np.zeros(IMAGE_SHAPE, np.uint8)
    for _ in range(n_boxes):
        h, w = rng.integers(200, 700), rng.integers(300, 1200)
        y, x = rng.integers(0, height - h), rng.integers(0, width - w)
        mask[y : y + h, x : x + w] = 1
    return mask


def best_ms(function, repeat: int) -> float:
    return min(timeit.repeat(function, number=repeat, repeat=5)) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    cv2.setNumThreads(1)
    cases = {"2 boxes": box_mask(2), "4 boxes": box_mask(4, seed=1), "speckle (1% noise)": None}
    speckle = box_mask(2)
    speckle[np.random.default_rng(2).random(IMAGE_SHAPE) < 0.01] ^= 1
    cases["speckle (1% noise)"] = speckle
    print(f"RLE codec at {IMAGE_SHAPE[0]}x{IMAGE_SHAPE[1]}, one core, {platform.processor() or platform.machine()}")
    print(f"{'mask':<20} {'runs':>7} {'decode ms':>10} {'encode ms':>10}")
    for name, mask in cases.items():
        encoded = rle.encode(mask)
        assert np.array_equal(rle.decode(encoded), mask)
        runs = len(encoded.split()) // 2
        decode_ms = best_ms(lambda: rle.decode(encoded), args.repeat)
        encode_ms = best_ms(lambda: rle.encode(mask), args.repeat)
        print(f"{name:<20} {runs:>7} {decode_ms:>10.3f} {encode_ms:>10.3f}")
    print("targets: decode <= 1 ms and encode <= 3 ms at ~2,000 runs")


if __name__ == "__main__":
    main()
