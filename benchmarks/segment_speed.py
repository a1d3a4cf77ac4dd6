"""`cloudseg segment` against a naive loop of windows, with a model and without one; prints one table.

Synthetic GeoTIFF scenes (default 2 of 1536x2304, 3.5 megapixels each) and an untrained model of
--config (default configs/demo.yaml: an FPN on mobilenet_v2; the weights do not change the speed)
in windows of --tile (default 384x576). Rows:

  a. naive loop             one window at a time (batch 1), side by side without overlap, read,
                            predicted and pasted into a whole-scene array, then written (4 bands,
                            segment's default codec): the hand-written loop of scripts that map scenes
  b. cloudseg, overlap 0    `segment.segment` with the naive loop's windows, batched (--batch):
                            the scene read in strips ahead, the finished rows written meanwhile,
                            8 bands, fractions
  c. cloudseg, overlap 0.25 the default: more windows (neighbours share a quarter), blended
  d., e., f.                the same three with the model replaced by a constant (zero logits,
                            made on the device): the pipeline's own ceiling, "pipeline, no model"

Under the table, each segment row's stage line (cloudseg.stages: seconds per stage summed over
its threads, the main thread's waits, and the stage that bounds it; docs/segment.md says what each
figure means on a GPU), then its timeline: each stage's first start and last end, from the first
read, which show how long the pipeline takes to fill and to drain, and the cores it kept busy
meanwhile (CPU seconds over wall seconds, loading apart: issue #38's CPU/wall).

How long it takes: issue #38's H100 command (--tile 1400 2100 --height 7000 --width 18000
--scenes 1 --repeat 1 --config configs/fullres.yaml) timed 29 s over rows a-f on 2026-11-26;
`make bench` maps 2 such scenes (rows a-f then about 60 s: the naive loops double), and the
warm-ups, the loads, the first compile, row g, the writes alone (10 writes of the 252 megapixels and 10
read-backs) and the fixed-cost calls (six new processes, 15-40 s each there) come on top: the whole part
took 251 s on the H100 on 2026-11-27, with 12 writes and five of those processes.
This CPU's default sizes: 2-4 minutes.

Each row maps every scene --repeat times (default 3; the fastest is shown), each after a warm-up
scene, with PyTorch's CPU tensors in huge pages as the command line has them (THP_MEM_ALLOC_ENABLE=1
unless set otherwise: cli.huge_pages_for_tensors; the naive loops too), on --device (auto: the GPU
where there is one; with CUDA rows b and c compile, as predict.compile=auto does for a large job); wall-clock, so other processes on the machine slow every row. Scenes/s and
megapixels/s count the scenes' pixels, not the windows'. Speed-up: against the naive loop with
the same model (a for b, c; d for e, f).

Row i: row c with every codec written by GDAL's writer, as before geo.CompressedStrips (the strips
of ZSTD now compressed in threads of ours as rows come, laid out by tifffile), in turn
with row c again, each at least twice. (Row h, the writer's wait before commit 0b745e4, answered
on the H100 of 2026-11-27, evening: no difference; its code is gone.)

Row j (--processes N, default 1: none): row c as the command, `cloudseg segment` under torchrun,
eager and without a warm-up scene, in one process and then in N sharing the device (a GPU:
distributed.start's share_gpus), in turn, --repeat times each (the fastest shown): the rate of
process 0's summary line (every process's scenes over its time from its first scene to the last
process's end, loading apart), the CPU seconds of the processes whole (imports and loading in),
process 0's stage line. Whether Pythons of their own keep more cores busy than one process's
threads, where the pipeline bounds it: the two j rows compare with each other, not with row c.
Give each process a few scenes (--scenes 4 for N = 2).

Row g: row c again with N files written at once (--files-at-once N, default 2; 1: no row g):
each scene's writes in a thread of their own (segment.FILES_AT_ONCE), the next scene mapped while
the last one is written; its speed-up is against row a. --codecs: row c again in each codec named
but the default (ZSTD), then row g in each. --rows: which of rows a-f and i (default all), for a short
GPU window. A segment row's stage line ends with how long the call took before its first read
(loading the checkpoint) and after its last write (the summaries).

Then segment's writes alone (--no-writes: not): row c's maps written again as segment writes
them on a GPU (`geo.geotiff_writer`, a row of windows at a time in whole strips, GDAL's cache
capped), with deflate (GDAL's writer) and ZSTD (the default), ZSTD compressed by our threads
(geo.CompressedStrips, as segment writes it) and by GDAL's writer as before, then both in strips
of 16 rows (segment's were 16 until 2026-11-27; now geo.OUTPUT_STRIP_ROWS) and ZSTD in strips of 256, one file after another in one thread, then every scene's
file at once in a thread each. What the writer alone allows segment where its stage line says
`bound by: write`, and whether files written in parallel, or larger strips, would raise it; and the
busiest writing thread's own CPU seconds: near the seconds, a file's one writing thread bounds it,
however many threads compress (GDAL's writer: that thread copies every block into GDAL's cache and
again into its compression job; ours only hands strips to the threads and writes their bytes). (The
H100 of 2026-11-27 measured the rest: deflate and ZSTD with the predictor, and each release written
as it comes, not in whole strips: BENCHMARKS.md.)

Then a call's fixed cost, apart from the per-scene rate: `cloudseg segment` twice in new
processes on one window-sized scene (imports, loading; no compiling: auto does not compile for
one scene), the imports alone, and where the second call's time went (imports, loading and mapping
from its own log, the rest); on CUDA then two calls that compile (predict.compile=true), the
second taking its compile from inductor's cache. (A call without cuDNN's algorithm search was
timed beside them until the H200 of 2026-11-27 showed the search bought prediction nothing: the
commands that predict now never search, hardware.speed_switches.)

Usage: [OMP_NUM_THREADS=1] python benchmarks/segment_speed.py [--repeat R --scenes N --height H --width W --tile H W
       --batch B --config FILE --device D --files-at-once N --processes N --codecs C [C ...] --outputs O [O ...]
       --rows LETTERS --log --switch-interval SECONDS
       --no-writes --no-fixed-cost]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest.mock
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from cloudseg.cli import huge_pages_for_tensors

huge_pages_for_tensors()  # as the command line does, before torch is imported: for every row, the naive loops too

import numpy as np
import rasterio
import torch
from rasterio.transform import from_origin
from rasterio.windows import Window

from cloudseg import geo
from cloudseg import segment as segment_module
from cloudseg.checkpoint import save_checkpoint
from cloudseg.cli import add_device_option
from cloudseg.config import load_config
from cloudseg.geo import GDAL_CACHE_BYTES, write_rgb_geotiff
from cloudseg.hardware import resolve_device
from cloudseg.model import build_model
from cloudseg.predict import load_ensemble, load_model, predict_probs
from cloudseg.segment import OVERLAP, SegmentOptions, segment, segment_scenes, tiling
from cloudseg.stages import StageClock


class Constant(torch.nn.Module):
    """Zero logits for every pixel, made on the images' device: a model that costs nothing."""

    def forward(self, images):
        return torch.zeros(images.shape[0], 4, *images.shape[-2:], device=images.device)


