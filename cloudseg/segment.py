"""`cloudseg segment`: cloud-pattern maps of satellite scenes of any size, at native resolution.

Data path (beyond the competition): checkpoint(s) → scene read in strips of rows (cloudseg.geo) →
**windows in batches through the ensemble, blended** → the run's tuned threshold → per-scene
GeoTIFF or PNG maps, area fractions and the lat/lon grid (cloudseg.geo).

Windows are the size the model trained on (data.image_size, or --tile), overlapping by
--overlap of a tile. Each window's probabilities are weighted by a raised-cosine ramp across
every overlap with a neighbour (weight 1 elsewhere, at the scene's own edges included), and the
weights of two neighbours sum to 1 there: no seam, and a scene that fits one window gets exactly
predict's probabilities. Windows go through the model row by row; rows above the next row of
windows are final, leave for the outputs and are dropped, so memory holds one row of windows
(tile height × scene width), never the scene. No-data pixels (black, or the GeoTIFF's nodata,
mask or alpha) get probability 0, are written as nodata and count in no fraction.

Where the work runs: the blend, the thresholds and the counts run where the model runs (torch on
its device); on a GPU only the finished rows' uint8 bands and counts cross to the host, once per
row of windows, and a JPEG scene is decoded there too. The scene is read once, in strips of rows
read ahead in threads (GDAL and OpenCV release the GIL), and the windows are cut from the strips on
the model's device; rows are encoded (`geo.output_bands`: OpenCV on a CPU)
and written in another thread (`Writer`), a ZSTD map's strips compressed by threads of ours
(`geo.CompressedStrips`; other codecs by GDAL's), and each scene is finished there (its last strips
compressed, NAME.json) while the next scene is read and mapped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import csv
import glob
import json
import logging
import math
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np
import torch
from tqdm import tqdm

from cloudseg import distributed, geo
from cloudseg.files import atomic_path, left_behind, new_hidden_file, published_together, remove
from cloudseg.hardware import resolve_device, usable_cores
from cloudseg.predict import Ensemble, ensemble_native, load_ensemble, no_data
from cloudseg.stages import StageClock
from cloudseg.task import LABELS
from cloudseg.units import human_duration
from cloudseg.viz import overlay

log = logging.getLogger("cloudseg")

OVERLAP = 0.25  # default --overlap: a quarter of a tile shared with each neighbour
MAX_OVERLAP = 0.9  # beyond it a pixel is predicted over 100 times, and the windows' list alone can fill the memory
ENCODE_ROWS = 32  # rows of a band encoded at once on a CPU (`map_geotiff`; their temporaries stay small)
# Files written at once, each scene's in a thread of its own (`Writer`): on an H100's 16 cores the writes
# alone of two 7000x18000 maps ran 1.43x (deflate) and 1.98x (ZSTD) faster two at once than one after the
# other (BENCHMARKS.md, 2026-11-27), where on 2 cores they gained nothing; but segment itself, two files at
# once (benchmarks/segment_speed.py's row g), ran 0.88-1.07x one at a time with deflate and 1.01x with ZSTD
# on that H100: the next scene's reads and encodes take the cores. With more, the next scene is mapped ahead
# of the last one's writes, its encoded rows queued for them, up to WRITE_QUEUE_BYTES (and a strip per file).
FILES_AT_ONCE = 1
WRITE_QUEUE_BYTES = 2**30
# Strips of the scene read at once for a GPU, each in a thread (and with a GDAL handle) of its own: a
# GPU predicts 1400x2100 windows faster than one thread inflates them from a deflated GeoTIFF. Half
# the cores, at most 8: on an H100's 16 cores, when a batch of four windows was read in each thread,
# 4, 8 and 12 read the no-model row f at 362, 526 and 546 megapixels/s, row c at 231, 215 and 223
# (there the GPU bounds it; BENCHMARKS.md, 2026-11-27, night). On a CPU one strip ahead, as the
# model's own threads take the cores.
READ_AHEAD = max(1, min(8, usable_cores() // 2))
# Rows of the scene read at once (rounded up to the file's blocks): each pixel is inflated once, where
# windows read one by one inflated the overlaps again (1.78x the pixels at overlap 0.25; a 7000x18000
# scene in 0.39 CPU s by windows, 0.16 whole, on the 2-core VM). Strips this short fill the first row of
# windows in several threads at once, and hold 14 MB of a 18000-pixel-wide scene each.
READ_ROWS = 256
FRACTIONS_CSV = "fractions.csv"
GRID_NC = "grid.nc"
# The errors a bad scene raises through cloudseg and Python, told by their message alone; any other (GDAL's
# CPLE_* errors, OpenCV's cv2.error, a MemoryError, a bug) fails its scene all the same, its class named.
SCENE_ERRORS = (ValueError, OSError, RuntimeError)


# ---------------------------------------------------------------------------------- tiling


class Tiling(NamedTuple):
    tops: list[int]  # first row of each row of windows
    lefts: list[int]  # first column of each column of windows
    height: int  # window size, the tile's or the scene's where the scene is smaller
    width: int


def tiling(height: int, width: int, tile: tuple[int, int], overlap: float) -> Tiling:
    """The windows covering a height×width scene with tiles of `tile` (H, W) or smaller."""
    tile_height, tile_width = min(tile[0], height), min(tile[1], width)
    return Tiling(window_starts(height, tile_height, overlap), window_starts(width, tile_width, overlap),
                  tile_height, tile_width)


def window_starts(length: int, tile: int, overlap: float) -> list[int]:
    """Starts of tiles covering [0, length), spread evenly, neighbours sharing at least
    `overlap` of a tile (the last tile ends at the scene's edge)."""
    if length <= tile:
        return [0]
    stride = max(1, int(tile * (1 - overlap)))
    count = -(-(length - tile) // stride) + 1
    return np.round(np.linspace(0, length - tile, count)).astype(int).tolist()


def ramp(size: int) -> np.ndarray:
    """Rising weights sin²(π/2 · (k + ½) / size): a ramp and its mirror image sum to 1."""
    return (np.sin(np.pi / 2 * (np.arange(size) + 0.5) / size) ** 2).astype(np.float32)


def axis_weights(starts: list[int], tile: int, index: int) -> np.ndarray:
    """Weights along one axis of window `index`: ramps across its overlaps with the windows
    before and after it, 1 elsewhere (at the scene's edges too)."""
    weights = np.ones(tile, np.float32)
    if index > 0:
        shared = starts[index - 1] + tile - starts[index]
        weights[:shared] *= ramp(shared)
    if index < len(starts) - 1:
        shared = starts[index] + tile - starts[index + 1]
        weights[tile - shared:] *= ramp(shared)[::-1]
    return weights


def window_weights(grid: Tiling, device: torch.device):
    """`weights(row, column)`: the height×width blending weights of window (row, column) of `grid`
    on `device`, the outer product of its row's and its column's `axis_weights`, each divided by
    the sum of every window's along that axis (in float64). The blend is then a weighted sum, with
    nothing to divide at the end: the weights over any pixel sum to 1 (to float32's rounding), and
    a lone window's are exactly 1. The axes go to the device once per scene."""
    def axes(starts: list[int], tile: int, length: int) -> torch.Tensor:
        weights = np.stack([axis_weights(starts, tile, index) for index in range(len(starts))]).astype(np.float64)
        total = np.zeros(length)
        for start, window in zip(starts, weights):
            total[start:start + tile] += window
        normalized = torch.from_numpy((weights / np.stack([total[start:start + tile] for start in starts]))
                                      .astype(np.float32))
        return (normalized.pin_memory() if device.type == "cuda" else normalized).to(device, non_blocking=True)

    rows = axes(grid.tops, grid.height, grid.tops[-1] + grid.height)
    columns = axes(grid.lefts, grid.width, grid.lefts[-1] + grid.width)
    return lambda row, column: torch.outer(rows[row], columns[column])


class StripBlender:
    """Weighted sums of window probabilities over rows [top, top + window height) of a scene
    `height` rows tall, on the model's device (torch: in place on a GPU, and on a CPU 7x faster
    than NumPy). Two strips take turns, so that released rows are handed out as they lie, without
    a copy, while the next row of windows is added to the other strip."""

    def __init__(self, rows: int, width: int, height: int, device: torch.device):
        self.top, self.height = 0, height
        self.sums = torch.zeros((len(LABELS), rows, width), dtype=torch.float32, device=device)
        self.valid = torch.zeros((rows, width), dtype=torch.bool, device=device)
        self.spare = None  # the other strip, made at the first release that keeps rows

    def add(self, probs: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, top: int, left: int) -> None:
        rows = slice(top - self.top, top - self.top + weights.shape[0])
        columns = slice(left, left + weights.shape[1])
        self.sums[:, rows, columns].addcmul_(probs, weights)
        self.valid[rows, columns] = valid

    def release(self, end: int):
        """Yield (top, probabilities 4×n×W, valid n×W) for the final rows [top, end), as they lie
        (off the data: whatever the model said there). They are views of this strip, untouched until
        its next turn, which begins once the next release has been yielded: read them before asking
        for the release after that. The strip then starts at `end`, in the other one, its kept rows
        copied there."""
        count = end - self.top
        yield self.top, self.sums[:, :count], self.valid[:count]
        if end < self.height:
            kept = self.valid.shape[0] - count
            self.spare = self.spare or (torch.empty_like(self.sums), torch.empty_like(self.valid))  # all written below
            for old, new in zip((self.sums, self.valid), self.spare):
                new[..., :kept, :] = old[..., count:, :]
                new[..., kept:, :] = 0
            self.spare, (self.sums, self.valid) = (self.sums, self.valid), self.spare
        self.top = end


def prefetched(function, items: list, ahead: int = 1):
    """function(item) for each item, in order, the next `ahead` ones computed meanwhile, each in a
    thread of its own (reading a scene's strips overlaps the model's work, and other reads: GDAL and
    OpenCV release the GIL; `Writer` overlaps the writing likewise)."""
    with concurrent.futures.ThreadPoolExecutor(ahead) as pool:
        pending = collections.deque(pool.submit(function, item) for item in items[:ahead])
        for index in range(len(items)):
            result = pending.popleft().result()
            if index + ahead < len(items):
                pending.append(pool.submit(function, items[index + ahead]))
            yield result


def read_rows(scene, top: int, bottom: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [top, bottom) of `scene`, its whole width, as 3×n×W uint8 pixels and the file's n×W
    mask of valid pixels (None where the file marks none); in pinned memory with `pin` (a GPU then
    copies them without a host sync). The pixels are read straight into it: no copy of them between
    the file and the pinned memory."""
    host = scene.device.type == "cpu"
    pixels = torch.empty((3, bottom - top, scene.width), dtype=torch.uint8, device=scene.device,
                         pin_memory=pin and host)
    _, mask = scene.read(top, 0, bottom - top, scene.width, out=pixels)
    return pixels, mask.pin_memory() if mask is not None and pin and host else mask


def read_strips(height: int, block_rows: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) that read a scene `height` rows tall once, top to bottom, in strips
    of READ_ROWS rows rounded up to the file's blocks (so one strip alone inflates each block).
    Blocks over 4 × READ_ROWS tall are not waited for whole: such a file is read in READ_ROWS all
    the same (its blocks inflated by each strip they span), its strips held in memory as any."""
    rows = READ_ROWS if block_rows > 4 * READ_ROWS else -(-READ_ROWS // block_rows) * block_rows
    return [(start, min(height, start + rows)) for start in range(0, height, rows)]


class ReadRows:
    """The rows of a scene read so far and still needed, on the ensemble's device, in one ring of
    `capacity` rows (scene row r at ring row r % capacity): each strip read ahead (`strips`: (first
    row, 3×n×W uint8 pixels, n×W file mask or None) in order) copied in once, where it is valid (not
    black, and data where the file marks no-data) made once, however many windows share it; and
    each window one slice of it, or two where it wraps. A ring rather than the strips kept apart: a
    1400-row window spans six or seven strips of 256 rows, 14 copies for its pixels and validity,
    against 2 from the ring (4 where it wraps); on a GPU each is a launch queued by the one thread
    that feeds it. `clock` gets the copies to the device."""

    def __init__(self, strips, width: int, capacity: int, device: torch.device, clock: StageClock):
        self.strips, self.capacity, self.clock = strips, capacity, clock
        self.pixels = torch.empty((3, capacity, width), dtype=torch.uint8, device=device)
        self.valid = torch.empty((capacity, width), dtype=torch.bool, device=device)
        self.end = 0  # the rows read so far: [0, end); those from end - capacity are in the ring

    def pieces(self, start: int, stop: int) -> list[tuple[slice, slice]]:
        """(ring rows, rows from `start`) of the scene's rows [start, stop): one piece, or two where they wrap."""
        first, count = start % self.capacity, stop - start
        head = min(count, self.capacity - first)
        wrapped = [(slice(0, count - head), slice(head, count))] if head < count else []
        return [(slice(first, first + head), slice(0, head))] + wrapped

    def hold(self, top: int, end: int) -> None:
        """Hold rows [top, end): the strips read until `end`, over rows above `top` (no longer needed)."""
        while self.end < end:
            strip = next(self.strips, None)
            if strip is None:  # read_strips covers every row: only a window off the scene gets here
                raise RuntimeError(f"rows to {end} held, but the scene's strips end at row {self.end}")
            first, pixels, masks = strip
            if first != self.end or first + pixels.shape[1] - top > self.capacity:
                raise RuntimeError(f"rows {top} to {first + pixels.shape[1]} held in a ring of {self.capacity}, "
                                   f"from a strip at row {first} after row {self.end}")
            with self.clock("to device"):
                # whole to the device first: a piece of a pinned strip is no contiguous block, which torch
                # would copy to unpinned memory before it crossed, and wait for
                pixels = pixels.to(self.pixels.device, non_blocking=True)
                valid = ~no_data(pixels[None])[0, 0]
                if masks is not None:
                    valid &= masks.to(self.valid.device, non_blocking=True)
                for ring, rows in self.pieces(first, first + pixels.shape[1]):
                    self.pixels[:, ring] = pixels[:, rows]
                    self.valid[ring] = valid[rows]
            self.end = first + pixels.shape[1]

    def window(self, images: torch.Tensor, valid: torch.Tensor, top: int, left: int) -> None:
        """Copy the window at (top, left), of `images`' 3×h×w size, into `images` and `valid` (h×w),
        from the rows held (`hold` them first)."""
        height, width = images.shape[-2:]
        if top < self.end - self.capacity or top + height > self.end:
            raise RuntimeError(f"a window of rows {top} to {top + height}, where the ring holds rows "
                               f"{max(0, self.end - self.capacity)} to {self.end}")
        for ring, rows in self.pieces(top, top + height):
            images[:, rows] = self.pixels[:, ring, left:left + width]
            valid[rows] = self.valid[ring, left:left + width]


def blended_rows(scene, ensemble: Ensemble, tile: tuple[int, int], overlap: float, clock: StageClock | None = None):
    """Yield (top, probabilities 4×n×W float32, valid n×W) for the final rows of `scene`, a
    band a row of windows, top to bottom, from its windows batched through the ensemble and
    blended, all on the ensemble's device. The scene is read once, in strips of rows ahead of the windows (`ReadRows`),
    and each batch of windows is copied out of them. A pixel is valid where it is not black
    (predict.no_data) and the file has data there; off the data the probabilities are whatever the
    model said (output_bands writes NODATA there). The bands are views of the blender's strips:
    read each before asking for the band after next (as `Writer` and a plain loop do), so that
    a thread may encode one while this makes the next row of windows. `clock` gets each stage's
    seconds."""
    grid, device, clock = tiling(scene.height, scene.width, tile, overlap), ensemble.device, clock or StageClock()
    windows = [(row, column) for row in range(len(grid.tops)) for column in range(len(grid.lefts))]
    size = ensemble.config.predict.batch_size
    batches = [windows[start:start + size] for start in range(0, len(windows), size)]
    weights = window_weights(grid, device)

    def read(strip):
        with clock("read"):
            return strip[0], *read_rows(scene, *strip, pin=device.type == "cuda")

    blender, current_row = StripBlender(grid.height, scene.width, scene.height, device), 0
    strips = read_strips(scene.height, scene.block_rows)
    # the rows a batch spans, and the last strip's beyond them (a scene no taller: one that never wraps)
    ring = min(scene.height, max(grid.tops[batch[-1][0]] - grid.tops[batch[0][0]] for batch in batches) +
               grid.height + max(end - start for start, end in strips))
    # closed with this generator: its reads ahead finished before a caller that stops early closes the scene
    with contextlib.closing(prefetched(read, strips, READ_AHEAD if device.type == "cuda" else 1)) as read_ahead:
        rows_read = ReadRows(timed_items(read_ahead, clock, "wait for reads"), scene.width, ring, device, clock)
        for batch in batches:
            rows_read.hold(grid.tops[batch[0][0]], grid.tops[batch[-1][0]] + grid.height)
            with clock("to device"):
                images = torch.empty((len(batch), 3, grid.height, grid.width), dtype=torch.uint8, device=device)
                valid = torch.empty((len(batch), grid.height, grid.width), dtype=torch.bool, device=device)
                for index, (row, column) in enumerate(batch):
                    rows_read.window(images[index], valid[index], grid.tops[row], grid.lefts[column])
            with clock("model"):
                probs = ensemble_native(ensemble, images, zero_black=False)[0]  # `valid` marks the black pixels
            for (row, column), window_probs, window_valid in zip(batch, probs, valid):
                if row != current_row:
                    yield from blender.release(grid.tops[row])
                    current_row = row
                with clock("blend"):
                    blender.add(window_probs, weights(row, column), window_valid, grid.tops[row],
                                grid.lefts[column])
    yield from blender.release(scene.height)


def timed_items(items, clock: StageClock, stage: str):
    """The items of an iterator, the time each took to come added to `clock`'s `stage`."""
    items = iter(items)
    while True:
        with clock(stage):
            item = next(items, StopIteration)
        if item is StopIteration:
            return
        yield item


# ---------------------------------------------------------------------------------- one scene


@dataclass(frozen=True)
class SegmentOptions:
    """How `segment` maps scenes: the options of `cloudseg segment`."""

    tile: tuple[int, int] | None = None  # window (H, W); None: the size the model trained on (data.image_size)
    overlap: float = OVERLAP  # share of a tile that neighbouring windows have in common (at least)
    grid: float | None = None  # lat/lon cell size in degrees, or no grid
    time_pattern: str = geo.TIME_PATTERN  # where a scene's time is in its file name (see geo.scene_time)
    outputs: tuple[str, ...] = geo.DEFAULT_OUTPUTS  # a GeoTIFF's bands: of probs, masks, classbits (geo.OUTPUTS)
    compress: str = geo.DEFAULT_CODEC  # a GeoTIFF's codec: zstd, deflate, lerc or none (geo.CODECS)
    cog: bool = False  # a GeoTIFF written as a Cloud-Optimized GeoTIFF (tiled, with overviews)
    # what makes the maps beyond these options (`maps_made_with`): set by `segment` once the checkpoints are loaded
    made_with: dict | None = field(default=None, hash=False)

    def check(self, geotiffs: bool = True) -> None:
        """A one-line error naming the option when an output or the codec is not one of segment's
        (or, where `geotiffs` are to be written, this GDAL cannot write the codec: a JPEG or PNG
        scene's outputs are PNGs, and GDAL is not even imported for them), or the time pattern
        not one `geo.scene_time` can read, or --tile or --grid not a size, or --overlap not a share
        of a window up to MAX_OVERLAP."""
        unknown = [output for output in self.outputs if output not in geo.OUTPUTS]
        if unknown or not self.outputs or len(set(self.outputs)) < len(self.outputs):
            raise ValueError(f"--outputs {','.join(self.outputs)}: give one or more of {', '.join(geo.OUTPUTS)}, "
                             "each once, comma-separated")
        geo.check_codec(self.compress, writable=geotiffs)
        geo.check_time_pattern(self.time_pattern)
        if self.tile is not None and min(self.tile) < 1:
            raise ValueError(f"--tile {' '.join(map(str, self.tile))}: a window's height and width are at least 1")
        if not 0 <= self.overlap <= MAX_OVERLAP:  # NaN too
            raise ValueError(f"--overlap {self.overlap}: the share of a window its neighbours have in common, at least 0 "
                             f"and at most {MAX_OVERLAP} (beyond it each pixel would be predicted over "
                             f"{round(1 / (1 - MAX_OVERLAP) ** 2)} times)")
        if self.grid is not None and not 0 < self.grid <= 180:  # NaN too
            raise ValueError(f"--grid {self.grid}: a cell's size in degrees, above 0 and at most 180")


class SceneCounts:
    """Valid pixels and each class's mask pixels of a scene, in total and per lat/lon cell."""

    def __init__(self, scene, grid: float | None):
        self.scene, self.grid = scene, grid  # the grid asked for; only a scene with a CRS has cells
        self.gridded = bool(grid) and scene.crs is not None
        self.valid, self.classes, self.unplaced = 0, np.zeros(len(LABELS), np.int64), 0  # unplaced: in no cell
        self.cells, self.cell_counts = [np.zeros((0, 2), np.int64)], [np.zeros((0, 1 + len(LABELS)), np.int64)]

    def add(self, top: int, bands: np.ndarray, counts: np.ndarray) -> None:
        """Rows from `top` as `geo.output_bands` made them: their bands and counts. The cells'
        counts are made here, on the host, where GDAL and PROJ give each pixel's latitude and longitude."""
        self.valid += int(counts[0])
        self.classes += counts[1:]
        if self.gridded:
            masks = bands[len(LABELS):]
            valid = masks[0] != geo.NODATA
            lats, lons = geo.lat_lon(self.scene.transform, self.scene.crs, top, valid)
            cells, cell_counts = geo.grid_counts(lats, lons, masks[:, valid], self.grid)
            self.unplaced += int(np.isnan(lats).sum())
            self.cells.append(cells)
            self.cell_counts.append(cell_counts)

    def record(self, name: str, when) -> dict:
        """What the scene's NAME.json holds: the fractions, and the grid cells when gridded."""
        fractions = self.classes / self.valid if self.valid else np.full(len(LABELS), np.nan)
        record = {"name": name, "time": None if when is None else str(when), "height": self.scene.height,
                  "width": self.scene.width, "valid_pixels": self.valid, "grid": self.grid,
                  **{label: float(value) for label, value in zip(LABELS, fractions)}}
        if self.gridded:
            cells, counts = geo.summed_cells(np.concatenate(self.cells), np.concatenate(self.cell_counts))
            record.update(cells=cells.tolist(), counts=counts.tolist())
        if self.unplaced:
            log.warning("segment: %s: %d of its %d valid pixels have no latitude and longitude in its CRS (off a "
                        "geostationary disk?): left out of grid.nc, counted in its fractions", name, self.unplaced,
                        self.valid)
        return record


def segment_scene(path: Path, out_dir: Path, ensemble: Ensemble, options: SegmentOptions,
                  clock: StageClock | None = None, writer: Writer | None = None) -> concurrent.futures.Future:
    """Map one scene into `out_dir` (GeoTIFF in: NAME.tif; JPEG/PNG in: NAME_masks.png and
    NAME_overlay.png), then NAME.json, its fractions, last: its presence means the scene is done.
    The masks use the run's tuned per-class threshold; the rule's minimum area and gate are not
    applied: they were tuned on whole 1400×2100 images (see docs/segment.md). `clock` gets each
    stage's seconds. The outputs are written, and finished (the last blocks compressed, a COG
    copied, NAME.json), in `writer`'s thread: this returns once the scene is read and mapped, with
    the future of the finish, whose result is the scene's record (or its error). Without `writer`,
    in one of its own, awaited."""
    if writer is None:
        with Writer(clock) as writer:
            finish = segment_scene(path, out_dir, ensemble, options, clock, writer)
        return finish
    clock, lane = clock or StageClock(), writer.lane()
    geotiff_map, masks_png, overlay_png, done = scene_outputs(out_dir, path)
    try:
        with geo.open_scene(path, ensemble.device) as scene:
            when = geo.scene_time(path, scene.tags, options.time_pattern)  # its error before any work, not after
            counts = SceneCounts(scene, options.grid)
            thresholds = ensemble.config.predict.threshold
            # closed before the scene, also when the mapping stops early: no read of it left running
            with contextlib.closing(blended_rows(scene, ensemble, options.tile, options.overlap, clock)) as rows:
                if isinstance(scene, geo.GeoTiffScene):
                    close = map_geotiff(scene, rows, thresholds, counts, geotiff_map, options,
                                        writer=writer, lane=lane)
                else:
                    close = map_image(scene, rows, thresholds, counts, masks_png, overlay_png, clock=clock)
    except BaseException:
        if lane is not None:
            writer.wait()
            lane.drain()  # no write of this scene left running once its error is raised
        raise

    def finish() -> dict:
        with published_together() as published:  # nothing of a failed scene left: its maps go with NAME.json
            with clock("write"):
                # a NAME.json here is another call's (this one's would have skipped the scene), of maps these
                # replace: gone before them, so that a finish stopped after leaves the scene to map again, not
                # that record beside these maps or beside none
                published += close(replacing=lambda: remove(done))
            record = {**counts.record(path.name, when), **map_record(options, path)}
            with atomic_path(done) as tmp:
                tmp.write_text(json.dumps(record))
        return record

    if lane is None:
        return writer.submit(finish)
    writer.wait()  # the scene's last rows encoded, so queued on its lane before the finish
    return lane.finish(finish)


class Writer:
    """One thread that encodes and writes outputs in order while the caller computes the next ones,
    across scenes: a scene is finished there while the next one is read and mapped. Each `submit`
    waits for the item before it (so at most two are held, and a band of the blender's strips is
    encoded before the band after next is made); the waits go to `clock`'s "wait for writes". An
    item's error is its own future's: the scene's code that queued it keeps it (map_geotiff,
    segment_scene). With `files` > 1 each file's writes and finish go to a `Lane`, a thread of their
    own, `files` files at once, the encoded rows queued for them up to `queue_bytes` (one item at
    least, however large): this thread then only encodes, and the next scene is mapped while the
    last one's rows are still written."""

    def __init__(self, clock: StageClock | None = None, files: int = 1, queue_bytes: int = WRITE_QUEUE_BYTES):
        self.clock, self.pool, self.pending = clock or StageClock(), concurrent.futures.ThreadPoolExecutor(1), None
        self.files, self.finishes = files, collections.deque()  # the lanes' finishes, oldest first
        self.queue_bytes, self.queued, self.room = queue_bytes, 0, threading.Condition()

    def submit(self, function, *args) -> concurrent.futures.Future:
        self.wait()
        self.pending = self.pool.submit(function, *args)
        return self.pending

    def wait(self) -> None:
        if self.pending is not None:
            with self.clock("wait for writes"):
                concurrent.futures.wait([self.pending])
            self.pending = None

    def lane(self) -> Lane | None:
        """The next file's own thread, once fewer than `files` files are unfinished (else the first
        to finish awaited); None with one file at a time (its writes stay in this thread)."""
        if self.files == 1:
            return None
        if len(self.finishes) >= self.files:
            with self.clock("wait for writes"):
                concurrent.futures.wait(self.finishes, return_when=concurrent.futures.FIRST_COMPLETED)
        self.finishes = collections.deque(finish for finish in self.finishes if not finish.done())
        return Lane(self)

    def reserve(self, size: int) -> None:
        """Wait until `size` more bytes fit the queue (at once where nothing is queued)."""
        with self.room:
            self.room.wait_for(lambda: self.queued == 0 or self.queued + size <= self.queue_bytes)
            self.queued += size

    def release(self, size: int) -> None:
        with self.room:
            self.queued -= size
            self.room.notify_all()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *error) -> None:
        self.wait()
        with self.clock("wait for writes"):
            concurrent.futures.wait(self.finishes)
        self.pool.shutdown()


class Lane:
    """One file's writes, then its finish, in a thread of their own, in order (`Writer.lane`)."""

    def __init__(self, writer: Writer):
        self.writer, self.pool = writer, concurrent.futures.ThreadPoolExecutor(1)  # its thread starts at a submit

    def submit(self, function, *args, size: int = 0) -> None:
        """Queue function(*args), its `size` bytes counted against the writer's queue while queued."""
        self.writer.reserve(size)

        def run():
            try:
                function(*args)
            finally:
                self.writer.release(size)

        try:
            self.pool.submit(run)
        except BaseException:
            self.writer.release(size)  # never queued
            raise

    def drain(self) -> None:
        """Wait for every queued write, and end the thread (after a mapping's error: nothing of the
        file left running)."""
        self.pool.shutdown(wait=True)

    def finish(self, function) -> concurrent.futures.Future:
        """Queue the file's finish, last; the thread ends after it."""
        future = self.pool.submit(function)
        self.pool.shutdown(wait=False)
        self.writer.finishes.append(future)
        return future


def pieces_soon(top: int, probs: torch.Tensor, valid: torch.Tensor, thresholds) -> list[tuple[int, Callable]]:
    """A band of blended rows (a row of windows) as (top, `geo.output_bands_soon`) pieces: ENCODE_ROWS
    rows each on a CPU, where the writer's thread encodes the band in them; on a GPU the band
    whole (its work queued at once)."""
    step = ENCODE_ROWS if valid.device.type == "cpu" else max(1, len(valid))
    return [(top + start, geo.output_bands_soon(probs[:, start:start + step], valid[start:start + step], thresholds))
            for start in range(0, len(valid), step)]


def map_geotiff(scene, rows, thresholds, counts: SceneCounts, out: Path, options: SegmentOptions, *,
                writer: Writer, lane: Lane | None = None):
    """Encode the blended `rows` of a GeoTIFF scene (`geo.output_bands_soon`: a GPU's work queued
    here as each band comes) and write the outputs of `options` into the GeoTIFF `out` as they come,
    in `writer`'s thread (the writes in `lane`'s, if any) while the model works on the next ones: a
    band at a time, in its `pieces_soon`.
    Returns what finishes the file there (`replacing()` once every row is written, then the last
    blocks compressed, a COG copied, the temporary file renamed: it returns [out]) or, after a
    failed write, removes it and raises that write's error. A failed write stops the mapping at
    the next rows; an error of the mapping removes the file here."""
    clock, failed = writer.clock, []  # failed: the first write's error, from the writer's or the lane's thread

    def encode(pieces):
        for top, bands_soon in pieces:
            if failed:
                return
            try:
                with clock("encode"):
                    bands, pixel_counts = bands_soon()
                with clock("write"):
                    counts.add(top, bands, pixel_counts)
                chosen = geo.chosen_bands(bands, options.outputs)
                if lane is None:
                    write(top, chosen)
                else:  # a view of some bands holds them all
                    lane.submit(write, top, chosen, size=bands.nbytes if np.may_share_memory(chosen, bands) else
                                chosen.nbytes)
            except BaseException as error:  # noqa: BLE001 -- kept for the scene: raised by close() or the mapping
                failed.append(error)

    def write(top, bands):
        if failed:
            return
        try:
            with clock("write"):
                strips.write(top, bands)
        except BaseException as error:  # noqa: BLE001 -- as in encode
            failed.append(error)

    def close(replacing: Callable[[], None]):
        if not failed:
            try:
                strips.check_complete()
                replacing()
            except BaseException as error:  # noqa: BLE001 -- as in encode
                failed.append(error)
        if failed:
            removed(failed[0])
        output.close()
        return [out]

    def removed(error: BaseException):
        output.__exit__(type(error), error, error.__traceback__)
        raise error

    output = contextlib.ExitStack()
    written = output.enter_context(geo.geotiff_writer(out, scene, options.outputs, options.compress, options.cog))
    strips = geo.WholeStrips(written, scene.height)
    try:
        for top, probs, valid in rows:
            if failed:
                raise failed[0]
            with clock("encode"):  # a GPU's work queued here, its wait in the writer's thread
                pieces = pieces_soon(top, probs, valid, thresholds)
            writer.submit(encode, pieces)
            if failed:  # the band before failed (submit waited for it): no next row of windows made for nothing
                raise failed[0]
    except BaseException as error:
        failed.append(error)  # the queued encodes and writes of this file return at once
        writer.wait()  # no write of this file left running
        if lane is not None:
            lane.drain()
        removed(error)
    return close


def map_image(scene, rows, thresholds, counts: SceneCounts, masks_png: Path, overlay_png: Path, *,
              clock: StageClock):
    """Gather the masks of a JPEG or PNG scene (held whole anyway); returns what writes
    `masks_png` and `overlay_png` (in the writer's thread), both or neither, `replacing()` first,
    and returns them."""
    masks = np.zeros((len(LABELS), scene.height, scene.width), np.uint8)
    for top, probs, valid in rows:
        with clock("encode"):
            bands, pixel_counts = geo.output_bands(probs, valid, thresholds)
        masks[:, top:top + bands.shape[1]] = bands[len(LABELS):]
        counts.add(top, bands, pixel_counts)

    def write_pngs(replacing: Callable[[], None]) -> list[Path]:
        valid = masks[0] != geo.NODATA
        masks[:, ~valid] = 0
        replacing()
        with published_together() as published:
            published.append(geo.write_png(masks_png, geo.class_bits(masks, valid)))
            published.append(geo.write_png(overlay_png, overlay(scene.image, masks)))
        return published

    return write_pngs


def done_file(out_dir: Path, path: Path) -> Path:
    return out_dir / f"{path.stem}.json"


def scene_outputs(out_dir: Path, path: Path) -> tuple[Path, Path, Path, Path]:
    """Every file that mapping the scene at `path` may write into `out_dir`: a GeoTIFF's map, a
    JPEG's or PNG's masks and overlay, and NAME.json (`done_file`)."""
    return (*(out_dir / f"{path.stem}{end}" for end in (".tif", "_masks.png", "_overlay.png")), done_file(out_dir, path))


# ---------------------------------------------------------------------------------- many scenes


def find_scenes(sources: list[str]) -> list[Path]:
    """Scene files from files, folders (their JPEG, PNG and GeoTIFF files) and glob patterns (the
    files among their matches), sorted, each file once however it is spelt; hidden files (a
    killed run's temporaries, macOS's ._NAME) only where named. An error when none, or when two
    files would write outputs of the same name."""
    found = {}
    for source in sources:
        path = Path(source)
        if path.is_dir():
            candidates = [p for p in path.iterdir() if not p.name.startswith(".")]
        elif path.exists():
            candidates = [path]
        else:
            candidates = [Path(p) for p in glob.glob(source)]  # `*` matches no hidden name
            if not candidates:
                raise FileNotFoundError(f"{source}: no such scene, folder or matching file")
        if candidates != [path]:  # from a folder or a pattern: scene files only (not GDAL's .aux.xml, folders)
            candidates = [p for p in candidates if p.suffix.lower() in geo.SCENE_SUFFIXES and p.is_file()]
        for scene in candidates:
            found.setdefault(scene.resolve(), scene)  # as first given
    scenes = sorted(found.values())
    if not scenes:
        raise FileNotFoundError(f"no JPEG, PNG or GeoTIFF scenes in {', '.join(sources)}")
    twice = [stem for stem, count in collections.Counter(p.stem for p in scenes).items() if count > 1]
    if twice:
        raise ValueError(f"two scenes named {twice[0]} would write the same outputs: "
                         "segment them into different --out folders")
    return scenes


def check_writable(out_dir: Path, scenes: list[Path]) -> None:
    """A one-line error before any work when the output folder cannot take files, or when it holds
    scenes: a GeoTIFF's map would replace its scene, and a rerun would take the maps for scenes."""
    for path in scenes:
        if path.parent.resolve() == out_dir.resolve():
            raise ValueError(f"{path}: --out is its folder, where its maps would replace it or be taken for scenes "
                             "by a rerun: choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: --out is a file, not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        new_hidden_file(out_dir / "write-check").unlink()
    except OSError as error:
        raise ValueError(f"{out_dir}: output folder is not writable ({error.strerror or error})") from None


def segment(sources: list[str], checkpoints: list[str], out_dir: str | Path, options: SegmentOptions = SegmentOptions(),
            *, postprocess_file: str | None = None, overrides: list[str] = (), device: str = "auto",
            clock: StageClock | None = None, tracebacks: bool = False) -> int:
    """Map every scene of `sources` (this process's share under torchrun) into `out_dir` with the
    checkpoints' ensemble (loaded as `predict` loads it: `postprocess_file`, `overrides`, `device`),
    skipping scenes already done (`clock`, if given, gets each stage's seconds); then one process writes fractions.csv (and grid.nc with a grid).
    A bad scene is one line on stderr naming it (after its traceback, with `tracebacks`); the others
    go on. Returns the number that failed."""
    out_dir, scenes = Path(out_dir), find_scenes(sources)
    options.check(geotiffs=any(geo.is_geotiff(path) for path in scenes))
    logging.getLogger("rasterio").setLevel(logging.CRITICAL)  # GDAL's errors reach the user as the scene's one line
    check_writable(out_dir, scenes)
    with warnings.catch_warnings():
        # a scene without georeferencing is mapped as a JPEG is, without: rasterio's warning at each open would be a
        # stray line
        warnings.filterwarnings("ignore", message="(Dataset has no geotransform|The given matrix is equal to Affine.identity)")
        start = time.perf_counter()
        ensemble = load_ensemble(checkpoints, postprocess_file, overrides, str(process_device(device)),
                                 work_pixels=pixels_to_map(scenes, out_dir, options))
        log.info("segment: %d model(s) loaded on %s in %s", len(ensemble.forwards), ensemble.device,
                 human_duration(time.perf_counter() - start))
        options = replace(options, tile=window_size(ensemble, options.tile, checkpoints[0]))
        return segment_scenes(scenes, ensemble, out_dir, replace(options, made_with=maps_made_with(ensemble, options)),
                              clock=clock, tracebacks=tracebacks)


def maps_made_with(ensemble: Ensemble, options: SegmentOptions) -> dict:
    """What makes a scene's maps beyond their format: the checkpoints (their fingerprints: how each
    was trained, wherever its file lies), the TTA, the thresholds (the tuned rule's and the
    overrides') and the windows (tile, overlap). NAME.json records it, and a rerun with another
    maps the scene again rather than keep another model's maps among its own. The precision is
    not in it: a job begun on a CPU and finished on a GPU keeps both's maps (a level apart at most)."""
    return {"checkpoints": list(ensemble.fingerprints), "tta": ensemble.config.predict.tta,
            "threshold": list(ensemble.config.predict.threshold), "tile": list(options.tile), "overlap": options.overlap}


def my_share(scenes: list[Path]) -> list[Path]:
    """The scenes this process maps (every world_size-th from its rank)."""
    return scenes[distributed.rank()::distributed.world_size()]


def pixels_to_map(scenes: list[Path], out_dir: Path, options: SegmentOptions) -> int:
    """Pixels of the scenes that this process will map (its share, less those done), from the
    files' headers: predict.compile=auto compiles only for a job that repays it. Before the
    checkpoints are loaded: a scene done with another model counts as done here."""
    return sum(math.prod(geo.scene_shape(path)) for path in my_share(scenes) if not is_done(out_dir, path, options))


def segment_scenes(scenes: list[Path], ensemble: Ensemble, out_dir: Path, options: SegmentOptions, *,
                   clock: StageClock | None = None, tracebacks: bool = False) -> int:
    """`segment` with the ensemble loaded and `options.tile` set: this process's share of `scenes`,
    then the summaries. Its log lines give the rate over the scenes alone (loading apart; a
    compile, the first batch's, included), then the seconds of each stage (`stages.StageClock`).
    With `tracebacks`, each failed scene's traceback before its line."""
    mine = my_share(scenes)
    for tmp in left_behind([output for path in mine for output in scene_outputs(out_dir, path)]):
        tmp.unlink(missing_ok=True)  # a killed call's, of this process's scenes: no other maps them
    todo = [path for path in mine if not is_done(out_dir, path, options)]
    failed, start, pixels, clock = [], time.perf_counter(), 0, clock or StageClock()

    def fail(path: Path, error: BaseException) -> None:
        failed.append(str(path))
        if tracebacks:  # cloudseg --debug: a bug's, or GDAL's, where it was raised
            traceback.print_exception(error, file=sys.stderr)
        tqdm.write(f"cloudseg segment: {scene_error(path, error)}", file=sys.stderr)

    finishing = []  # (scene, the future of its finish, in the writer's thread while the next scene is mapped)
    with opencv_threads(1), Writer(clock, FILES_AT_ONCE) as writer:
        for path in tqdm(todo, desc=f"segment (process {distributed.rank()})", unit="scene", disable=None):
            try:
                finishing.append((path, segment_scene(path, out_dir, ensemble, options, clock, writer)))
            except Exception as error:  # noqa: BLE001 -- of any class (GDAL's, OpenCV's): the scene's alone
                fail(path, error)
            while finishing and finishing[0][1].done():
                pixels += finished(*finishing.pop(0), fail)
    for path, finish in finishing:  # done: the writer was closed
        pixels += finished(path, finish, fail)
    # every process waits here for all the others' scenes; the counts are all of them, not process 0's
    failed = distributed.gathered(failed)
    done_before, mapped, pixels = np.sum(distributed.gathered([(len(mine) - len(todo), len(todo), pixels)]), 0)
    if distributed.is_main():
        write_summaries(scenes, out_dir, options)
        seconds = time.perf_counter() - start
        log.info("segment: %d scenes, %d done before, %d failed, %d processes; %.3g scenes/s, %.2f megapixels/s "
                 "-> %s", len(scenes), done_before, len(failed), distributed.world_size(),
                 (mapped - len(failed)) / seconds, pixels / 1e6 / seconds, out_dir)
        log.info("segment: %s (process 0, %.1f s)", clock.line(gpu=ensemble.device.type == "cuda"), seconds)
    distributed.stop()
    return len(failed)


def finished(path: Path, finish: concurrent.futures.Future, fail) -> int:
    """The pixels of a scene whose finish is done, or 0 after `fail(path, its error)`."""
    try:
        record = finish.result()
    except Exception as error:  # noqa: BLE001 -- as in segment_scenes: the scene's own
        fail(path, error)
        return 0
    return record["height"] * record["width"]


@contextlib.contextmanager
def opencv_threads(count: int):
    """OpenCV's thread pool at `count` threads for the duration. segment's OpenCV work (encoding the
    rows, in the writer thread) runs beside the model's threads: a pool of its own fought torch's
    on the CPU (one 4200x8400 scene, the demo model, 2 cores: 63 s with OpenCV's default pool, 53 s
    with one thread, 56 s before its encoding moved to OpenCV)."""
    was = cv2.getNumThreads()
    cv2.setNumThreads(count)
    try:
        yield
    finally:
        cv2.setNumThreads(was)


def process_device(device: str) -> torch.device:
    """`device` (auto, cpu, cuda) resolved; under torchrun, this process's GPU (shared where there are
    more processes than GPUs: each a Python of its own, for the pipeline's CPU work), in the process group."""
    return distributed.start(resolve_device(device, "--device"), share_gpus=True)


def window_size(ensemble: Ensemble, tile: tuple[int, int] | None, checkpoint: str) -> tuple[int, int]:
    """--tile, else the size the model trained on (data.image_size of its checkpoint)."""
    if tile:
        return tuple(tile)
    if ensemble.config.data.image_size is None:
        raise ValueError(f"{checkpoint}: trained without data.image_size, so the window size is unknown: "
                         "give --tile H W (e.g. the size of its training images)")
    return tuple(ensemble.config.data.image_size)


def is_done(out_dir: Path, path: Path, options: SegmentOptions) -> bool:
    return done_record(out_dir, path, options) is not None


def done_record(out_dir: Path, path: Path, options: SegmentOptions) -> dict | None:
    """The scene's NAME.json where it exists, written with the same --grid and agreeing with
    `map_record` (a NAME.json from before a key of it was recorded counts as made as today's);
    else None."""
    try:
        record = json.loads(done_file(out_dir, path).read_text())
    except (OSError, ValueError):
        return None
    same = record.get("grid") == options.grid and agrees(record, map_record(options, path))
    return record if same else None


def agrees(record: dict, wanted: dict) -> bool:
    """Whether `record` holds what is `wanted`, key by key and within dicts; a key it lacks (written
    before that key was recorded) counts as wanted."""
    return all(key not in record or (agrees(record[key], value) if isinstance(value, dict) and
                                     isinstance(record[key], dict) else record[key] == value)
               for key, value in wanted.items())


def map_record(options: SegmentOptions, path: Path) -> dict:
    """What NAME.json records of how a scene was mapped, so that a rerun asking for other maps maps
    the scene again: what made them (`options.made_with`, where `segment` has set it) and, for a
    GeoTIFF scene, the map's bands (--outputs), codec and layout (--cog); a JPEG or PNG scene's
    PNGs do not depend on those."""
    record = {} if options.made_with is None else {"made_with": options.made_with}
    if geo.is_geotiff(path):
        record.update(outputs=list(options.outputs), compress=options.compress, cog=options.cog)
    return record


def scene_error(path: Path, error: BaseException) -> str:
    """One line naming the scene (errors from cloudseg already start with the file); for
    rasterio's "Read failed. See previous exception", GDAL's error that caused it; the error's class
    where it is none of SCENE_ERRORS (a GDAL error, OpenCV's, a bug: which it was)."""
    while error.__cause__ is not None or (error.__context__ is not None and "previous exception" in str(error)):
        error = error.__cause__ or error.__context__
    text = geo.one_line(error)
    if not isinstance(error, SCENE_ERRORS) and text != type(error).__name__:
        text = f"{type(error).__name__}: {text}"
    return text if text.startswith(str(path)) else f"{path}: {text}"


FRACTION_COLUMNS = ("name", "time", "height", "width", "valid_pixels", *LABELS)


def write_fractions(records: list[dict], path: Path) -> Path:
    """The scenes' records as a CSV of FRACTION_COLUMNS, a row each, written as pandas writes a
    table (empty where there is no value: no time, no valid pixel's fractions), without importing
    it: 0.3 s of a one-scene call."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as file:
        table = csv.writer(file, lineterminator="\n")
        table.writerow(FRACTION_COLUMNS)
        table.writerows([None if isinstance(value, float) and math.isnan(value) else value
                         for value in map(record.get, FRACTION_COLUMNS)] for record in records)
    return path


def write_summaries(scenes: list[Path], out_dir: Path, options: SegmentOptions) -> None:
    """fractions.csv (one row per scene of `scenes` done: time, size, valid pixels, each class's
    area fraction of the valid pixels) and, with `grid`, grid.nc over the georeferenced ones. A
    summary this call does not write that an earlier call left in `out_dir` is named in a warning:
    it is not of these scenes."""
    grid = options.grid
    records = [record for path in scenes if (record := done_record(out_dir, path, options)) is not None]
    written = set()
    if records:
        written.add(write_fractions(records, out_dir / FRACTIONS_CSV))
    gridded = [record for record in records if record.get("cells")]  # none where PROJ placed no pixel of it
    if grid and gridded:
        for record in gridded:
            record["time"] = None if record["time"] is None else np.datetime64(record["time"])
        written.add(geo.write_netcdf(geo.grid_dataset(gridded, grid), out_dir / GRID_NC))
    elif grid:
        log.warning("segment: --grid but no scene is georeferenced (GeoTIFF with a CRS, pixels PROJ places): "
                    "no %s", GRID_NC)
    for stale in {out_dir / FRACTIONS_CSV, out_dir / GRID_NC} - written:
        if stale.exists():
            log.warning("segment: %s is an earlier call's, not of these scenes: this call wrote none", stale)
