"""Satellite scenes for `cloudseg segment`: reading JPEG, PNG and GeoTIFF scenes by windows (segment's: strips of rows),
writing GeoTIFF outputs with the scene's georeference, and gridding pattern fractions on a
latitude/longitude grid into one NetCDF dataset.

Data path (beyond the competition): scene → **read here** (segment's strips of rows) → model (cloudseg.segment) →
blended probabilities → **GeoTIFF / PNG outputs, fractions, lat/lon grid written here**.

rasterio (GeoTIFF) and xarray (NetCDF, written through scipy) come with the optional extra
`pip install cloudseg[geo]`; JPEG and PNG scenes without a grid need neither.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import functools
import importlib
import itertools
import math
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
import torch

from cloudseg.data import jpeg_frame, read_image, read_jpeg_bytes
from cloudseg.decode import decode_jpegs
from cloudseg.files import atomic_path, new_hidden_file, published_name
from cloudseg.hardware import usable_cores
from cloudseg.syncs import named_sync
from cloudseg.task import LABELS

GEOTIFF_SUFFIXES = (".tif", ".tiff")
SCENE_SUFFIXES = (".jpg", ".jpeg", ".png", *GEOTIFF_SUFFIXES)
GDAL_CACHE_BYTES = 64 << 20  # GDAL's block cache (default: 5% of the RAM) would otherwise hold the output scene; rasterio.Env
# hands an integer GDAL_CACHEMAX to GDAL as bytes (64 alone gave GDAL a cache of 64 bytes)
NODATA = 255  # in every output band: probabilities are 0-254 (p x 254), masks 0/1
TIME_PATTERN = r"(?P<year>\d{4})-?(?P<month>\d{2})-?(?P<day>\d{2})"
"""Default --time-pattern: the first YYYYMMDD or YYYY-MM-DD in a scene's file name."""