def main() -> None:
    args = parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    logging.basicConfig(level=logging.INFO if args.log else logging.WARNING)
    device = resolve_device(args.device)
    args.rows = args.rows or "abcdefi"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        checkpoint = write_checkpoint(folder / "model" / "best.pt", args.config, args.tile)
        scenes = [write_scene(folder / "scenes" / f"scene{i}.tif", args.height, args.width, i) for i in range(args.scenes)]
        warm = write_scene(folder / "warm" / "warm.tif", args.tile[0] * 2, args.tile[1] * 2, 99)
        model, _ = load_model(checkpoint, device)
        rows = Rows(args.scenes * args.height * args.width / 1e6)

        def segment_runs(where: str, overlap: float = 0.25, forward=None, compress: str = geo.DEFAULT_CODEC,
                         repeat: int = args.repeat, outputs: tuple[str, ...] = geo.DEFAULT_OUTPUTS,
                         ) -> tuple[float, float, str | None]:
            """`run_segment` on the scenes into folder/where, each run after a warm-up scene: `timed`."""
            run = partial(run_segment, checkpoint=checkpoint, args=args, overlap=overlap, device=device,
                          forward=forward, compress=compress, outputs=outputs)
            return timed(lambda out: run(scenes, out=out), lambda out: run([warm], out=out), folder / where, repeat)

        def segment_row(name: str, where: str, overlap: float = 0.25, forward=None,
                        compress: str = geo.DEFAULT_CODEC, outputs: tuple[str, ...] = geo.DEFAULT_OUTPUTS) -> None:
            rows[name] = segment_runs(where, overlap, forward, compress, outputs=outputs)

        for letters, name, forward in (("abc", "", model), ("def", ", no model", Constant())):
            if letters[0] in args.rows:
                rows[f"{letters[0]}. naive loop{name} (batch 1, no overlap)"] = timed(
                    lambda out, forward=forward: naive(scenes, forward, args.tile, device, out),
                    lambda out, forward=forward: naive([warm], forward, args.tile, device, out), folder / letters[0],
                    args.repeat)
            for letter, overlap in zip(letters[1:], (0.0, 0.25)):
                if letter in args.rows:
                    segment_row(f"{letter}. cloudseg segment{name}, overlap {overlap} (batch {args.batch})", letter,
                                overlap, None if forward is model else forward)
        if "i" in args.rows:  # GDAL's writer as before, in turn with row c: the fastest of each
            in_turn = {f"c. cloudseg segment, overlap 0.25 (batch {args.batch}), again": contextlib.nullcontext,
                       f"i. cloudseg segment, overlap 0.25 (batch {args.batch}), GDAL's writer": gdal_writer}
            runs = collections.defaultdict(list)
            for turn in range(max(2, args.repeat)):
                for index, (name, writer) in enumerate(in_turn.items()):
                    with writer():
                        runs[name].append(segment_runs(f"i{index}-{turn}", repeat=1))
                    print(f"  run {turn + 1} of {name[:2]} {'again' if index == 0 else 'GDAL'}: "
                          f"{runs[name][-1][0]:.2f} s", flush=True)
            for name, results in runs.items():
                rows[name] = min(results, key=lambda result: result[0])
        for codec in args.codecs:  # row c in another codec, then row g in each
            if codec != geo.DEFAULT_CODEC and "c" in args.rows:
                segment_row(f"c. cloudseg segment, overlap 0.25 (batch {args.batch}), {codec}", f"c-{codec}",
                            compress=codec)
        for outputs in args.outputs:  # row c writing other bands: how much of its time the bytes written take
            if outputs != ",".join(geo.DEFAULT_OUTPUTS) and "c" in args.rows:
                segment_row(f"c. cloudseg segment, overlap 0.25 (batch {args.batch}), --outputs {outputs}",
                            f"c-{outputs.replace(',', '-')}", outputs=tuple(outputs.split(",")))
        for codec in args.codecs if args.files_at_once > 1 else ():  # the next scene mapped while the last is written
            name = (f"g. cloudseg segment, overlap 0.25 (batch {args.batch}), {args.files_at_once} files at once"
                    + ("" if codec == geo.DEFAULT_CODEC else f", {codec}"))
            with unittest.mock.patch.object(segment_module, "FILES_AT_ONCE", args.files_at_once):
                segment_row(name, f"g-{codec}", compress=codec)
        if args.processes > 1:  # row c as a command: one process, then N sharing the device, in turn
            for turn in range(args.repeat):
                for count in (1, args.processes):
                    name = (f"j. cloudseg segment command, overlap 0.25 (batch {args.batch}), {count} "
                            + ("process" if count == 1 else "processes"))
                    result = processes_run(scenes, checkpoint, folder / f"j{count}-{turn}", args, device, count)
                    if result and (name not in rows or result[0] < rows[name][0]):
                        rows[name] = result
        written = sorted((folder / "c" / "run0").glob("*.tif"))  # row c's maps: the model's, blended
        if args.writes and not written:
            print("  writes alone: left out, row c was not timed (--rows)", flush=True)
            args.writes = False
        writes = writes_alone(written, tuple(args.tile), args.repeat) if args.writes else None
        fixed = fixed_cost(warm, checkpoint, folder, args) if args.fixed_cost else None
    print_table(rows, args, device, load)
    if writes:
        print_writes(writes, rows.megapixels, len(written))
    if fixed:
        print(f"\nfixed cost of a call (cloudseg segment in a new process, one {args.tile[0] * 2}x{args.tile[1] * 2} "
              f"scene): {fixed[0]:.1f} s, a second call {fixed[1]:.1f} s; of which imports {fixed[2]:.1f} s")
        if len(fixed) > 3:
            print(f"compiling (predict.compile=true): {fixed[3]:.1f} s, a second call {fixed[4]:.1f} s (its compile "
                  "from inductor's cache)")


