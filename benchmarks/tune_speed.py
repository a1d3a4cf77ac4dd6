"""Post-processing search speed on one CPU core; prints a table.

Target (issues 5 and 12): 4 classes x 20 thresholds x 10 minimum areas (x 7 gates) over
1,100 images at 350x525 in <= 30 s on one core. The probabilities imitate a trained model's
out-of-fold output: box-shaped truths (like the crowd-drawn labels), blurred confident
cores, smooth low-frequency noise and some false-positive blobs. Besides wall-clock seconds
the table shows the process's CPU seconds, the fairer figure on a machine shared with
other jobs.

Usage: python benchmarks/tune_speed.py [--images N]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import cv2  # noqa: E402
import numpy as np  # noqa: E402

from cloudseg.postprocess import GATES, MIN_AREAS, THRESHOLDS, grid_scores, quantize  # noqa: E402
from cloudseg.task import LABELS, SUBMISSION_SHAPE  # noqa: E402


def model_like(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 probabilities, truth) for one class over n images."""
    height, width = SUBMISSION_SHAPE
    truth = np.zeros((n, height, width), bool)
    probs = np.empty((n, height, width), np.float32)
    for i in range(n):
        if rng.random() < 0.5:
            h, w = rng.integers(60, 250), rng.integers(80, 400)
            y, x = rng.integers(0, height - h), rng.integers(0, width - w)
            truth[i, y : y + h, x : x + w] = True
        coarse = rng.normal(0, 0.25, (12, 18)).astype(np.float32)
        noise = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
        core = cv2.blur(truth[i].astype(np.float32), (41, 41))
        probs[i] = np.clip(0.15 + 0.7 * core + noise, 0, 1)
    return quantize(probs), truth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=1100)
    args = parser.parse_args()
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    print(f"post-processing search over {args.images} images at {SUBMISSION_SHAPE[0]}x{SUBMISSION_SHAPE[1]}, "
          f"{len(THRESHOLDS)} thresholds x {len(MIN_AREAS)} min areas x {len(GATES)} gates, one core, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'class':<8}{'seconds':>9}{'CPU s':>9}{'best CV Dice':>14}")
    total = np.zeros(2)
    for label in LABELS:
        probs8, truth = model_like(rng, args.images)
        start = np.array([time.perf_counter(), time.process_time()])
        scores = grid_scores(probs8, truth)
        seconds = np.array([time.perf_counter(), time.process_time()]) - start
        total += seconds
        print(f"{label:<8}{seconds[0]:>9.2f}{seconds[1]:>9.2f}{scores.max():>14.4f}")
    print(f"{'total':<8}{total[0]:>9.2f}{total[1]:>9.2f}   (target <= 30 s for 1,100 images)")


if __name__ == "__main__":
    main()
