"""Whether cuDNN's algorithm search pays for prediction. Prints one table.

The model of --config (random weights, saved as a checkpoint and loaded as `cloudseg segment`
loads it) predicts random windows of --tile in a new process with `torch.backends.cudnn.benchmark`
off, then in one with it on, in turn, --repeat times each: for a batch of --batch windows and a
batch of 1 (a scene's short last batch), the first batch's seconds (the search where it is on, and
the kernels' first loading) and then the mean of 10 batches.

`hardware.speed_switches(inference=True)` leaves the search off for predict, segment and oof: on an
H200 (2026-11-27, UNet-ResNet34 in bf16, 1400x2100) the batches after the first ran as fast
without it, and the search cost each new batch shape 0.6-1.6 s. Run this on another GPU to see
whether that holds there (on a CPU the switch does nothing: the two rows should agree).

Usage: python benchmarks/cudnn_search.py [--config configs/fullres.yaml] [--tile H W] [--batch B]
       [--repeat R] [--device cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from segment_speed import write_checkpoint

# One process's measurements: cuDNN keeps each shape's pick for the life of the process.
MEASURE = r"""
import sys, time, torch
from cloudseg.hardware import autocast_dtype, speed_switches
from cloudseg.predict import load_model, predict_probs
checkpoint, device, search, height, width, batch = sys.argv[1:7]
device = torch.device(device)
model, config = load_model(checkpoint, device)
speed_switches(device)
torch.backends.cudnn.benchmark = search == "on"
dtype = autocast_dtype(config.train.precision, device)
synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
figures = []
for size in (int(batch), 1):
    images = torch.randint(0, 255, (size, 3, int(height), int(width)), dtype=torch.uint8, device=device)
    with torch.no_grad():
        synchronize(); start = time.perf_counter(); predict_probs(model, images, dtype); synchronize()
        figures.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(10):
            predict_probs(model, images, dtype)
        synchronize(); figures.append((time.perf_counter() - start) / 10)
print(" ".join(f"{figure:.6f}" for figure in figures))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/fullres.yaml")
    parser.add_argument("--tile", nargs=2, type=int, default=[1400, 2100], metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=4, help="windows a batch (predict.batch_size's default)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_checkpoint(Path(folder) / "best.pt", args.config, args.tile)
        rows = [(search, measured(checkpoint, search, args)) for _ in range(args.repeat) for search in ("off", "on")]
    print(f"\ncuDNN's search for prediction: {args.config}, windows {args.tile[0]}x{args.tile[1]}, "
          f"device {args.device}; a new process each row\n")
    print(f"| cudnn.benchmark | first batch of {args.batch}, s | then a batch of {args.batch}, ms "
          "| first batch of 1, s | then a batch of 1, ms |")
    print("|---|---|---|---|---|")
    for search, (first, then, first_one, then_one) in rows:
        print(f"| {search} | {first:.3f} | {then * 1e3:.1f} | {first_one:.3f} | {then_one * 1e3:.1f} |")


def measured(checkpoint: Path, search: str, args) -> list[float]:
    """(first batch s, then a batch s) for --batch windows, then for 1, in a new process."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint), args.device, search, *map(str, args.tile),
                           str(args.batch)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cudnn_search: the {search} process failed: {done.stderr[-800:]}")
    return [float(figure) for figure in done.stdout.split()[-4:]]


if __name__ == "__main__":
    main()