class Rows(dict):
    """The table's rows, each printed the moment it is measured (with its stage line): a run cut
    short (make bench's time limit) still shows the rows it finished; the table comes at the end."""

    def __init__(self, megapixels: float):
        super().__init__()
        self.megapixels = megapixels

    def __setitem__(self, name, result):
        super().__setitem__(name, result)
        seconds, cpu, stages = result
        print(f"  measured {name}: {seconds:.1f} s, {cpu:.1f} CPU s, {self.megapixels / seconds:.2f} megapixels/s"
              + (f"; {stages}" if stages else ""), flush=True)


def print_table(rows: Rows, args, device: torch.device, load: float) -> None:
    megapixels = rows.megapixels
    print(f"segment speed, {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, device {device}"
          f"{f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else ''}, torch {torch.__version__}; "
          f"{args.scenes} scenes of {args.height}x{args.width}, windows {args.tile[0]}x{args.tile[1]}, "
          f"model of {args.config}; THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}; "
          f"switch interval {sys.getswitchinterval() * 1000:g} ms"
          f"{' (row j: the default in its processes)' if args.processes > 1 else ''}")
    print(f"load average before: {load:.1f} (other processes slow the wall-clock figures, "
          "less the CPU seconds)")
    print("| row | seconds | CPU s | scenes/s | megapixels/s | speed-up |")
    print("|---|---|---|---|---|---|")
    naive = {name[0]: seconds for name, (seconds, _, _) in rows.items() if "naive loop" in name}
    for name, (seconds, cpu, _) in rows.items():
        against = naive.get("d" if name[0] in "def" else "a")  # the naive loop with the same model
        print(f"| {name} | {seconds:.1f} | {cpu:.1f} | {args.scenes / seconds:.3f} | {megapixels / seconds:.2f} | "
              f"{f'{against / seconds:.2f}x' if against else '-'} |")
    print("\nWhere each segment row's time went (its fastest run; seconds summed over the threads of a stage, "
          "see docs/segment.md):\n")
    print("| row | stages |")
    print("|---|---|")
    for name, (_, _, stages) in rows.items():
        if stages:
            extra = name.partition(f" (batch {args.batch})")[2].lstrip(", ")  # files at once, codec
            print(f"| {name[:2]}{f' {extra}' if extra else ''} | {stages} |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=2)
    parser.add_argument("--height", type=int, default=1536)
    parser.add_argument("--width", type=int, default=2304)
    parser.add_argument("--tile", type=int, nargs=2, default=(384, 576), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=4, help="windows per batch of rows b and c")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is shown")
    parser.add_argument("--config", default="configs/demo.yaml", help="the model's architecture")
    parser.add_argument("--log", action="store_true", help="segment's own log lines (loading time, rate)")
    parser.add_argument("--rows", help="which of rows a-f and i to time (default abcdefi; "
                        "row g: --files-at-once)")
    parser.add_argument("--codecs", nargs="+", default=[geo.DEFAULT_CODEC], choices=list(geo.CODECS),
                        help=f"row c again in each codec but the default ({geo.DEFAULT_CODEC}), then row g in each")
    parser.add_argument("--outputs", nargs="+", default=[",".join(geo.DEFAULT_OUTPUTS)], metavar="OUTPUTS",
                        help="row c again with each of these --outputs but the default (probs,masks): "
                             "e.g. classbits, an eighth of the bytes")
    parser.add_argument("--files-at-once", type=int, default=2, metavar="N",
                        help="then row c again with segment.FILES_AT_ONCE = N (1: not)")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="then row j: row c as a command under torchrun, one process and N (sharing a GPU), "
                             "in turn (1: no row j)")
    parser.add_argument("--writes", action=argparse.BooleanOptionalAction, default=True,
                        help="also time row c's maps written again alone, one file at a time and all at once")
    parser.add_argument("--fixed-cost", action=argparse.BooleanOptionalAction, default=True,
                        help="also time two `cloudseg segment` calls in new processes")
    parser.add_argument("--switch-interval", type=positive_seconds, metavar="SECONDS",
                        help="sys.setswitchinterval for the rows timed in this process, not row j's commands "
                             "(Python's default: 0.005): how long a thread that lets go of the interpreter's lock "
                             "for each PyTorch operation may wait for it back while another thread runs Python")
    add_device_option(parser, "the scenes are mapped")
    return parser.parse_args()


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def gdal_writer():
    """Row i, and the writes alone's GDAL rows: every codec written by GDAL's writer, as before
    geo.CompressedStrips (its blocks compressed in GDAL's threads, every block copied by the one
    thread that writes the file)."""
    return unittest.mock.patch.dict(geo.STRIP_ENCODERS, clear=True)


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