def geo_module(name: str):
    """rasterio or xarray (or one of their modules), or a one-line error naming the extra that installs them."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise RuntimeError(f"{name.partition('.')[0]} is not installed: GeoTIFF scenes and --grid need the geo extra "
                           "(pip install cloudseg[geo])") from None


# ---------------------------------------------------------------------------------- reading


class ImageScene:
    """A JPEG or PNG scene, decoded whole (neither format can be read by windows): on the GPU
    where `device` is one and the scene a JPEG (nvJPEG, stream-safe as training's decode), else
    by OpenCV. `pixels` is 3×H×W uint8 RGB on that device; `mask` the H×W valid pixels of a PNG
    with an alpha channel (not transparent: a GeoTIFF's alpha band likewise), else None."""

    crs = transform = mask = None
    tags: dict = {}
    block_rows = 1  # held whole: any rows are read alike

    def __init__(self, path: Path, device: torch.device | str = "cpu"):
        self.path = path
        jpeg = path.suffix.lower() in (".jpg", ".jpeg")
        if jpeg and torch.device(device).type == "cuda":
            self.pixels = decode_jpegs([torch.from_numpy(read_jpeg_bytes(path))], [str(path)], torch.device(device))[0]
        elif jpeg:
            self.pixels = torch.from_numpy(read_image(path)).permute(2, 0, 1)
        else:
            rgb, alpha = read_png(path)
            self.pixels = torch.from_numpy(rgb).permute(2, 0, 1)
            if alpha is not None:
                self.mask = torch.from_numpy(alpha > 0)
        self.height, self.width = self.pixels.shape[1:]

    @property
    def image(self) -> np.ndarray:
        """H×W×3 uint8 RGB on the host (a copy from the GPU once, for the overlay)."""
        return self.pixels.permute(1, 2, 0).cpu().numpy()

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    def read(self, top: int, left: int, height: int, width: int,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The window's 3×h×w uint8 RGB pixels (a view, on the scene's device; copied into `out`
        and returned as it, where given) and the window of `mask` (None without one: then no-data
        is black alone, see `segment`)."""
        pixels = self.pixels[:, top:top + height, left:left + width]
        mask = None if self.mask is None else self.mask[top:top + height, left:left + width]
        return (pixels if out is None else out.copy_(pixels)), mask

    def close(self) -> None:
        pass


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_GREY_ALPHA = 4  # IHDR's colour type of grey with alpha


def read_png(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """An 8-bit RGB PNG as H×W×3 uint8 RGB, and its H×W alpha channel where it has one (else None);
    other kinds are refused with what to do."""
    with open(path, "rb") as file:
        header = file.read(26)  # the signature and IHDR, whose last byte is the colour type
    if header.startswith(PNG_SIGNATURE) and len(header) == 26 and header[25] == PNG_GREY_ALPHA:
        check_pixels(path, 2, np.uint8)  # OpenCV reads it as BGRA, grey copied thrice: refused as grey is
    image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"{path}: corrupt or unreadable PNG")
    check_pixels(path, 1 if image.ndim == 2 else image.shape[2], image.dtype)
    return cv2.cvtColor(image[..., :3], cv2.COLOR_BGR2RGB), image[..., 3].copy() if image.shape[2] == 4 else None


def check_pixels(path: Path, bands: int, dtype) -> None:
    """Scenes are 8-bit RGB, as the model trained on: anything else is refused with the rule to use."""
    if bands < 3:
        raise ValueError(f"{path}: {bands}-band scene; the model needs 3 bands (RGB): make one from your bands first, "
                         "e.g. gdal_translate -b 1 -b 1 -b 1 for a grey scene")
    if np.dtype(dtype) != np.uint8:
        raise ValueError(f"{path}: {np.dtype(dtype)} pixels; the model needs 8-bit RGB: rescale first, e.g. "
                         "gdal_translate -ot Byte -scale MIN MAX 0 255 (the range your visible-light images span)")


class GeoTiffScene:
    """A GeoTIFF scene read by windows (memory bounded by the window, not the scene; segment reads
    strips of rows, the blocks of `block_rows` whole).
    No-data: the file's nodata value, mask or alpha band (GDAL's dataset mask), and black pixels."""

    device = torch.device("cpu")  # where its windows are read to

    def __init__(self, path: Path):
        rasterio = geo_module("rasterio")
        self.path = path
        try:
            self.dataset = rasterio.open(path)
        except rasterio.errors.RasterioIOError as error:
            raise ValueError(f"{path}: not a readable GeoTIFF ({one_line(error)})") from None
        with_alpha = self.dataset.count == 4 and self.dataset.colorinterp[3].name == "alpha"
        check_pixels(path, self.dataset.count, self.dataset.dtypes[0])
        if self.dataset.count > 3 and not with_alpha:
            raise ValueError(f"{path}: {self.dataset.count} bands; the model needs 3 (RGB): keep them first, "
                             "e.g. gdal_translate -b R -b G -b B")
        self.height, self.width = self.dataset.height, self.dataset.width
        self.block_rows = self.dataset.block_shapes[0][0]  # the rows GDAL inflates at once
        self.crs, self.transform = self.dataset.crs, self.dataset.transform
        self.gcps = self.dataset.gcps  # (ground control points, their CRS): ([], None) for most scenes
        self.tags = self.dataset.tags()
        all_valid = geo_module("rasterio.enums").MaskFlags.all_valid
        self.masked = any(flags != [all_valid] for flags in self.dataset.mask_flag_enums)
        self.handles, self.local, self.lock = [self.dataset], threading.local(), threading.Lock()
        self.local.dataset = self.dataset

    def read(self, top: int, left: int, height: int, width: int,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The window's 3×h×w uint8 RGB pixels (inflated straight into `out`, a host tensor of
        that shape, and returned as it, where given) and, where the file marks no-data (a nodata
        value, a mask or alpha band: GDAL's dataset mask), its h×w mask of valid pixels (else
        None). Any thread: each reads through a GDAL handle of its own (one is not safe to share)."""
        dataset = getattr(self.local, "dataset", None) or self.opened()
        window = geo_module("rasterio.windows").Window(left, top, width, height)
        if out is not None and tuple(out.shape) != (3, height, width):  # rasterio would resample into it
            raise ValueError(f"{self.path}: a {height}x{width} window read into {tuple(out.shape)}")
        pixels = dataset.read((1, 2, 3), window=window, out=None if out is None else out.numpy())
        pixels = torch.from_numpy(pixels) if out is None else out
        if not self.masked:
            return pixels, None
        return pixels, torch.from_numpy(dataset.dataset_mask(window=window) > 0)

    def opened(self):
        """This thread's own handle on the file, opened now."""
        self.local.dataset = geo_module("rasterio").open(self.path)
        with self.lock:
            self.handles.append(self.local.dataset)
        return self.local.dataset

    def close(self) -> None:
        for dataset in self.handles:
            dataset.close()


def one_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def is_geotiff(path: Path) -> bool:
    """A scene read (and mapped into a GeoTIFF) through GDAL, by its file's suffix; else a JPEG or
    PNG, decoded whole and mapped into PNGs."""
    return path.suffix.lower() in GEOTIFF_SUFFIXES


@contextlib.contextmanager
def open_scene(path: str | Path, device: torch.device | str = "cpu"):
    """An ImageScene (decoded on `device` where it can be) or GeoTiffScene by the file's suffix;
    errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: scene not found")
    if not is_geotiff(path):
        yield ImageScene(path, device)
        return
    with geo_module("rasterio").Env(GDAL_CACHEMAX=GDAL_CACHE_BYTES):
        scene = GeoTiffScene(path)
        try:
            yield scene
        finally:
            scene.close()


def scene_shape(path: Path) -> tuple[int, int]:
    """(H, W) of a scene from its file's header, nothing decoded: a GeoTIFF's through rasterio, a
    JPEG's frame header (`data.jpeg_frame`, in the first 256 kB unless metadata pushes it further),
    a PNG's IHDR; (0, 0) where there is none readable: mapping the scene then says why."""
    try:
        if is_geotiff(path):
            with geo_module("rasterio").open(path) as dataset:
                return dataset.height, dataset.width
        with open(path, "rb") as file:
            head = file.read(1 << 18)
            if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
                return int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big")
            frame = jpeg_frame(head) or jpeg_frame(head + file.read())
        return (frame.height, frame.width) if frame else (0, 0)
    except (OSError, RuntimeError):  # unreadable, or rasterio missing (RuntimeError from geo_module)
        return 0, 0


TIME_GROUPS = ({"year", "month", "day"}, {"year", "doy"})  # the named groups of a --time-pattern: one of these
TIME_GROUPS_OPTIONAL = {"hour", "minute"}  # and, if there, these


def check_time_pattern(pattern: str) -> None:
    """A one-line error naming --time-pattern unless it is a regular expression whose named groups
    are those `scene_time` reads: year, month, day (hour, minute) or year, doy; checked before any
    scene is mapped, not at the first scene's time."""
    try:
        groups = set(re.compile(pattern).groupindex)
    except re.error as error:
        raise ValueError(f"--time-pattern {pattern}: not a regular expression ({error})") from None
    if not any(needed <= groups <= needed | TIME_GROUPS_OPTIONAL for needed in TIME_GROUPS):
        raise ValueError(f"--time-pattern {pattern}: its named groups must be year, month, day (and hour, minute if "
                         f"there) or year, doy, e.g. {TIME_PATTERN} or A(?P<year>\\d{{4}})(?P<doy>\\d{{3}})")


def scene_time(path: Path, tags: dict, pattern: str = TIME_PATTERN) -> np.datetime64 | None:
    """The scene's time: the file's TIFFTAG_DATETIME (YYYY:MM:DD HH:MM:SS) when it has one with a
    digit (TIFF's "unknown" is its blanks and colons alone), else the first match of `pattern` in
    the file name (named groups year, month, day and optionally hour, minute; or year and doy, the
    day of the year as in MODIS names A2020032); else None."""
    stamp = (tags.get("TIFFTAG_DATETIME") or "").strip()
    if any(character.isdigit() for character in stamp):
        try:
            return np.datetime64(datetime.datetime.strptime(stamp, "%Y:%m:%d %H:%M:%S"), "s")
        except ValueError:
            raise ValueError(f"its TIFFTAG_DATETIME {stamp!r} is not a time as TIFF writes one (YYYY:MM:DD HH:MM:SS): "
                             "set it so, or blank it (gdal_edit.py -mo TIFFTAG_DATETIME= FILE) to take the time "
                             "from the name") from None
    match = re.search(pattern, path.name)
    if not match:
        return None
    try:
        parts = {key: int(value) for key, value in match.groupdict().items() if value}
        if "doy" in parts:
            day = datetime.datetime(parts["year"], 1, 1) + datetime.timedelta(days=parts["doy"] - 1)
            if parts["doy"] < 1 or day.year != parts["year"]:  # not rolled into another year
                raise ValueError(f"{parts['year']} has no day {parts['doy']}")
            parts.update(month=day.month, day=day.day)
        when = datetime.datetime(parts["year"], parts["month"], parts["day"], parts.get("hour", 0),
                                 parts.get("minute", 0))
    except ValueError as error:
        raise ValueError(f"{match.group(0)!r} in its name is not a time ({error}): say where its name has its time "
                         "with --time-pattern") from None
    return np.datetime64(when, "s")


# ---------------------------------------------------------------------------------- writing


def output_bands(probs: torch.Tensor, valid: torch.Tensor, thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Blended rows as they are written, on the host: (8×n×W uint8 bands, int64 counts).

    The bands: the four probabilities as p × 254 rounded, then the four masks (0/1), a class's mask
    where its probability quantized as the tuned rule quantizes it (p × 255 rounded) is above its
    threshold × 255; NODATA (255) in every band where the scene had no data. The counts: the valid
    pixels, then each class's mask pixels among them. `probs` (4×n×W float32) and `valid` (n×W
    bool) stay where they are: on a CUDA device the bands and counts are made there and copied
    (one host sync), on the CPU OpenCV makes them (one vectorised pass each, 8× NumPy's speed; torch
    those of a single pixel)."""
    return output_bands_soon(probs, valid, thresholds)()


def output_bands_soon(probs: torch.Tensor, valid: torch.Tensor, thresholds) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """`output_bands` in two halves: this starts it, the function returned gives its result. On a
    CUDA device the work and the copies to the host are queued now, behind the work that made
    `probs` and before any queued later, and the function waits for them alone (`to_host_soon`):
    a thread that writes rows need not wait for the model's next batches too. On the CPU the
    function does OpenCV's work itself, in the thread that calls it, reading `probs` and `valid` then."""
    above = [math.floor(threshold * 255) for threshold in thresholds]  # q > t·255 ⇔ q > ⌊t·255⌋ for integers q
    if probs.device.type == "cpu" and valid.numel() > 1:  # OpenCV takes a 1×1 array for a scalar, and refuses it
        return functools.partial(_output_bands_opencv, probs.numpy(), valid.numpy(), above)
    return _output_bands_torch(probs, valid, above)


def _output_bands_opencv(probs: np.ndarray, valid: np.ndarray, above: list[int]) -> tuple[np.ndarray, np.ndarray]:
    valid8 = valid.view(np.uint8)  # 1 on the data
    off_data = cv2.compare(valid8, 0, cv2.CMP_EQ)  # 255 off it
    bands = np.empty((2 * len(LABELS), *valid.shape), np.uint8)
    counts = [cv2.countNonZero(valid8)]
    for label, (plane, level) in enumerate(zip(probs, above)):
        probability, mask = bands[label], bands[len(LABELS) + label]
        cv2.convertScaleAbs(plane, probability, alpha=NODATA - 1)  # rounds to nearest even, as np.rint
        cv2.bitwise_and(cv2.compare(cv2.convertScaleAbs(plane, alpha=255), level, cv2.CMP_GT), valid8, mask)
        counts.append(cv2.countNonZero(mask))
        cv2.bitwise_or(probability, off_data, probability)
        cv2.bitwise_or(mask, off_data, mask)
    return bands, np.array(counts, np.int64)


def _output_bands_torch(probs: torch.Tensor, valid: torch.Tensor,
                        above: list[int]) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    # p x 255 rounded and saturated, as quantize and OpenCV, compared as floats: a level below 0 or
    # above 254 (a threshold off [0, 1]) then means every pixel or none, as OpenCV's comparison with
    # its saturated level; compared as uint8 it would wrap.
    quantized = (probs * 255).round_().clamp_(max=255)
    masks = torch.stack([quantized[label] > level for label, level in enumerate(above)]) & valid
    bands = torch.cat([(probs * (NODATA - 1)).round_().to(torch.uint8), masks.to(torch.uint8)])
    counts = torch.cat([valid.sum().view(1), masks.sum((1, 2))])
    on_host = to_host_soon(bands.masked_fill_(~valid, NODATA), counts)
    return lambda: tuple(tensor.numpy() for tensor in on_host())


def to_host_soon(*tensors: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
    """What gives the tensors on the host (as they are, on the CPU). From a GPU: copied into pinned
    memory, queued now on the current stream, and the function waits for these copies alone (one host
    sync, `syncs.NAMED["segment rows"]`, on an event recorded behind them), not for the work queued
    after them as the stream's synchronize would. The event blocks the waiting thread rather than
    spinning: its core goes to GDAL's compression threads and the readers meanwhile."""
    if tensors[0].device.type != "cuda":
        return lambda: tensors
    device = tensors[0].device
    host = tuple(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
                 for tensor in tensors)
    copied = torch.cuda.Event(blocking=True)
    copied.record(torch.cuda.current_stream(device))

    def arrived() -> tuple[torch.Tensor, ...]:
        with named_sync("segment rows", device, checked=False):
            copied.synchronize()
        return host

    return arrived


# Rows of a strip of the output GeoTIFF: rows arrive a band at a time, so strips (not tiles) are
# complete soon after, written once, and leave the cache (a tile rewritten would grow the file).
# 64, not 16: on an H100's 16 cores row c's two maps took 0.13 s in our threads against 0.41 (ZSTD;
# fewer strips to hand over), and 0.81 against 1.07 s in GDAL's (deflate); 256 rows, 0.28 s (ZSTD;
# BENCHMARKS.md, 2026-11-27, night). A strip of 64 rows × 18000 is 1.2 MB for a reader to inflate.
OUTPUT_STRIP_ROWS = 64
BAND_NAMES = [f"{label} probability x254" for label in LABELS] + [f"{label} mask" for label in LABELS]
CLASS_BITS_NAME = "class bits (" + ", ".join(f"{label} {1 << k}" for k, label in enumerate(LABELS)) + ")"
OUTPUTS = {"probs": BAND_NAMES[:len(LABELS)], "masks": BAND_NAMES[len(LABELS):], "classbits": [CLASS_BITS_NAME]}
DEFAULT_OUTPUTS = ("probs", "masks")  # the eight bands `output_bands` makes, written as they are made
# GDAL creation options of each --compress choice: the fastest level of each codec; LERC lossless.
# No predictor: PREDICTOR=2 made row c's maps of benchmarks/segment_speed.py's writes alone 26-37%
# smaller in about the same time (2 cores, 2026-11-27), but with it one fresh-clone run of the COG
# test read other pixels than the plain map's (not reproduced in 20 runs): left out until explained.
CODECS = {"deflate": dict(compress="deflate", zlevel=1), "zstd": dict(compress="zstd", zstd_level=1),
          "lerc": dict(compress="lerc", max_z_error=0), "none": dict(compress="none")}
# ZSTD by default: read by every GDAL since 2.3 (2018), so by rasterio's wheels and QGIS 3; on an H100's
# 16 cores it took segment's row c from 121.7 to 156.2 megapixels/s with under half the CPU (7.2 against
# 16.7 s; BENCHMARKS.md, 2026-11-27). deflate for readers without it (a plain libtiff, MATLAB).
DEFAULT_CODEC = "zstd"
WRITE_THREADS = usable_cores()  # threads compressing a map's strips (ours, or GDAL's NUM_THREADS)
# Each band stored apart (INTERLEAVE=BAND), not the 8 bands pixel by pixel (a COG keeps its driver's
# default): deflate then sees one smooth band at a time and GDAL skips the interleaving copy. Eight
# 2800x9000 bands of smooth probabilities and their masks, deflate, 2 cores: 0.66 s and 42 MB
# against 0.98 s and 120 MB (1 thread: 1.08 s against 1.76). The H100 of 2026-11-26 found segment
# bound by its writes.
INTERLEAVE = "band"


def chosen_bands(bands: np.ndarray, outputs: tuple[str, ...]) -> np.ndarray:
    """The bands of `outputs` (keys of OUTPUTS, in that order) from `output_bands`' eight: the
    probabilities, the masks, or one band of class bits (`mask_bits`)."""
    if tuple(outputs) == DEFAULT_OUTPUTS:
        return bands  # as made, no copy
    masks = bands[len(LABELS):]
    parts = {"probs": bands[:len(LABELS)], "masks": masks, "classbits": None}
    chosen = [mask_bits(masks)[None] if output == "classbits" else parts[output] for output in outputs]
    return chosen[0] if len(chosen) == 1 else np.concatenate(chosen)


def mask_bits(masks: np.ndarray) -> np.ndarray:
    """n×W uint8 from `output_bands`' four mask bands: bit k set where class k's mask is (as
    `class_bits`), NODATA off the data. Off the data every mask band is NODATA (all bits set), and
    so is their OR whatever the shifts drop: 255 stays 255 with no separate pass."""
    bits = masks[0].copy()
    for k in range(1, len(LABELS)):
        bits |= masks[k] << np.uint8(k)
    return bits


@functools.cache
def check_codec(compress: str, writable: bool = True) -> None:
    """A one-line error naming --compress when `compress` is not one of CODECS or, with
    `writable`, when this GDAL cannot write it into a GeoTIFF (GDAL only warns, then writes it
    uncompressed): a 16×16 file written in memory tells."""
    if compress not in CODECS:
        raise ValueError(f"--compress {compress}: not a codec of segment (choose from {', '.join(CODECS)})")
    if not writable:
        return
    if compress in STRIP_ENCODERS:  # written by our threads: their libraries missing is a one-line error now
        geo_module("zstandard"), geo_module("tifffile")
    rasterio = geo_module("rasterio")
    try:
        with rasterio.io.MemoryFile() as memory:
            with memory.open(driver="GTiff", width=16, height=16, count=1, dtype="uint8", crs="EPSG:4326",
                             transform=rasterio.Affine(1, 0, 0, 0, -1, 16), **CODECS[compress]) as out:
                out.write(np.zeros((1, 16, 16), np.uint8))
            with memory.open() as written:
                wrote = f"it wrote {written.compression.name.lower() if written.compression else 'none'}"
    except rasterio.errors.RasterioError as error:
        wrote = one_line(error)
    if wrote != f"it wrote {compress}":
        default = " (the default)" if compress == DEFAULT_CODEC else ""
        raise ValueError(f"--compress {compress}{default}: this GDAL ({rasterio.__gdal_version__}) cannot write it "
                         f"({wrote}); choose another of {', '.join(codec for codec in CODECS if codec != compress)}")


@contextlib.contextmanager
def geotiff_writer(path: Path, scene: GeoTiffScene, outputs: tuple[str, ...] = DEFAULT_OUTPUTS,
                   compress: str = DEFAULT_CODEC, cog: bool = False):
    """What `write_geotiff_rows` writes the uint8 bands of `outputs` (`chosen_bands`) into, for a
    GeoTIFF at `path` with the scene's size, CRS and transform, nodata NODATA, each band stored
    apart (INTERLEAVE; not in a COG), in strips of OUTPUT_STRIP_ROWS, compressed by `compress`
    (CODECS); written to a temporary file renamed over `path` at the end, checked whole
    (`check_whole`). ZSTD strips are compressed in WRITE_THREADS threads of ours
    (`CompressedStrips`); deflate, LERC, none and the COG's file of strips are GDAL's writes. With `cog`, the
    rows go uncompressed to a file of strips, then GDAL's COG driver copies it into a
    Cloud-Optimized GeoTIFF (COG_OPTIONS)."""
    names = [name for output in outputs for name in OUTPUTS[output]]
    with atomic_path(path) as tmp:
        if compress in STRIP_ENCODERS and not cog:
            with CompressedStrips(tmp, (len(names), scene.height, scene.width), compress, published=path) as strips:
                yield strips
            georeference(tmp, scene, names)
            check_whole(tmp, path)
            return
        yield from gdal_geotiff(path, tmp, scene, names, compress, cog)


def gdal_geotiff(path: Path, tmp: Path, scene: GeoTiffScene, names: list[str], compress: str, cog: bool):
    """`geotiff_writer`'s rasterio dataset, GDAL's writer (its blocks compressed in GDAL's threads),
    for the codecs without a STRIP_ENCODER and for a COG's file of strips."""
    rasterio = geo_module("rasterio")
    profile = dict(driver="GTiff", width=scene.width, height=scene.height, count=len(names), dtype="uint8",
                   **georeferencing(scene), nodata=NODATA, blockysize=OUTPUT_STRIP_ROWS,
                   interleave=INTERLEAVE, num_threads=WRITE_THREADS, BIGTIFF="IF_SAFER",
                   photometric="minisblack",  # as ours: else GDAL calls 3 bands RGB, 4 RGBA (a probability as alpha)
                   **CODECS["none" if cog else compress])
    strips = new_hidden_file(path) if cog else tmp  # with `cog`, the rows go to a file of strips first
    try:
        with rasterio.open(strips, "w", **profile) as out:
            for band, name in enumerate(names, start=1):
                out.set_band_description(band, name)
            yield out
        check_whole(strips, path)
        if cog:
            geo_module("rasterio.shutil").copy(strips, tmp, driver="COG", NUM_THREADS=WRITE_THREADS,
                                               **COG_OPTIONS, **COG_CODECS[compress])
            check_whole(tmp, path)
    finally:
        if cog:
            strips.unlink(missing_ok=True)


def zstd_strip(strip: np.ndarray) -> bytes:
    """A strip as TIFF's ZSTD (50000) holds it: one Zstandard frame, level 1 as CODECS says."""
    compressor = getattr(_compressors, "zstd", None)  # one a thread: a compressor is not thread-safe
    if compressor is None:
        compressor = _compressors.zstd = geo_module("zstandard").ZstdCompressor(level=1)
    return compressor.compress(strip)


_compressors = threading.local()
# The codecs whose strips our threads compress (python-zstandard releases the GIL while it works), by
# their names for tifffile; the others are GDAL's (`gdal_geotiff`). Not deflate: GDAL's libdeflate took
# 0.86 CPU s where zlib in our threads took 1.22 for the same maps (2-core VM, 2026-11-27).
STRIP_ENCODERS = {"zstd": zstd_strip}
# Strips handed to the threads and not yet compressed, at most (their rows' bytes), or a task for each
# thread where that is more (a task: every band's strip at a row, 9 MB for eight bands of 18000 pixels;
# fewer would leave threads idle while the writer fetches the next rows): a writer ahead of them waits.
# The strips are views of the rows given to `CompressedStrips.write`, which they keep whole meanwhile:
# the newest ones, the last release or two of a GPU's (1050 rows of eight bands of 18000 pixels: 151 MB).
PENDING_BYTES = 64 << 20
# Compressed bytes above which a map is laid out as a BigTIFF (tifffile decides so only for
# uncompressed data): classic TIFF's 32-bit offsets, less tifffile's own margin for its directories.
CLASSIC_TIFF_BYTES = 2**32 - 2**25


def encoded_each(encode, strips: np.ndarray) -> list[bytes]:
    """encode(strip) for each band's strip (bands × rows × width) in turn: one task of a
    CompressedStrips' threads. A task for each band's strip cost the writing thread 3x the CPU
    (eight 7000x18000 bands of a constant map: 24 ms, 8 ms so; 2-core VM, 2026-11-28)."""
    return [encode(np.ascontiguousarray(strip)) for strip in strips]  # a view where it already is


class CompressedStrips:
    """A GeoTIFF's strips (`shape` bands × height × width, uint8, each band apart) compressed in
    WRITE_THREADS threads as their rows come, then laid out in the file by tifffile once all are
    in (each band's strips together, band after band). Why not GDAL's writer:
    it compresses in threads too, but one thread copies every block into its cache and again into
    its compression job, and on an H100's 16 cores that thread bounded segment (0.67 s for row c's
    two maps, ours 0.15; BENCHMARKS.md, 2026-11-27, night). Here the threads read the rows where
    they lie. The compressed strips wait in a spool beside the map (an unnamed file, gone when
    closed) until it is laid out: memory holds the rows of the strips not yet compressed (at most
    PENDING_BYTES of strips or a task for each thread, and the releases they belong to), never the map."""

    def __init__(self, path: Path, shape: tuple[int, int, int], compress: str, published: Path | None = None):
        self.path, self.shape, self.compress = path, shape, compress
        self.published = published or path  # the name errors give: the map's, not its temporary file's
        self.name, self.closed = str(path), False  # as a rasterio dataset's: the file written, and whether closed
        self.pool = concurrent.futures.ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="cloudseg-compress")
        self.pending, self.pending_bytes = collections.deque(), 0  # ([(band, strip)], future, rows' bytes), oldest first
        self.backlog = max(PENDING_BYTES, WRITE_THREADS * shape[0] * OUTPUT_STRIP_ROWS * shape[2])  # see PENDING_BYTES
        self.places: dict[tuple[int, int], tuple[int, int]] = {}  # (band, strip) -> (offset, length) in the spool
        self.spool = tempfile.TemporaryFile(dir=path.parent)

    def write(self, top: int, bands: np.ndarray) -> None:
        """The rows of every band from `top`, a strip's first row, in whole strips (the map's last
        one may be shorter: `WholeStrips` hands them so)."""
        end, height = top + bands.shape[1], self.shape[1]
        if top % OUTPUT_STRIP_ROWS or (end % OUTPUT_STRIP_ROWS and end != height) or end > height:
            raise ValueError(f"{self.published}: rows {top} to {end} of {height} are no whole strips of "
                             f"{OUTPUT_STRIP_ROWS} rows (WholeStrips makes them)")
        if bands.shape[0] != self.shape[0]:
            raise ValueError(f"{self.published}: {bands.shape[0]} bands, where the map has {self.shape[0]}")
        encode = STRIP_ENCODERS[self.compress]
        for start in range(0, bands.shape[1], OUTPUT_STRIP_ROWS):  # one task for every band's strip there
            strips, strip = bands[:, start:start + OUTPUT_STRIP_ROWS], (top + start) // OUTPUT_STRIP_ROWS
            keys = [(band, strip) for band in range(len(strips))]
            self.pending.append((keys, self.pool.submit(encoded_each, encode, strips), strips.nbytes))
            self.pending_bytes += strips.nbytes
        self.spill()

    def spill(self, everything: bool = False) -> None:
        """Append the compressed strips to the spool, oldest first: those done, and more (waiting
        for them) while over its backlog of rows are pending, or all with `everything`."""
        while self.pending and (everything or self.pending_bytes > self.backlog or self.pending[0][1].done()):
            keys, future, nbytes = self.pending.popleft()
            try:
                compressed = future.result()
            except Exception as error:  # noqa: BLE001 -- a MemoryError, say: named, as the map's
                raise RuntimeError(f"{self.published}: a strip could not be compressed ({error!r})") from error
            with self.disk_errors():
                for key, data in zip(keys, compressed):
                    self.places[key] = (self.spool.tell(), len(data))
                    self.spool.write(data)
            self.pending_bytes -= nbytes

    @contextlib.contextmanager
    def disk_errors(self):
        """An OSError (a full disk, a file-size limit; Python's names no file) as one naming the map."""
        try:
            yield
        except OSError as error:
            raise OSError(f"{self.published}: the map could not be written whole ({error}): is the disk full?") \
                from None

    def read_back(self, offset: int, length: int) -> bytes:
        self.spool.seek(offset)
        return self.spool.read(length)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Lay the strips out in the file (all of them there, or an error); after an error, only stop."""
        try:
            if kind is None:
                self.lay_out()
        finally:
            self.pool.shutdown(cancel_futures=True)
            self.spool.close()
            self.closed = True

    def lay_out(self) -> None:
        """Every strip compressed and spooled, then written from the spool in the file's order."""
        self.spill(everything=True)
        bands, height, width = self.shape
        keys = list(itertools.product(range(bands), range(-(-height // OUTPUT_STRIP_ROWS))))
        missing = [key for key in keys if key not in self.places]
        if missing:
            raise RuntimeError(f"{self.published}: band {missing[0][0] + 1}'s rows from "
                               f"{missing[0][1] * OUTPUT_STRIP_ROWS} were never written")
        with self.disk_errors():
            size = self.spool.tell()  # the spool's end: every strip is in it
            spooled = (self.read_back(*self.places[key]) for key in keys)
            geo_module("tifffile").imwrite(
                self.path, data=spooled, shape=self.shape if bands > 1 else self.shape[1:], dtype=np.uint8,
                planarconfig="separate" if bands > 1 else None, photometric="minisblack",
                rowsperstrip=OUTPUT_STRIP_ROWS, compression=self.compress, metadata=None, software=False,
                bigtiff=size > CLASSIC_TIFF_BYTES)


def georeferencing(scene: GeoTiffScene) -> dict:
    """The scene's georeferencing as rasterio's keywords for a new file: its ground control points
    (and their CRS) where it has them, else its CRS (None where it has none) and transform."""
    gcps, gcp_crs = scene.gcps
    return dict(gcps=gcps, crs=gcp_crs) if gcps else dict(crs=scene.crs, transform=scene.transform)


def georeference(path: Path, scene: GeoTiffScene, names: list[str]) -> None:
    """Give the GeoTIFF at `path` the scene's georeferencing (`georeferencing`), nodata NODATA and
    its bands' names, in GDAL's own tags (GDAL updates the file's header; the strips stay where
    they are). A scene without any is mapped without any, as a JPEG is."""
    rasterio = geo_module("rasterio")
    where = georeferencing(scene)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)  # not yet: that is what we do
        with rasterio.open(path, "r+") as out:
            if "gcps" in where:
                out.gcps = where["gcps"], where["crs"]
            else:
                out.transform = where["transform"]
                if where["crs"] is not None:  # rasterio refuses None here ("CRS is invalid")
                    out.crs = where["crs"]
            out.nodata = NODATA
            for band, name in enumerate(names, start=1):
                out.set_band_description(band, name)


def check_whole(written: Path, name: Path) -> None:
    """An OSError naming `name` unless the GeoTIFF `written` is whole: it opens, and every block of
    every band lies in the file. GDAL writes compressed blocks, and the header at close, where
    rasterio raises no error of theirs (a full disk, a file-size limit): only GDAL's log says so,
    and the file would be published cut short. (A COG stores its overviews before the full
    resolution: cut short, it loses the latter first.) 18 ms for the 3,504 strips of a 7000×18000
    map's 8 bands on the 2-core VM."""
    rasterio = geo_module("rasterio")
    try:
        with rasterio.open(written) as dataset:
            missing = missing_block(dataset, written.stat().st_size)
    except rasterio.errors.RasterioError as error:
        missing = f"it does not open: {one_line(error).removeprefix(f'{written.name}: ')}"  # not the temporary name
    if missing:
        raise OSError(f"{name}: GDAL did not write the map whole ({missing}): is the disk full?")


def missing_block(dataset, size: int) -> str | None:
    """The first block of `dataset` (rasterio) that GDAL's TIFF metadata does not place within the
    file's `size` bytes, named; None where all are there."""
    (block_rows, block_cols), (rows, cols) = dataset.block_shapes[0], dataset.shape
    for band in dataset.indexes:
        for row in range(-(-rows // block_rows)):
            for col in range(-(-cols // block_cols)):
                offset = int(dataset.get_tag_item(f"BLOCK_OFFSET_{col}_{row}", "TIFF", bidx=band) or 0)
                nbytes = int(dataset.get_tag_item(f"BLOCK_SIZE_{col}_{row}", "TIFF", bidx=band) or 0)
                if not offset or not nbytes or offset + nbytes > size:
                    return f"band {band}'s block at row {row}, column {col} is not in the file"
    return None


# GDAL's COG driver: 512×512 tiles, overviews, the header first (HTTP range reads from object
# storage). Overviews by nearest neighbour: masks, class bits and NODATA stay what they are at each level.
COG_OPTIONS = dict(BLOCKSIZE=512, OVERVIEWS="AUTO", RESAMPLING="NEAREST", BIGTIFF="IF_SAFER")
COG_CODECS = {"deflate": dict(COMPRESS="DEFLATE", LEVEL=1), "zstd": dict(COMPRESS="ZSTD", LEVEL=1),
              "lerc": dict(COMPRESS="LERC", MAX_Z_ERROR=0), "none": dict(COMPRESS="NONE")}


def write_geotiff_rows(out, top: int, bands: np.ndarray) -> None:
    """Write h×W rows of bands (`chosen_bands`) at row `top` into `geotiff_writer`'s `out`: our
    threads' strips, or GDAL's dataset a band at a time (each band's rows lie together even in a
    slice of rows, which rasterio would copy whole to make contiguous)."""
    if isinstance(out, CompressedStrips):
        out.write(top, bands)
        return
    window = geo_module("rasterio.windows").Window(0, top, bands.shape[2], bands.shape[1])
    try:
        for index, band in enumerate(bands, start=1):
            out.write(band, index, window=window)
    except geo_module("rasterio.errors").RasterioIOError as error:  # its cause, libtiff's, has no errno nor file
        raise OSError(f"{published_name(Path(out.name))}: GDAL could not write the map "
                      f"({one_line(error.__cause__ or error)}): is the disk full?") from None


class WholeStrips:
    """Rows for `write_geotiff_rows` in whole strips of OUTPUT_STRIP_ROWS (the scene's last one
    as it is): the rows of a strip that one call leaves incomplete are held (copied, at most a
    strip's) until the next call completes it. `CompressedStrips` takes nothing else. GDAL's writer
    takes rows off the strips, but written in part a strip would be compressed, leave
    GDAL's capped cache, then be read back, inflated and compressed again once its other rows came:
    releases of 1050 rows (a GPU's, tile 1400 at overlap 0.25) of an 8-band 4200x9000 map took 3-5%
    more time and CPU written as they came than in whole strips (2 cores, 2026-11-27, medians of
    5). Rows come in order."""

    def __init__(self, out, height: int):
        self.out, self.height, self.next_top, self.held = out, height, 0, None

    def write(self, top: int, bands: np.ndarray) -> None:
        if top != self.next_top:
            raise ValueError(f"rows from {top}: expected row {self.next_top} (each row once, in order)")
        self.next_top = top + bands.shape[1]
        if self.held is not None:
            held, self.held = self.held, None
            need = OUTPUT_STRIP_ROWS - held.shape[1]
            self.write_whole(top - held.shape[1], np.concatenate([held, bands[:, :need]], axis=1))
            top, bands = top + need, bands[:, need:]
        if bands.shape[1] > 0:
            self.write_whole(top, bands)

    def write_whole(self, top: int, bands: np.ndarray) -> None:
        """Write the whole strips of rows starting at a strip's first row `top`; hold the rest."""
        end = top + bands.shape[1]
        cut = end if end == self.height else end - end % OUTPUT_STRIP_ROWS
        if cut > top:
            write_geotiff_rows(self.out, top, bands[:, :cut - top])
        if cut < end:
            self.held = bands[:, cut - top:].copy()

    def check_complete(self) -> None:
        """Raise unless every row of the scene was written (none held, none missing)."""
        if self.next_top != self.height or self.held is not None:
            raise RuntimeError(f"rows {self.next_top - (0 if self.held is None else self.held.shape[1])} to "
                               f"{self.height} of the output were never written")


def write_rgb_geotiff(path: str | Path, image: np.ndarray, crs, transform, nodata=None, tags: dict | None = None,
                      **profile) -> Path:
    """An H×W×3 uint8 RGB image as a GeoTIFF (CRS, transform, nodata, tags such as
    TIFFTAG_DATETIME; `profile`: creation options such as tiled=True), never half-written: how
    synthetic scenes, the tests' and the benchmark's, are made."""
    rasterio = geo_module("rasterio")
    with atomic_path(path) as tmp, rasterio.open(tmp, "w", driver="GTiff", width=image.shape[1], height=image.shape[0],
                                                  count=3, dtype="uint8", crs=crs, transform=transform, nodata=nodata,
                                                  **profile) as out:
        out.write(image.transpose(2, 0, 1))
        if tags:
            out.update_tags(**tags)
    return Path(path)


def write_png(path: Path, rgb_or_grey: np.ndarray) -> Path:
    """A PNG written atomically (H×W grey or H×W×3 RGB uint8)."""
    image = rgb_or_grey if rgb_or_grey.ndim == 2 else cv2.cvtColor(rgb_or_grey, cv2.COLOR_RGB2BGR)
    ok, data = cv2.imencode(".png", image)
    if not ok:
        raise ValueError(f"{path}: OpenCV could not encode the PNG")
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.tobytes())
    return path


def class_bits(masks: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """H×W uint8: bit k set where class k's mask is (Fish 1, Flower 2, Gravel 4, Sugar 8); NODATA off the data."""
    bits = sum((masks[k].astype(np.uint8) << k) for k in range(len(LABELS))).astype(np.uint8)
    bits[~valid] = NODATA
    return bits


# ---------------------------------------------------------------------------------- lat/lon grid


def lat_lon(transform, crs, top: int, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Latitudes and longitudes (degrees, in np.nonzero's order) of the centres of the `valid`
    pixels (rows×width bool) of the rows from `top`; NaN where PROJ has none (off a geostationary
    disk)."""
    lines, columns = np.nonzero(valid)
    xs, ys = geo_module("rasterio.transform").xy(transform, lines + top, columns, offset="center")
    xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    if not crs.is_geographic:
        xs, ys = to_lon_lat(crs, xs, ys)
    placed = np.isfinite(xs) & np.isfinite(ys)
    return np.where(placed, ys, np.nan), np.where(placed, (xs + 180) % 360 - 180, np.nan)


def to_lon_lat(crs, xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Longitudes and latitudes of points in `crs`, inf or NaN where PROJ has none. rasterio raises
    for a call with such a point, the first time (GDAL then gives its transformation inf for them):
    a call that raises is split in halves until each point that fails is alone."""
    try:
        lons, lats = geo_module("rasterio.warp").transform(crs, "EPSG:4326", xs, ys)
        return np.asarray(lons, np.float64), np.asarray(lats, np.float64)
    except Exception:  # noqa: BLE001 -- GDAL's error, of a class rasterio keeps private
        if len(xs) == 1:
            return np.full(1, np.nan), np.full(1, np.nan)
        half = len(xs) // 2
        (lons, lats), (lons2, lats2) = to_lon_lat(crs, xs[:half], ys[:half]), to_lon_lat(crs, xs[half:], ys[half:])
        return np.concatenate([lons, lons2]), np.concatenate([lats, lats2])


def grid_counts(lats: np.ndarray, lons: np.ndarray, masks: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    """Per lat/lon cell of `step` degrees touched by the pixels at `lats`, `lons` (N): (cells K×2
    [lat index, lon index], counts K×5 [pixels, then each class's mask pixels: `masks` K'×N of 0/1]).
    Cell (i, j) spans latitudes -90 + i·step to -90 + (i+1)·step and longitudes -180 + j·step to
    -180 + (j+1)·step; a pole, longitude 180 and rounding past either edge count in the edge's cells.
    Pixels without a latitude or longitude (NaN) are left out."""
    placed = np.isfinite(lats) & np.isfinite(lons)
    lats, lons, masks = lats[placed], lons[placed], masks[:, placed]
    rows, columns = math.ceil(180 / step), math.ceil(360 / step)
    lat_index = np.clip(np.floor((lats + 90) / step), 0, rows - 1).astype(np.int64)
    lon_index = np.clip(np.floor((lons + 180) / step), 0, columns - 1).astype(np.int64)
    keys, inverse = np.unique(lat_index * columns + lon_index, return_inverse=True)
    counts = [np.bincount(inverse, minlength=len(keys))]
    counts += [np.bincount(inverse, weights=mask, minlength=len(keys)) for mask in masks]
    return np.stack([keys // columns, keys % columns], 1), np.stack(counts, 1).astype(np.int64)


def summed_cells(cells: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`grid_counts` pieces (concatenated) with each cell once, its counts summed."""
    unique, inverse = np.unique(cells, axis=0, return_inverse=True)
    total = np.zeros((len(unique), counts.shape[1]), np.int64)
    np.add.at(total, inverse.ravel(), counts)
    return unique, total


def grid_dataset(records: list[dict], step: float):
    """One xarray Dataset over all scenes' gridded counts (each record: `name`, `time` or None,
    `cells`, `counts` as `grid_counts` gives them). Dimensions (time, lat, lon, class), scenes of
    the same time summed, or (scene, lat, lon, class) when a scene has no time. Variables:
    `fraction` (class pixels over valid pixels; NaN where no valid pixel) and `valid_pixels`."""
    xr = geo_module("xarray")
    by_time = all(record["time"] is not None for record in records)
    keys = sorted({record["time"] if by_time else record["name"] for record in records})
    all_cells = np.concatenate([np.asarray(record["cells"], np.int64).reshape(-1, 2) for record in records])
    (lat0, lon0), (lat1, lon1) = all_cells.min(0), all_cells.max(0)
    counts = np.zeros((len(keys), lat1 - lat0 + 1, lon1 - lon0 + 1, 1 + len(LABELS)), np.int64)
    for record in records:
        cells = np.asarray(record["cells"], np.int64).reshape(-1, 2)
        key = keys.index(record["time"] if by_time else record["name"])
        np.add.at(counts, (key, cells[:, 0] - lat0, cells[:, 1] - lon0), np.asarray(record["counts"], np.int64))
    valid = counts[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        fraction = (counts[..., 1:] / valid[..., None]).astype(np.float32)
    first = "time" if by_time else "scene"
    return xr.Dataset(
        {"fraction": ((first, "lat", "lon", "class"), fraction, {"long_name": "area fraction of valid pixels"}),
         "valid_pixels": ((first, "lat", "lon"), valid.astype(np.int32), {"long_name": "valid pixels in the cell"})},
        coords={first: np.array(keys), "class": list(LABELS),
                "lat": -90 + (np.arange(lat0, lat1 + 1) + 0.5) * step,
                "lon": -180 + (np.arange(lon0, lon1 + 1) + 0.5) * step},
        attrs={"grid_degrees": step, "source": "cloudseg segment"})


def write_netcdf(dataset, path: Path) -> Path:
    """NetCDF3 (xarray through scipy, no further package), never half-written."""
    with atomic_path(path) as tmp:
        dataset.to_netcdf(tmp, engine="scipy", format="NETCDF3_64BIT")
    return path
