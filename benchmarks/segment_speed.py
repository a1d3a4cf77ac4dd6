"""`cloudseg segment` against a naive loop of windows; prints one table.

Synthetic GeoTIFF scenes (default 2 of 1536x2304, 3.5 megapixels each) and an untrained model of
--config (default configs/demo.yaml: an FPN on mobilenet_v2; the weights do not change the speed)
in windows of --tile (default 384x576). Rows:

  a. naive loop             one window at a time (batch 1), side by side without overlap, read,
                            predicted and pasted into a whole-scene array, then written: the
                            hand-written loop of scripts that map scenes
  b. cloudseg, overlap 0    `segment.segment` with the naive loop's windows, batched (--batch),
                            the next batch read and the last rows written meanwhile in threads
  c. cloudseg, overlap 0.25 the default: more windows (neighbours share a quarter), blended

Each row maps every scene --repeat times (default 3; the fastest is shown), each after a warm-up
scene, on --device (auto: the GPU where there is
one; with CUDA, predict.compile=auto compiles rows b and c); wall-clock, so other processes on the
machine slow every row. Scenes/s and megapixels/s count the scenes' pixels, not the windows'.

Usage: [OMP_NUM_THREADS=1] python benchmarks/segment_speed.py [--repeat R --scenes N --height H --width W --tile H W --batch B --device D]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import rasterio
import torch
from rasterio.transform import from_origin
from rasterio.windows import Window

from cloudseg.checkpoint import save_checkpoint
from cloudseg.cli import add_device_option
from cloudseg.config import load_config
from cloudseg.geo import GDAL_CACHE_MB, write_rgb_geotiff
from cloudseg.hardware import resolve_device
from cloudseg.model import build_model
from cloudseg.predict import load_model, predict_probs
from cloudseg.segment import segment


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = resolve_device(args.device)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoint = write_checkpoint(folder / "model" / "best.pt", args.config, args.tile)
        scenes = [write_scene(folder / "scenes" / f"scene{i}.tif", args.height, args.width, i) for i in range(args.scenes)]
        warm = write_scene(folder / "warm" / "warm.tif", args.tile[0] * 2, args.tile[1] * 2, 99)
        rows = {
            "a. naive loop (batch 1, no overlap)": timed(lambda out: naive(scenes, checkpoint, args.tile, device, out),
                                                         lambda out: naive([warm], checkpoint, args.tile, device, out),
                                                         folder, args.repeat),
            **{f"{letter}. cloudseg segment, overlap {overlap} (batch {args.batch})": timed(
                lambda out, overlap=overlap: run_segment(scenes, checkpoint, out, args, overlap, device),
                lambda out, overlap=overlap: run_segment([warm], checkpoint, out, args, overlap, device), folder,
                args.repeat)
               for letter, overlap in (("b", 0.0), ("c", 0.25))},
        }
    megapixels = args.scenes * args.height * args.width / 1e6
    print(f"segment speed, {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, device {device}; {args.scenes} scenes of {args.height}x{args.width}, "
          f"windows {args.tile[0]}x{args.tile[1]}, model of {args.config}")
    print(f"load average before: {load:.1f} (other processes slow the wall-clock figures, "
          "less the CPU seconds)")
    print("| row | seconds | CPU s | scenes/s | megapixels/s | speed-up |")
    print("|---|---|---|---|---|---|")
    naive_seconds = next(iter(rows.values()))[0]
    for name, (seconds, cpu) in rows.items():
        print(f"| {name} | {seconds:.1f} | {cpu:.1f} | {args.scenes / seconds:.3f} | {megapixels / seconds:.2f} | "
              f"{naive_seconds / seconds:.2f}x |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=2)
    parser.add_argument("--height", type=int, default=1536)
    parser.add_argument("--width", type=int, default=2304)
    parser.add_argument("--tile", type=int, nargs=2, default=(384, 576), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=4, help="windows per batch of rows b and c")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is shown")
    parser.add_argument("--config", default="configs/demo.yaml", help="the model's architecture")
    add_device_option(parser, "the scenes are mapped")
    return parser.parse_args()


def write_checkpoint(path: Path, config_file: str, tile) -> Path:
    config = load_config(config_file, [f"data.image_size=[{tile[0]},{tile[1]}]", "model.encoder_weights=null"])
    torch.manual_seed(0)
    model = build_model(config.model, pretrained=False)
    save_checkpoint(path, {"model": model.state_dict(), "config": config.model_dump(mode="json"), "epoch": 0, "step": 0})
    return path


def write_scene(path: Path, height: int, width: int, seed: int) -> Path:
    """A tiled, deflated RGB GeoTIFF of smooth noise with a black no-data corner."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (3, height // 64 + 1, width // 64 + 1), dtype=np.uint8)
    pixels = coarse.repeat(64, 1).repeat(64, 2)[:, :height, :width]
    pixels[:, : height // 4, : width // 4] = 0
    return write_rgb_geotiff(path, pixels.transpose(1, 2, 0), "EPSG:4326", from_origin(-60, 15, 0.01, 0.01),
                             tiled=True, compress="deflate")


def timed(run, warm_up, folder: Path, repeat: int) -> tuple[float, float]:
    """(wall-clock, CPU seconds of this process's threads) of the fastest of `repeat` runs of
    `run`, each after `warm_up` (each run loads the model anew)."""
    times = []
    for _ in range(repeat):
        warm_up(folder / f"warm{time.monotonic_ns()}")
        start, cpu = time.perf_counter(), time.process_time()
        run(folder / f"out{time.monotonic_ns()}")
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return min(times)


def naive(scenes: list[Path], checkpoint: Path, tile, device: torch.device, out: Path) -> None:
    """One window at a time, pasted side by side into a whole-scene array, then written whole."""
    model, _ = load_model(checkpoint, device)
    out.mkdir(parents=True)
    for path in scenes:
        with rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB), rasterio.open(path) as scene:
            probs = np.zeros((4, scene.height, scene.width), np.float32)
            for top in range(0, scene.height, tile[0]):
                for left in range(0, scene.width, tile[1]):
                    window = Window(left, top, min(tile[1], scene.width - left), min(tile[0], scene.height - top))
                    pixels = torch.from_numpy(scene.read((1, 2, 3), window=window))[None].to(device)
                    window_probs = predict_probs(model, pixels, zero_black=True)[0].cpu().numpy()
                    probs[:, top:top + window.height, left:left + window.width] = window_probs
            profile = dict(driver="GTiff", width=scene.width, height=scene.height, count=4, dtype="uint8",
                           crs=scene.crs, transform=scene.transform, compress="deflate", zlevel=1)
            with rasterio.open(out / path.name, "w", **profile) as written:
                written.write(np.rint(probs * 254).astype(np.uint8))


def run_segment(scenes: list[Path], checkpoint: Path, out: Path, args, overlap: float, device: torch.device) -> None:
    failed = segment([str(path) for path in scenes], [str(checkpoint)], out, overlap=overlap, postprocess_file="none",
                     overrides=[f"predict.batch_size={args.batch}"], device=device.type)
    assert failed == 0


if __name__ == "__main__":
    main()