def timed(run, warm_up, folder: Path, repeat: int) -> tuple[float, float, str | None]:
    """(wall-clock, CPU seconds of this process's threads, the stage line or None) of the fastest
    of `repeat` runs of `run` (which returns its stage line or None), each after `warm_up`; run k
    writes into folder/runK."""
    times = []
    for index in range(repeat):
        warm_up(folder / f"warm{index}")
        start, cpu = time.perf_counter(), time.process_time()
        stages = run(folder / f"run{index}")
        times.append((time.perf_counter() - start, time.process_time() - cpu, stages))
    return min(times, key=lambda row: row[0])


def naive(scenes: list[Path], model, tile, device: torch.device, out: Path) -> None:
    """One window at a time, pasted side by side into a whole-scene array, then written whole."""
    out.mkdir(parents=True)
    for path in scenes:
        with rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_BYTES), rasterio.open(path) as scene:
            probs = np.zeros((4, scene.height, scene.width), np.float32)
            for top in range(0, scene.height, tile[0]):
                for left in range(0, scene.width, tile[1]):
                    window = Window(left, top, min(tile[1], scene.width - left), min(tile[0], scene.height - top))
                    pixels = torch.from_numpy(scene.read((1, 2, 3), window=window))[None].to(device)
                    window_probs = predict_probs(model, pixels, zero_black=True)[0].cpu().numpy()
                    probs[:, top:top + window.height, left:left + window.width] = window_probs
            profile = dict(driver="GTiff", width=scene.width, height=scene.height, count=4, dtype="uint8",
                           crs=scene.crs, transform=scene.transform, **geo.CODECS[geo.DEFAULT_CODEC])
            with rasterio.open(out / path.name, "w", **profile) as written:
                written.write(np.rint(probs * 254).astype(np.uint8))


def run_segment(scenes: list[Path], checkpoint: Path, out: Path, args, overlap: float, device: torch.device,
                forward=None, compress: str = geo.DEFAULT_CODEC, outputs: tuple[str, ...] = geo.DEFAULT_OUTPUTS) -> str:
    """`segment` on the checkpoint (loaded anew, as a call does), or the checkpoint's ensemble with
    `forward` for its model (`segment_scenes`: loading apart); its stage line and timeline, and how
    long the call took before its first read and after its last write (loading, summaries)."""
    # On CUDA rows b and c compile: they stand for a job large enough that predict.compile=auto compiles.
    options = SegmentOptions(tuple(args.tile), overlap, compress=compress, outputs=outputs)
    start = time.perf_counter()
    overrides = [f"predict.batch_size={args.batch}", f"predict.compile={str(device.type == 'cuda').lower()}"]
    clock = StageClock()
    if forward is None:
        failed = segment([str(path) for path in scenes], [str(checkpoint)], out, options, postprocess_file="none",
                         overrides=overrides, device=device.type, clock=clock)
    else:
        ensemble = load_ensemble([str(checkpoint)], "none", overrides, device.type)
        out.mkdir(parents=True)
        failed = segment_scenes(scenes, ensemble._replace(forwards=[forward], compiling=False), out, options,
                                clock=clock)
    assert failed == 0
    first_read, last_end = clock.spans["read"][0], max(end for _, end in clock.spans.values())
    return (f"{clock.line(gpu=device.type == 'cuda')}; {clock.timeline()}; the call: {first_read - start:.2f} s "
            f"before its first read, {time.perf_counter() - last_end:.2f} s after its last write")


# The rows of the writes-alone table, name -> (codec, rows a strip, GDAL's writer): deflate (GDAL's) and
# segment's ZSTD (ours, geo.CompressedStrips) in segment's strips (geo.OUTPUT_STRIP_ROWS), ZSTD by GDAL's
# writer as before (`gdal_writer`), then both in other strips; always in whole strips.
WRITE_CODECS = {"deflate": ("deflate", geo.OUTPUT_STRIP_ROWS, True),
                "deflate, strips of 16 rows": ("deflate", 16, True),
                "zstd": ("zstd", geo.OUTPUT_STRIP_ROWS, False),
                "zstd, GDAL's writer": ("zstd", geo.OUTPUT_STRIP_ROWS, True),
                "zstd, strips of 16 rows": ("zstd", 16, False), "zstd, strips of 256 rows": ("zstd", 256, False)}


def writes_alone(maps: list[Path], tile: tuple[int, int],
                 repeat: int) -> dict[tuple[str, int], tuple[float, float, float, float]]:
    """Segment's writes without the rest of it: the bands of `maps` (row c's GeoTIFFs) written
    again as segment writes them on a GPU (`geo.geotiff_writer`, a row of windows at a time: the
    rows above the next row of windows of `tile`, GDAL's cache capped as segment caps it),
    for each of WRITE_CODECS one file after another in one thread, then every file at once, a
    thread each. {(codec, files at once): (seconds, CPU s, the busiest writing thread's own CPU s,
    MB)}, the fastest of `repeat`; each file of the first run is read back and must equal its map.
    What the writer alone allows segment, whether writing several files at once would raise it, and
    whether a writing thread bounds it (its own CPU s near the seconds: GDAL copies the bands into
    its blocks there, which its compression threads then take)."""
    if not maps:
        raise FileNotFoundError("writes alone: row c wrote no GeoTIFF to write again")
    bands, scenes = [], []
    for path in maps:
        with rasterio.open(path) as source:
            bands.append(source.read())
            scenes.append(SimpleNamespace(width=source.width, height=source.height, crs=source.crs,
                                          transform=source.transform, gcps=source.gcps))

    def write(index: int, codec: str, out: Path) -> tuple[Path, int, float]:
        height, cpu = scenes[index].height, time.thread_time()
        tops = [*tiling(height, scenes[index].width, tile, OVERLAP).tops[1:], height]  # as blended_rows releases
        with geo.geotiff_writer(out / maps[index].name, scenes[index], compress=codec) as written:
            strips = geo.WholeStrips(written, height)
            for top, bottom in zip([0, *tops], tops):
                strips.write(top, bands[index][:, top:bottom])
        return out / maps[index].name, threading.get_ident(), time.thread_time() - cpu

    results = {}
    with tempfile.TemporaryDirectory() as folder, rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_BYTES):
        for name, (codec, strip_rows, gdal) in WRITE_CODECS.items():
            for at_once in sorted({1, len(maps)}):
                times = []
                for run in range(repeat):
                    out = Path(folder) / f"{codec}-{strip_rows}-{at_once}-{run}"
                    out.mkdir()
                    start, cpu = time.perf_counter(), time.process_time()
                    with (concurrent.futures.ThreadPoolExecutor(at_once) as pool,
                          unittest.mock.patch.object(geo, "OUTPUT_STRIP_ROWS", strip_rows),
                          gdal_writer() if gdal else contextlib.nullcontext()):
                        paths, threads, own = zip(*pool.map(lambda index: write(index, codec, out), range(len(maps))))
                    busiest = max(sum(seconds for thread, seconds in zip(threads, own) if thread == one)
                                  for one in set(threads))  # one thread's files, one after another
                    times.append((time.perf_counter() - start, time.process_time() - cpu, busiest,
                                  sum(path.stat().st_size for path in paths) / 1e6))
                    for path, expected in zip(paths if run == 0 else [], bands):
                        with rasterio.open(path) as check:
                            assert np.array_equal(check.read(), expected), f"{path}: not the map's bands"
                            assert check.block_shapes[0][0] == min(strip_rows, check.height), f"{path}: other strips"
                    shutil.rmtree(out)
                results[name, at_once] = min(times)
                print(f"  measured writes alone, {name}, {at_once} at once: {results[name, at_once][0]:.2f} s",
                      flush=True)
    return results


def print_writes(writes, megapixels: float, files: int) -> None:
    print(f"\nWrites alone (row c's {files} maps written again as segment writes them; the fastest run; "
          "CPU s: this process's threads, GDAL's included; writing thread: the busiest of those that wrote a file, "
          "its own CPU s, near the seconds where a writing thread bounds the writes):\n")
    print("| codec | files at once | seconds | CPU s | writing thread's CPU s | megapixels/s | MB |")
    print("|---|---|---|---|---|---|---|")
    for (name, at_once), (seconds, cpu, own, size) in writes.items():
        print(f"| {name} | {at_once} | {seconds:.2f} | {cpu:.2f} | {own:.2f} | {megapixels / seconds:.1f} | {size:.1f} |")


def fixed_cost(scene: Path, checkpoint: Path, folder: Path, args) -> tuple[float, ...]:
    """Seconds of two `cloudseg segment` calls on `scene` in new processes, one after the other,
    and of a process that only imports cloudseg.segment (and ends without the interpreter's exit,
    timed apart); on CUDA then two calls that compile
    (predict.compile=true; auto does not for one scene), the second from inductor's cache, which
    starts empty for the first; and where the second call's time went, from its own log."""
    logs = []

    def seconds(*command, env=None, name=None) -> float:
        """The wall seconds of `python COMMAND` (NaN, its stderr's end printed, if it fails)."""
        name = name or " ".join(command[:3])
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env)
        took = time.perf_counter() - start
        logs.append(done.stderr)
        if done.returncode:
            print(f"  failed, a new process: {name} (exit {done.returncode}): {done.stderr[-600:]}", flush=True)
            return math.nan
        print(f"  measured a new process: {name}: {took:.1f} s", flush=True)
        return took

    call = ["-m", "cloudseg", "segment", str(scene), "--checkpoint", str(checkpoint), "--postprocess", "none",
            "--device", args.device]
    first, second = (seconds(*call, "--out", str(folder / f"fixed{index}")) for index in range(2))
    second_log = logs[-1]
    # the imports alone: the process ends at once (os._exit), not through CPython's finalization, which
    # frees every module's objects (1.3 s of a 2-core VM's 7.9 s): timed apart, as the interpreter's exit
    imports = seconds("-c", "import os, cloudseg.segment; os._exit(0)", name="-c import cloudseg.segment (os._exit)")
    exiting = seconds("-c", "import cloudseg.segment") - imports
    print(f"  the interpreter's exit after those imports: {exiting:.1f} s", flush=True)
    print(f"  the second call: {call_split(second, imports, second_log)}", flush=True)
    if resolve_device(args.device).type != "cuda":
        return first, second, imports
    cache = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    compiling = [*call[:4], "predict.compile=true", *call[4:]]  # overrides come right after the scenes
    return first, second, imports, *(seconds(*compiling, "--out", str(folder / f"compiled{index}"), env=cache,
                                             name="-m cloudseg segment (compiling)") for index in range(2))


def processes_run(scenes: list[Path], checkpoint: Path, out: Path, args, device: torch.device,
                  count: int) -> tuple[float, float, str] | None:
    """Row j: `cloudseg segment` on the scenes under torchrun in `count` processes on `device` (on
    a GPU, all sharing it where it is one: distributed.start's share_gpus), as row c maps them but
    eager (N processes compiling at once would time the compiles) and cold (no warm-up scene: each
    process's first batches are in). Returns (seconds, CPU seconds, process 0's stage line): the
    seconds are the scenes' pixels over the rate of process 0's summary line (every process's scenes
    over process 0's time from its first scene to the last process's end, loading apart); the CPU
    seconds are the processes' whole (imports and loading in). The two j rows compare with each
    other, not with row c. Each process sizes its reader and compressing threads by its share of
    the cores (hardware.usable_cores), as a user's would. None, its stderr's end printed, if it
    fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
               "-m", "cloudseg", "segment", *map(str, scenes), f"predict.batch_size={args.batch}",
               "predict.compile=false", "--checkpoint", str(checkpoint),
               "--out", str(out), "--tile", *map(str, args.tile), "--overlap", "0.25", "--postprocess", "none",
               "--device", device.type]
    before = os.times()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(
        max(1, torch.get_num_threads() // count))})
    after = os.times()
    rate = re.search(r"([\d.]+) megapixels/s ->", done.stderr)
    stages = re.search(r"segment: (stages: .*) \(process 0", done.stderr)
    if done.returncode or not rate or not float(rate[1]) > 0:
        print(f"  failed, row j with {count} process(es) (exit {done.returncode}): {done.stderr[-600:]}", flush=True)
        return None
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return args.scenes * args.height * args.width / 1e6 / float(rate[1]), cpu, stages and stages[1]


def call_split(seconds: float, imports: float, log: str) -> str:
    """Where a `cloudseg segment` call's `seconds` went, from its log and a new process's `imports`
    (Python's start included, its exit not): loading (the checkpoint, and the GPU's context made for
    it), mapping (the scenes and the summaries, the first batches' kernels loaded included), and the
    rest (the command line, the options' checks, finding the scenes, the interpreter's and CUDA's
    exit)."""
    loading = re.search(r"loaded on \S+ in ([\d.]+) s", log)
    mapping = re.search(r"\(process 0, ([\d.]+) s\)", log)
    if not (loading and mapping):
        return f"{seconds:.1f} s (its log did not say how long loading and mapping took)"
    load, scenes = float(loading[1]), float(mapping[1])
    return (f"{seconds:.1f} s = imports {imports:.1f} + loading {load:.1f} + mapping {scenes:.1f} + the rest "
            f"{seconds - imports - load - scenes:.1f}")


if __name__ == "__main__":
    main()
