"""`cloudseg segment` on the CPU: windows, blending, no-data, georeference, fractions and the
lat/lon grid, on small synthetic scenes (models: a tiny untrained UNet, or stand-ins whose
output is known by hand)."""

import contextlib
import json
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cloudseg import segment as segment_module
from cloudseg.cli import main
from cloudseg.geo import ImageScene, write_rgb_geotiff
from cloudseg.predict import BLACK_LEVEL, Ensemble, load_ensemble, load_model, predict_probs
from cloudseg.segment import blended_rows, tiling, window_starts
from cloudseg.stages import StageClock
from tests.conftest import write_tiny_checkpoint
from tests.host_syncs import HostSyncs, StagedCopies

rasterio = pytest.importorskip("rasterio")  # make test installs the geo extra; a bare install skips these
xarray = pytest.importorskip("xarray")
from rasterio.transform import from_origin  # noqa: E402


class ImageArray(ImageScene):
    """A scene held in memory, read as a decoded JPEG or PNG scene is."""

    def __init__(self, image: np.ndarray):
        self.path, self.pixels, (self.height, self.width) = None, torch.from_numpy(image).permute(2, 0, 1), image.shape[:2]


def stand_in(forward, config, batch_size=4):
    """An Ensemble (CPU, eager) of one model given as a function of the uint8 batch -> logits."""
    config = config.model_copy(update={"predict": config.predict.model_copy(update={"batch_size": batch_size})})
    return Ensemble(config, 1000, torch.device("cpu"), None, False, [forward])


def blend(scene, ensemble, tile, overlap):
    """The whole scene's blended probabilities (4×H×W) from `blended_rows`, checking that its row
    bands follow each other from the top to the bottom."""
    parts, expected_top = [], 0
    for top, probs, valid in blended_rows(scene, ensemble, tile, overlap):
        assert top == expected_top and probs.shape[1] == valid.shape[0]
        parts.append(probs.masked_fill(~valid, 0).numpy())  # a copy: the bands are views of the blender's strips
        expected_top += probs.shape[1]
    assert expected_top == scene.height
    return np.concatenate(parts, axis=1)


def pixelwise(images):
    """Logits that depend on each pixel alone: any correct tiling reproduces them exactly."""
    x = images.float() / 255
    return torch.stack([6 * x[:, 0] - 3, 4 * x[:, 1] - 2, 3 * x[:, 2] - 1, x.sum(1) - 1.5], 1)


def smooth_scene(height, width, seed=0):
    rng = np.random.default_rng(seed)
    small = rng.integers(20, 255, (height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    return cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)


@pytest.fixture(scope="module")
def tiny_ensemble(tmp_path_factory):
    """A tiny untrained UNet that 'trained' on 64x96 images, loaded as predict loads it (CPU)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "best.pt")
    return path, load_ensemble([str(path)], "none", device="cpu")


# ---------------------------------------------------------------------------------- windows


def test_windows_cover_the_scene_evenly_with_at_least_the_overlap():
    """Would catch: a last window short of the edge, or neighbours sharing less than asked."""
    starts = window_starts(1000, 300, 0.25)
    assert starts[0] == 0 and starts[-1] == 700
    assert all(300 - (b - a) >= 75 for a, b in zip(starts, starts[1:]))
    assert window_starts(200, 300, 0.25) == [0] and tiling(200, 250, (300, 400), 0.25).height == 200


def test_a_scene_that_fits_one_window_gets_exactly_predicts_probabilities(tiny_ensemble):
    """CPU. Would catch: blending weights that do not cancel for a lone window, a crop or shift,
    the black no-data band left with its probabilities (predict's zero_black zeroes them)."""
    path, ensemble = tiny_ensemble
    image = smooth_scene(60, 90)
    image[:, :20] = 0  # a no-data band
    probs = blend(ImageArray(image), ensemble, (64, 96), 0.25)
    model, _ = load_model(path, torch.device("cpu"))
    expected = predict_probs(model, torch.from_numpy(image.transpose(2, 0, 1))[None], zero_black=True)[0]
    assert np.array_equal(probs, expected.numpy())
    assert probs[:, :, :20].max() == 0 and probs[:, :, 20:].min() > 0


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.6])
def test_any_tiling_reproduces_a_pixelwise_model_on_the_whole_scene(tiny_ensemble, overlap):
    """CPU. A model whose output depends on each pixel alone gives the same map however the
    scene is cut. Would catch: a tile placed one pixel off (or flipped, or cropped from the wrong
    corner), weights not normalised, rows released too early or twice, a missed edge strip."""
    _, ensemble = tiny_ensemble
    image = smooth_scene(101, 157)
    scene = ImageArray(image)
    probs = blend(scene, stand_in(pixelwise, ensemble.config, batch_size=3), (32, 48), overlap)
    expected = torch.sigmoid(pixelwise(torch.from_numpy(image.transpose(2, 0, 1))[None]))[0].numpy()
    assert np.abs(probs - expected).max() < 1e-6


def position_model(images):
    """Logits that rise from -4 to 4 across each window, whatever it shows (a model's edge effects,
    exaggerated): stitching windows side by side draws a seam at every window border."""
    n, _, height, width = images.shape
    across = torch.linspace(-4, 4, width).expand(height, width) + torch.linspace(-4, 4, height)[:, None]
    return across.expand(n, 4, height, width)


def largest_step(probs):
    return max(np.abs(np.diff(probs, axis=1)).max(), np.abs(np.diff(probs, axis=2)).max())


def test_no_seam_shows_where_windows_meet(tiny_ensemble, monkeypatch):
    """CPU. With overlap o pixels the blend moves at most by the model's own step plus π/(2o)
    per pixel (the ramp's steepest slope times a probability difference of at most 1).
    Would catch: a missing blend (windows pasted or plainly averaged), which jumps by ~0.5."""
    _, ensemble = tiny_ensemble
    scene, tile, overlap = ImageArray(smooth_scene(100, 150)), (32, 48), 0.5
    own_step = largest_step(torch.sigmoid(position_model(torch.zeros(1, 3, *tile)))[0].numpy())
    bound = own_step + np.pi / (2 * 16)  # the smallest overlap here: half of 32 rows
    assert largest_step(blend(scene, stand_in(position_model, ensemble.config), tile, overlap)) <= bound
    monkeypatch.setattr(segment_module, "window_weights", lambda grid, device: lambda row, column: torch.ones(
        grid.height, grid.width))
    assert largest_step(blend(scene, stand_in(position_model, ensemble.config), tile, overlap)) > 0.3  # the seam


def test_blended_windows_match_the_whole_scene_prediction(tiny_ensemble):
    """CPU, the tiny UNet: a 128×192 scene in 64×96 windows against the scene in one forward.
    Stated tolerance: at most 0.01 anywhere, and a mean difference at most half that of windows
    pasted side by side without overlap (which the test also computes; measured: 4.5e-5 against
    7.3e-4). Would catch: misplaced windows, and a blend no better than pasting."""
    _, ensemble = tiny_ensemble
    image = smooth_scene(128, 192, seed=1)
    scene = ImageArray(image)
    whole = blend(scene, ensemble, (128, 192), 0.25)
    blended = blend(scene, ensemble, (64, 96), 0.5)
    pasted = blend(scene, ensemble, (64, 96), 0.0)
    assert np.abs(blended - whole).max() < 0.01
    assert np.abs(blended - whole).mean() <= 0.5 * np.abs(pasted - whole).mean()


@pytest.mark.parametrize("read_rows", [256, 10])
def test_the_blend_runs_where_the_model_runs_and_waits_for_nothing(tiny_ensemble, monkeypatch, read_rows):
    """The ensemble on a (fake) GPU: blended_rows on fake CUDA tensors, under HostSyncs, in one
    thread (the read-ahead thread would leave the fake mode; pinning has no fake and is the identity
    here), the scene read in one strip, or in strips of 10 rows (some then wrap around ReadRows'
    ring). Would catch: a blend or validity computed on the host while the model is on the GPU (the
    rows would come back on the CPU, or copies to the host show), any read or blocking copy per
    window (an `.item()`, `.cpu()`, a window's weights sent from pageable memory), and a strip sent
    to the GPU in pieces of its pinned memory (StagedCopies: each piece copied to unpinned memory
    first)."""
    _, ensemble = tiny_ensemble
    monkeypatch.setattr(segment_module, "READ_ROWS", read_rows)
    monkeypatch.setattr(segment_module, "prefetched",  # a generator, as the real one: blended_rows closes it
                        lambda function, items, ahead: (function(item) for item in items))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    gpu = stand_in(pixelwise, ensemble.config, batch_size=3)._replace(device=torch.device("cuda", 0))
    wraps, pieces = [], segment_module.ReadRows.pieces
    monkeypatch.setattr(segment_module.ReadRows, "pieces",
                        lambda ring, *rows: wraps.append(len(pieces(ring, *rows)) > 1) or pieces(ring, *rows))
    with FakeTensorMode(allow_non_fake_inputs=True), HostSyncs() as syncs, StagedCopies() as staged:
        rows = list(blended_rows(ImageArray(smooth_scene(101, 157)), gpu, (32, 48), 0.25))
    assert sum(probs.shape[1] for _, probs, _ in rows) == 101 and len(rows) > 1  # one band per row of windows
    assert {(probs.device.type, valid.device.type) for _, probs, valid in rows} == {("cuda", "cuda")}
    assert syncs.found == [] and staged.found == []
    assert any(wraps) == (read_rows == 10)


def test_the_test_can_fail_staged_copies_sees_a_piece_of_a_strip_sent_to_the_gpu():
    """The control of StagedCopies, on fake CUDA tensors: rows of a 3-band strip (no contiguous
    block: each band's rows lie apart) sent by `.to` and by `copy_` are found; the whole strip, its
    first band's rows, a copy into a GPU tensor's piece (torch makes the GPU's temporary, not the
    host's), and a dense strip in another layout (channels last: `.to` keeps its strides, and
    `copy_` into a GPU tensor of the same strides is one block) are not."""
    with FakeTensorMode(), StagedCopies() as staged:
        strip, ring = torch.zeros(3, 10, 8, dtype=torch.uint8), torch.zeros(3, 30, 8, dtype=torch.uint8, device="cuda")
        strip[:, 2:5].to("cuda", non_blocking=True)
        ring[:, :3].copy_(strip[:, 7:], non_blocking=True)
        strip.to("cuda", non_blocking=True)
        strip[0, 2:5].to("cuda", non_blocking=True)
        ring[:, 4:14].copy_(strip, non_blocking=True)
        last = strip.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # 3x10x8, the bands interleaved
        last.to("cuda", non_blocking=True)
        torch.empty_like(last, device="cuda").copy_(last, non_blocking=True)
    assert staged.found == [("aten._to_copy.default", (3, 3, 8)), ("aten.copy_.default", (3, 3, 8))]


def test_a_tall_scene_is_blended_one_row_of_windows_at_a_time(tiny_ensemble, monkeypatch):
    """A scene ten rows of windows tall, read in strips of a window's height: the blender's strip
    holds one window's height of the scene's width, the first rows leave before the third row
    of windows is read, and the strips read are dropped as the windows go down. Would catch: the
    scene blended whole (a strip of the scene's height), rows held back to the end, or the rows
    read kept (the scene held whole on the device by the end: a ring of the scene's height)."""
    _, ensemble = tiny_ensemble
    monkeypatch.setattr(segment_module, "READ_ROWS", 32)
    held, real_hold = [], segment_module.ReadRows.hold
    monkeypatch.setattr(segment_module.ReadRows, "hold",
                        lambda rows, *span: real_hold(rows, *span) or held.append(rows.pixels.shape[1]))
    reads, strips = [], []
    scene = ImageArray(smooth_scene(320, 96))
    real_read, real_strip = scene.read, segment_module.StripBlender
    monkeypatch.setattr(scene, "read", lambda top, *box, **out: reads.append(top) or real_read(top, *box, **out))
    monkeypatch.setattr(segment_module, "StripBlender", lambda rows, width, height, device: strips.append((rows, width)) or
                        real_strip(rows, width, height, device))
    rows = blended_rows(scene, stand_in(pixelwise, ensemble.config, batch_size=2), (32, 48), 0.0)
    _, first, _ = next(rows)
    assert strips == [(32, 96)] and max(reads) < 3 * 32
    assert first.shape[1] + sum(probs.shape[1] for _, probs, _ in rows) == 320 and max(reads) == 320 - 32
    assert held == [64] * 10  # a batch a row of windows, a strip each: a window's rows and a strip's ahead


def test_a_band_stays_as_it_was_yielded_while_the_next_one_is_made(tiny_ensemble):
    """CPU. The writer thread reads band k while blended_rows makes band k + 1 (adding the next row
    of windows, moving the strip on): band k must not change meanwhile, though the bands are views
    of the blender's strips. Would catch: one strip moved up in place under a band being written
    (the rows of the next window row, or zeros, written over it)."""
    _, ensemble = tiny_ensemble
    rows = blended_rows(ImageArray(smooth_scene(101, 157)), stand_in(pixelwise, ensemble.config, batch_size=2),
                        (32, 48), 0.25)
    previous, count = None, 0
    for top, probs, valid in rows:
        if previous is not None:
            assert torch.equal(previous[0], previous[1]) and torch.equal(previous[2], previous[3]), f"band {count - 1}"
        previous, count = (probs, probs.clone(), valid, valid.clone()), count + 1
    assert count >= 4  # rows of windows: 4


@pytest.mark.parametrize("read_rows, profile", [(7, {"blockysize": 5}), (1000, {}),
                                                (20, {"tiled": True, "blockxsize": 16, "blockysize": 16})])
def test_a_geotiff_is_read_once_in_strips_and_its_windows_cut_from_them(tiny_ensemble, tmp_path, monkeypatch, read_rows,
                                                                        profile):
    """CPU. A GeoTIFF with a nodata value, windows overlapping by a quarter, batches of four
    (across rows of windows), read in strips of `read_rows` rows (7 and 20: multiples of neither
    the window's 40 rows nor the file's strips of 5 rows or tiles of 16; 1000: the scene in one
    strip, in GDAL's own strips): each row of the scene is read once, whole, in
    strips rounded up to the file's blocks, and the blend of a per-pixel model equals that model on
    the whole scene read by rasterio, valid exactly where the file has data and the pixel is not
    black. Would catch: a window cut from the wrong rows of a strip or the wrong strip (a shifted
    or torn window), a strip dropped while a window of the batch still needs it, the validity of
    another strip's rows, rows read twice (the windows read one by one, or strips overlapping) or
    never, and a strip ending inside one of the file's tiles (inflated by two strips)."""
    from rasterio.windows import Window

    from cloudseg.geo import GeoTiffScene, open_scene

    monkeypatch.setattr(segment_module, "READ_ROWS", read_rows)
    image = smooth_scene(90, 130, seed=3)
    image[:25, :40] = 200  # the file's nodata value, not black
    image[60:70, 100:] = 0  # black: no data either
    image[73:78, :50] = 0  # both again where strips and windows wrap around the ring (read_rows 7: 75 rows)
    image[76:88, 60:90] = 200
    path = write_rgb_geotiff(tmp_path / "scene.tif", image, "EPSG:4326", from_origin(-60, 15, 0.1, 0.1), nodata=200,
                             **profile)
    reads, real_read = [], GeoTiffScene.read
    monkeypatch.setattr(GeoTiffScene, "read", lambda scene, *box, **out: reads.append(box) or real_read(scene, *box, **out))
    ensemble = stand_in(pixelwise, tiny_ensemble[1].config, batch_size=4)  # 3 windows a row
    with open_scene(path) as scene:
        block_rows = scene.block_rows
        rows = [(top, probs.clone(), valid.clone()) for top, probs, valid in blended_rows(scene, ensemble, (40, 60), 0.25)]
    probs, valid = torch.cat([probs for _, probs, _ in rows], 1), torch.cat([valid for _, _, valid in rows], 0)
    with rasterio.open(path) as dataset:
        pixels = dataset.read((1, 2, 3))
        data = dataset.dataset_mask(window=Window(0, 0, 130, 90)) > 0
        assert block_rows == profile.get("blockysize", dataset.block_shapes[0][0])
    strip = -(-read_rows // block_rows) * block_rows
    assert reads == [(top, 0, min(strip, 90 - top), 130) for top in range(0, 90, strip)]
    expected = torch.sigmoid(pixelwise(torch.from_numpy(pixels)[None]))[0]
    assert torch.equal(valid, torch.from_numpy(data & (pixels.max(0) > BLACK_LEVEL)))
    assert torch.allclose(probs[:, valid], expected[:, valid], atol=1e-5)


def test_rows_outside_the_ring_are_refused_not_read_stale():
    """CPU. A ring of 10 rows fed strips of 4: a window whose rows left the ring, one below the rows
    read, a strip that would overwrite rows still held, and strips out of order each raise. Would
    catch: a window read from ring rows another strip has overwritten (or never written: the ring
    starts empty), and a ring too small for its strips going on silently."""
    def strips(starts):
        return iter([(start, torch.full((3, 4, 6), 100 + start, dtype=torch.uint8), None) for start in starts])

    rows = segment_module.ReadRows(strips([0, 4, 8, 12]), 6, 10, torch.device("cpu"), StageClock())
    rows.hold(0, 8)
    images, valid = torch.empty(3, 4, 6, dtype=torch.uint8), torch.empty(4, 6, dtype=torch.bool)
    rows.window(images, valid, 4, 0)
    assert images.unique().tolist() == [104] and valid.all()
    with pytest.raises(RuntimeError, match="ring holds rows 0 to 8"):
        rows.window(images, valid, 6, 0)  # rows 8 and 9 not read yet
    with pytest.raises(RuntimeError, match="held in a ring of 10"):
        rows.hold(1, 12)  # the strip of rows 8-11 would overwrite rows 1 and 2, still held
    rows = segment_module.ReadRows(strips([0, 8]), 6, 10, torch.device("cpu"), StageClock())
    rows.hold(0, 4)
    with pytest.raises(RuntimeError, match="strip at row 8 after row 4"):
        rows.hold(4, 12)
    rows = segment_module.ReadRows(strips([0, 4, 8]), 6, 10, torch.device("cpu"), StageClock())
    rows.hold(4, 12)
    with pytest.raises(RuntimeError, match="ring holds rows 2 to 12"):
        rows.window(images, valid, 0, 0)  # rows 0 and 1 overwritten by rows 10 and 11


def test_strips_are_rounded_up_to_the_file_s_blocks_unless_those_are_taller_than_four_strips(monkeypatch):
    """Would catch: a strip ending inside a block (two strips would inflate it), a block taller than
    four strips waited for whole (a file of one 3000-row block held whole), rows left out or read
    twice at the scene's end."""
    monkeypatch.setattr(segment_module, "READ_ROWS", 100)
    assert segment_module.read_strips(250, 1) == [(0, 100), (100, 200), (200, 250)]
    assert segment_module.read_strips(250, 64) == [(0, 128), (128, 250)]
    assert segment_module.read_strips(1000, 400) == [(0, 400), (400, 800), (800, 1000)]
    assert segment_module.read_strips(450, 401) == [(0, 100), (100, 200), (200, 300), (300, 400), (400, 450)]


def test_gdal_s_block_cache_is_the_size_meant_while_a_scene_is_open(tmp_path):
    """CPU, GDAL's own figure (GDALGetCacheMax64 of the libgdal this process loaded). Would catch:
    the size handed over in megabytes where rasterio passes it to GDAL as bytes (64 gave GDAL a
    cache of 64 bytes), or not at all (GDAL's default, 5% of the RAM, then holds the output scene)."""
    import ctypes

    from cloudseg import geo

    path = write_rgb_geotiff(tmp_path / "scene.tif", smooth_scene(40, 60), "EPSG:4326", from_origin(0, 0, 1, 1))
    with geo.open_scene(path):
        maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
        libraries = {line.split()[-1] for line in maps.splitlines() if "/libgdal" in line}
        if not libraries:
            pytest.skip("no libgdal among this process's mapped files (not Linux?)")
        gdal = ctypes.CDLL(libraries.pop())
        gdal.GDALGetCacheMax64.restype = ctypes.c_int64
        assert gdal.GDALGetCacheMax64() == geo.GDAL_CACHE_BYTES == 64 << 20


def test_strips_read_ahead_in_threads_come_in_order_each_thread_with_its_own_gdal_handle(tmp_path):
    """prefetched with three strips ahead, reading a GeoTIFF's rows (as for a GPU): the strips
    come in order and equal a plain read, and each reading thread has a handle of its own. Would
    catch: results out of order, a read dropped, and threads sharing one GDAL handle (not safe)."""
    from cloudseg.geo import open_scene

    path = write_geotiff(tmp_path / "scene.tif", smooth_scene(200, 300), nodata=7)
    strips = [(top, top + 25) for top in range(0, 200, 25)]
    with open_scene(path) as scene:
        alone = [segment_module.read_rows(scene, *strip, pin=False) for strip in strips]
        ahead = list(segment_module.prefetched(lambda strip: segment_module.read_rows(scene, *strip, False), strips, 3))
        handles = len(scene.handles)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(alone, ahead))
    assert len(ahead) == len(strips) and 2 <= handles <= 4  # the opening thread's and up to three readers'


@pytest.mark.parametrize("nodata", [None, 7])
def test_rows_are_read_as_the_file_has_them(tmp_path, nodata):
    """CPU. read_rows reads rows of the whole width straight into their tensor: against rasterio
    reading the same rows (and GDAL's dataset mask for the masks), for a GeoTIFF with and without a
    nodata value, and against slices of the image for a scene held in memory (a JPEG's or PNG's);
    and a window read into a tensor of another size refused. Would catch: rows shifted or
    transposed, the mask of other rows, a mask made up for a file that marks no no-data, a window
    of another size read into the tensor (rasterio resamples it to fit, silently)."""
    from rasterio.windows import Window

    from cloudseg.geo import open_scene

    image = smooth_scene(90, 130)
    image[:20, :30] = 7
    strips = [(0, 40), (50, 90), (25, 65)]
    path = write_geotiff(tmp_path / "scene.tif", image, nodata=nodata)
    with open_scene(path) as scene, rasterio.open(path) as dataset:
        for top, bottom in strips:
            pixels, mask = segment_module.read_rows(scene, top, bottom, pin=False)
            window = Window(0, top, 130, bottom - top)
            assert pixels.shape == (3, bottom - top, 130) and (mask is None) == (nodata is None)
            assert np.array_equal(pixels.numpy(), dataset.read((1, 2, 3), window=window)), top
            if mask is not None:
                assert np.array_equal(mask.numpy(), dataset.dataset_mask(window=window) > 0), top
    with open_scene(path) as scene, pytest.raises(ValueError, match=r"scene.tif: a 20x30 window read into \(3, 40, 60\)"):
        scene.read(0, 0, 20, 30, out=torch.empty((3, 40, 60), dtype=torch.uint8))  # rasterio alone would resample
    for top, bottom in strips:
        pixels, mask = segment_module.read_rows(ImageArray(image), top, bottom, pin=False)
        assert mask is None and np.array_equal(pixels.permute(1, 2, 0).numpy(), image[top:bottom]), top


@pytest.mark.parametrize("thresholds", [[0.5, 0.35, 0.6, 0.65], [-0.1, 1.2, 0.0, 1.0]], ids=["within", "off 0-1"])
def test_output_bands_are_the_same_on_every_device_and_as_the_rule_says(thresholds):
    """geo.output_bands from OpenCV (the CPU's) and from torch (a GPU's, run here on CPU tensors),
    against the rule written out here in NumPy: p x 254 rounded to nearest even, a mask where p x 255
    rounded is above threshold x 255, 255 off the data, and the counts. Probabilities at 0, 1 and
    on the rounding ties included; thresholds off [0, 1] too (predict.threshold takes any number:
    below 0 every pixel, above 1 none). Would catch: a rounding that differs on one device (half up
    against half to even), a threshold compared before quantizing, no-data counted, a level
    compared as uint8 (-0.1 x 255 wraps to 230, 1.2 x 255 to 50)."""
    from cloudseg.geo import _output_bands_opencv, _output_bands_torch, output_bands

    rng = np.random.default_rng(0)
    probs = rng.random((4, 37, 53), dtype=np.float32)
    ties = (np.arange(256, dtype=np.float32) + 0.5) / 255  # p x 255 lands on (or next to) a half
    probs.reshape(4, -1)[:, :256] = ties
    probs[:, 0, :3] = [0, 1, 0.5]
    valid = rng.random((37, 53)) > 0.2
    quantized = np.minimum(np.rint(probs * 255), 255)  # saturated: the last tie is above 1
    masks = np.stack([quantized[c] > thresholds[c] * 255 for c in range(4)]) & valid
    expected = np.concatenate([np.rint(probs * 254), masks]).astype(np.uint8)
    expected[:, ~valid] = 255
    expected_counts = [valid.sum(), *masks.sum((1, 2))]
    above = [int(np.floor(t * 255)) for t in thresholds]
    for name, (bands, counts) in {"opencv": _output_bands_opencv(probs, valid, above),
                                  "torch": _output_bands_torch(torch.from_numpy(probs), torch.from_numpy(valid), above)(),
                                  "dispatch": output_bands(torch.from_numpy(probs), torch.from_numpy(valid), thresholds)
                                  }.items():
        np.testing.assert_array_equal(bands, expected, err_msg=name)
        assert counts.tolist() == expected_counts, name


def test_scenes_one_pixel_wide_are_mapped(tiny_ensemble, tmp_path, monkeypatch):
    """CPU: a GeoTIFF 33×1 (its last piece of ENCODE_ROWS rows a single pixel), one 1×1 and a 1×1
    PNG. Would catch: OpenCV's refusal of a 1×1 band (it takes a 1×1 array for a scalar: "Sizes
    of input arguments do not match") failing the scene, or a wrong mask for it."""
    checkpoint, _ = tiny_ensemble
    (tmp_path / "in").mkdir()
    column = np.full((33, 1, 3), 60, np.uint8)  # grey: data (black would be none), no Fish
    column[::2, 0, 0] = 200  # red on every other row: Fish there
    write_geotiff(tmp_path / "in" / "column.tif", column)
    write_geotiff(tmp_path / "in" / "dot.tif", column[:1])
    cv2.imwrite(str(tmp_path / "in" / "spot.png"), column[:1, :, ::-1])  # OpenCV writes BGR
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 64, 96) == 0
    for name, rows in (("column", 33), ("dot", 1)):
        with rasterio.open(tmp_path / "out" / f"{name}.tif") as out:
            assert np.array_equal(out.read(5)[:, 0], np.arange(rows) % 2 == 0), name
    assert json.loads((tmp_path / "out" / "spot.json").read_text())["Fish"] == 1.0


def test_rows_come_to_the_host_behind_an_event_of_their_own_not_the_stream(fake_cuda, monkeypatch):
    """CPU, a fake GPU (FakeTensorMode's CUDA tensors, tests/fake_cuda.py's streams and events,
    the sync debug mode at "error"): geo.to_host_soon queues copies into pinned memory and records
    an event behind them on the current stream, with no host sync; what it returns then waits on
    that event alone, counted as the named sync "segment rows", the debug mode left on (torch's
    does not check an event's synchronize, and other threads' syncs stay checked). Would catch:
    the stream's synchronize (on a GPU it also waits for the model's next batches, queued
    meanwhile: a writer thread held up), the event recorded before the copies, the wait made at
    the launch, a copy into pageable memory or a blocking one, a wait left uncounted, the mode
    lifted for the whole process while the writer waits."""
    from cloudseg import syncs
    from cloudseg.geo import to_host_soon
    from tests.fake_cuda import H100

    cuda = fake_cuda(H100)
    real_empty, pinned, real_copy = torch.empty, [], torch.Tensor.copy_
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: pinned.append(kwargs.get("pin_memory")) or
                        real_empty(*args, **kwargs))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, source, non_blocking=False:
                        cuda.calls.append(("copy", source.device.type, non_blocking)) or real_copy(self, source, non_blocking))
    torch.cuda.set_sync_debug_mode("error")
    before = syncs.counts["segment rows"]
    with FakeTensorMode(allow_non_fake_inputs=True), HostSyncs() as host_syncs:
        bands, counts = torch.zeros((8, 5, 7), dtype=torch.uint8, device="cuda"), torch.zeros(5, device="cuda")
        pinned.clear()  # torch 2.11's fake mode calls torch.empty itself for the fake tensors above
        arrived = to_host_soon(bands, counts)
        launched, named_at_launch = list(cuda.calls), syncs.counts["segment rows"] - before
        on_host = arrived()
    stream = "default stream of GPU 0"
    assert launched == [("copy", "cuda", True), ("copy", "cuda", True), ("record event", stream)]
    assert named_at_launch == 0 and pinned == [True, True]
    assert cuda.calls[len(launched):] == [("synchronize event", stream, 2)]  # 2: the mode still "error"
    assert syncs.counts["segment rows"] - before == 1 and host_syncs.found == []
    assert [(tensor.device.type, tuple(tensor.shape)) for tensor in on_host] == [("cpu", (8, 5, 7)), ("cpu", (5,))]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_band_is_encoded_in_pieces_on_a_cpu_and_whole_on_a_gpu(monkeypatch, device):
    """CPU, and a fake GPU (FakeTensorMode's CUDA tensors). `pieces_soon` cuts a band of 21 rows
    starting at row 100 into pieces of ENCODE_ROWS (8) on a CPU, and leaves it whole on a GPU. Would
    catch: a GPU's band cut up (a copy to the host and a wait per piece), a CPU's encoded whole
    (the encoder's temporaries as tall as a row of windows), pieces that skip, repeat or shift rows
    (their tops, and their rows where the values are real)."""
    monkeypatch.setattr(segment_module, "ENCODE_ROWS", 8)
    monkeypatch.setattr(segment_module.geo, "output_bands_soon", lambda probs, valid, thresholds: (probs, valid))
    probs = torch.arange(4 * 21 * 5, dtype=torch.float32).reshape(4, 21, 5)
    valid = torch.arange(21 * 5).reshape(21, 5) % 3 > 0
    with FakeTensorMode(allow_non_fake_inputs=True) if device == "cuda" else contextlib.nullcontext():
        pieces = segment_module.pieces_soon(100, probs.to(device), valid.to(device), [0.5] * 4)
    bounds = [(0, 8), (8, 16), (16, 21)] if device == "cpu" else [(0, 21)]
    assert [top for top, _ in pieces] == [100 + start for start, _ in bounds]
    for (start, end), (_, (piece_probs, piece_valid)) in zip(bounds, pieces, strict=True):
        assert piece_probs.device.type == device and piece_probs.shape == (4, end - start, 5)
        assert piece_probs.storage_offset() == start * 5 and piece_valid.storage_offset() == start * 5  # its rows
        if device == "cpu":
            assert torch.equal(piece_probs, probs[:, start:end]) and torch.equal(piece_valid, valid[start:end])


def test_a_model_trained_without_an_image_size_maps_at_the_size_it_trained_on(data_copy, tmp_path):
    """The demo's config says data.image_size: null; training records the size of its images in
    the checkpoint, and segment takes its windows from there, no --tile. Would catch: a checkpoint
    without its training size (segment would refuse: "trained without data.image_size")."""
    from cloudseg.config import load_config
    from cloudseg.train import train
    from tests.conftest import TINY

    config = load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.epochs=1"])
    assert config.data.image_size is None
    train(config, tmp_path / "run")
    scenes = write_pngs(tmp_path / "in", 1, shape=(100, 150))
    assert main(["segment", str(scenes), "--checkpoint", str(tmp_path / "run" / "best.pt"), "--out",
                 str(tmp_path / "out"), "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "out" / "scene00.json").read_text())["valid_pixels"] == 100 * 150


# ---------------------------------------------------------------------------------- GeoTIFF, fractions, grid


def write_geotiff(path, image, crs="EPSG:4326", transform=from_origin(-60, 15, 0.1, 0.1), nodata=None, tags=None):
    """An RGB uint8 GeoTIFF of `image` (H×W×3)."""
    return write_rgb_geotiff(path, image, crs, transform, nodata, tags)


def red_is_fish(images):
    """Probability 1 for Fish where the red channel is above 128, else 0 (logits ±20); the other
    classes always 1: a map whose fractions can be counted by hand."""
    red = images[:, :1].float() > 128
    return torch.cat([torch.where(red, 20.0, -20.0), torch.full_like(red, 20.0, dtype=torch.float32).expand(-1, 3, -1, -1)], 1)


def run_segment(monkeypatch, model, *args, device="cpu"):
    """`cloudseg segment` with the checkpoint's model replaced by `model` (on `device`); its exit status."""
    real = segment_module.load_ensemble

    def with_model(*a, **k):
        ensemble = real(*a, **k)
        return ensemble._replace(forwards=[model]) if model else ensemble
    monkeypatch.setattr(segment_module, "load_ensemble", with_model)
    return main(["segment", *map(str, args), "--device", device])


def test_geotiff_out_keeps_the_scene_georeference_and_its_no_data(tiny_ensemble, tmp_path, monkeypatch):
    """CPU. Would catch: a lost or default CRS or transform, a different size, no-data pixels
    written as probabilities, masks cut by a shifted window (the output's Fish mask must be the
    scene's red pixels exactly)."""
    checkpoint, _ = tiny_ensemble
    image = smooth_scene(150, 230)
    image[40:60, :, :] = 7  # no-data by the file's value, not black enough for the black rule
    transform = from_origin(500000, 1650000, 250, 250)
    (tmp_path / "in").mkdir()
    write_geotiff(tmp_path / "in" / "scene.tif", image, crs="EPSG:32620", transform=transform, nodata=7)
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 64, 96, "--grid", 0.1) == 0
    with rasterio.open(tmp_path / "out" / "scene.tif") as out:
        assert out.crs.to_epsg() == 32620 and out.transform == transform and out.shape == (150, 230)
        assert out.count == 8 and out.nodata == 255
        bands = out.read()
    off = np.zeros((150, 230), bool)
    off[40:60] = True
    assert (bands[:, off] == 255).all() and (bands[:, ~off] != 255).all()
    assert np.array_equal(bands[4][~off], (image[..., 0] > 128)[~off])  # the Fish mask
    assert np.array_equal(bands[0][~off], np.where(image[..., 0] > 128, 254, 0)[~off])  # its probability x254
    # UTM zone 20N: the scene's 57.5 by 37.5 km lie near 14.9°N, 63°W (checked on a map of the zone)
    grid = xarray.open_dataset(tmp_path / "out" / "grid.nc", engine="scipy").load()
    assert 14.5 < grid.lat.min() < grid.lat.max() < 15.0 and -63.1 < grid.lon.min() < grid.lon.max() < -62.4
    assert grid.valid_pixels.sum() == (~off).sum()


@pytest.mark.parametrize("options", [[], ["--compress", "deflate"], ["--cog"]], ids=["zstd", "deflate", "cog"])
def test_a_scene_without_a_crs_keeps_what_georeferencing_it_has(tiny_ensemble, tmp_path, monkeypatch, options):
    """CPU, scenes with none, ground control points alone, and a transform without a CRS, each
    through our writer (ZSTD), GDAL's and the COG copy. Would catch: such a scene failing with the
    default codec alone ("CRS is invalid: None", raised where the map's CRS was set to None), a
    GCP-only scene's map without its GCPs (its georeferencing lost), a transform dropped, or
    rasterio's NotGeoreferencedWarning reaching the user as stray lines, or kept from a library
    caller after segment returns."""
    from rasterio.control import GroundControlPoint

    checkpoint, _ = tiny_ensemble
    image = smooth_scene(70, 90)
    (tmp_path / "in").mkdir()
    profile = dict(driver="GTiff", width=90, height=70, count=3, dtype="uint8")
    gcps = [GroundControlPoint(row, col, -60 + col / 100, 15 - row / 100) for row, col in ((0, 0), (0, 89), (69, 0))]
    transform = from_origin(300, 900, 30, 30)
    for name, georeferencing in (("plain", {}), ("gcps", dict(gcps=gcps, crs="EPSG:4326")),
                                 ("transform", dict(transform=transform))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)
            with rasterio.open(tmp_path / "in" / f"{name}.tif", "w", **profile, **georeferencing) as scene:
                scene.write(image.transpose(2, 0, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out",
                           tmp_path / "out", "--tile", 64, 96, *options) == 0
        assert not [w for w in caught if issubclass(w.category, rasterio.errors.NotGeoreferencedWarning)]
        rasterio.open(tmp_path / "in" / "plain.tif").close()  # the caller's own open, after segment: warned
        assert [w for w in caught if issubclass(w.category, rasterio.errors.NotGeoreferencedWarning)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)
        maps = {name: rasterio.open(tmp_path / "out" / f"{name}.tif") for name in ("plain", "gcps", "transform")}
    with contextlib.ExitStack() as open_maps:
        for out in maps.values():
            open_maps.enter_context(out)
            assert out.crs is None and out.shape == (70, 90)
            assert np.array_equal(out.read(5), image[..., 0] > 128)  # the Fish mask, where the scene's red is
        assert maps["plain"].transform.is_identity and maps["plain"].gcps == ([], None)
        assert maps["transform"].transform == transform and maps["transform"].gcps == ([], None)
        written, gcp_crs = maps["gcps"].gcps
        assert gcp_crs.to_epsg() == 4326 and [(p.row, p.col, p.x, p.y) for p in written] == [
            (p.row, p.col, p.x, p.y) for p in gcps]


def test_no_data_is_not_counted_as_clear_sky(tiny_ensemble, tmp_path, monkeypatch):
    """CPU. A map that is Fish wherever there are data: the Fish fraction is 1 however much of
    the scene has none (a GeoTIFF's nodata, a PNG's black band, a PNG's transparent pixels, as a
    GeoTIFF's alpha band). Would catch: no-data pixels counted as valid pixels without clouds
    (fractions 0.7, 0.6 and 0.8 here), or a PNG's alpha channel ignored or taken as data only
    where opaque."""
    checkpoint, _ = tiny_ensemble
    image = np.full((100, 150, 3), 200, np.uint8)
    (tmp_path / "in").mkdir()
    geotiff, png = image.copy(), image.copy()
    geotiff[:30] = 9
    png[:, :60] = 0
    write_geotiff(tmp_path / "in" / "a.tif", geotiff, nodata=9)
    cv2.imwrite(str(tmp_path / "in" / "b.png"), png)
    transparent = np.dstack([image, np.full((100, 150), 255, np.uint8)])
    transparent[80:, :, 3] = 0  # the bottom 20 rows: no data, though bright red
    transparent[:10, :, 3] = 1  # the top 10 almost transparent: data all the same, as GDAL's alpha mask says
    cv2.imwrite(str(tmp_path / "in" / "c.png"), transparent)
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 64, 96) == 0
    fractions = {r["name"]: r for r in map(json.loads, map(Path.read_text, (tmp_path / "out").glob("*.json")))}
    assert fractions["a.tif"]["valid_pixels"] == 70 * 150 and fractions["a.tif"]["Fish"] == 1.0
    assert fractions["b.png"]["valid_pixels"] == 100 * 90 and fractions["b.png"]["Fish"] == 1.0
    assert fractions["c.png"]["valid_pixels"] == 80 * 150 and fractions["c.png"]["Fish"] == 1.0
    masks = cv2.imread(str(tmp_path / "out" / "b_masks.png"), cv2.IMREAD_UNCHANGED)
    assert (masks[:, :60] == 255).all() and (masks[:, 60:] == 15).all()  # no-data; all four class bits


def test_gridded_fractions_match_hand_counts(tiny_ensemble, tmp_path, monkeypatch):
    """CPU. Two scenes of one day and one of the next, 0.1° pixels from 60°W 15°N, on a 1° grid:
    each cell's Fish fraction is its red pixels over its valid pixels, counted here by hand,
    the same day's scenes summed. Would catch: cells shifted or transposed (lat/lon swapped, rows
    counted from the bottom), no-data counted, a day's scenes averaged instead of summed, times
    not read from the file name or the GeoTIFF's TIFFTAG_DATETIME."""
    checkpoint, _ = tiny_ensemble
    rng = np.random.default_rng(0)
    scenes = {}
    (tmp_path / "in").mkdir()
    for name, tags in [("day_20200202_a.tif", None), ("day_20200202_b.tif", None),
                       ("other.tif", {"TIFFTAG_DATETIME": "2020:02:03 13:30:00"})]:
        image = np.full((40, 60, 3), 100, np.uint8)
        image[..., 0] = np.where(rng.random((40, 60)) < rng.random((4, 1, 6, 1)).repeat(10, 1).repeat(10, 3).reshape(40, 60),
                                 200, 50)
        image[:5, :7] = 3  # no-data
        scenes[name] = image
        write_geotiff(tmp_path / "in" / name, image, nodata=3, tags=tags)
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 16, 24, "--grid", 1.0) == 0
    grid = xarray.open_dataset(tmp_path / "out" / "grid.nc", engine="scipy").load()
    assert grid.lat.values.tolist() == [11.5, 12.5, 13.5, 14.5] and grid.lon.values.tolist() == [-59.5 + i for i in range(6)]
    assert [str(t)[:16] for t in grid.time.values] == ["2020-02-02T00:00", "2020-02-03T13:30"]

    def by_hand(names):
        fish = sum((scenes[n][..., 0] == 200).reshape(4, 10, 6, 10).sum((1, 3)) for n in names)
        valid = sum((scenes[n][..., 0] != 3).reshape(4, 10, 6, 10).sum((1, 3)) for n in names)
        return fish[::-1] / valid[::-1], valid[::-1]  # rows from the north; lat from the south
    for day, names in enumerate([["day_20200202_a.tif", "day_20200202_b.tif"], ["other.tif"]]):
        fraction, valid = by_hand(names)
        assert np.allclose(grid.fraction.sel({"class": "Fish"}).values[day], fraction)
        assert np.array_equal(grid.valid_pixels.values[day], valid)
        assert np.allclose(grid.fraction.sel({"class": "Sugar"}).values[day], 1.0)


GEOSTATIONARY = "+proj=geos +h=35786023 +lon_0=-75 +sweep=x +datum=WGS84"  # GOES-East's full disk


def disk_lat_lon(pixel: float, lines, columns) -> np.ndarray:
    """N×2 latitude, longitude of the centres of a full disk's pixels (`pixel` metres from the
    disk's corner at ±5.5e6 m), PROJ point by point (rasterio's own transform, unpatched): NaN
    where it has none (it raises, or gives inf once it has)."""
    from rasterio.warp import transform

    found = []
    for line, column in zip(lines, columns):
        try:
            lon, lat = transform(GEOSTATIONARY, "EPSG:4326", [-5.5e6 + (column + 0.5) * pixel],
                                 [5.5e6 - (line + 0.5) * pixel])
        except Exception:  # noqa: BLE001 -- off the disk: GDAL's error, a class rasterio keeps private
            lon = lat = [np.nan]
        found.append((lat[0], lon[0]) if np.isfinite(lat[0]) and np.isfinite(lon[0]) else (np.nan, np.nan))
    return np.array(found)


def test_a_full_disk_is_gridded_from_the_pixels_proj_can_place(tiny_ensemble, tmp_path, monkeypatch, caplog):
    """CPU. A geostationary full disk (344 km pixels, red: Fish), its space grey, not black: valid
    pixels that PROJ cannot place (it gives them inf, and raises for a band of rows where it can
    place none, as in a scene wholly off the disk), on a 10° grid beside an ordinary scene. Would
    catch: PROJ's error escaping the scene (a GDAL error class, not a user error: the run stopped,
    no fractions.csv nor grid.nc), or inf latitudes reaching the grid (a cell index of inf:
    grid.nc as large as the machine). The disk's cells count exactly the pixels PROJ places one at
    a time, counted here."""
    from rasterio.transform import from_origin as origin

    checkpoint, _ = tiny_ensemble
    size, pixel = 32, 11e6 / 32
    placed = int(np.isfinite(disk_lat_lon(pixel, *np.nonzero(np.ones((size, size), bool)))[:, 0]).sum())
    assert 0 < placed < size * size
    (tmp_path / "in").mkdir()
    disk = np.full((size, size, 3), 100, np.uint8)
    disk[..., 0] = 200
    write_geotiff(tmp_path / "in" / "disk_20200101.tif", disk, crs=GEOSTATIONARY,
                  transform=origin(-5.5e6, 5.5e6, pixel, pixel))
    write_geotiff(tmp_path / "in" / "plain_20200102.tif", disk[:20, :30])
    write_geotiff(tmp_path / "in" / "space_20200103.tif", disk[:8, :8], crs=GEOSTATIONARY,  # wholly off the disk
                  transform=origin(6e6, 6e6, pixel, pixel))
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 16, 24, "--grid", 10) == 0
    grid = xarray.open_dataset(tmp_path / "out" / "grid.nc", engine="scipy").load()
    assert grid.valid_pixels.values.sum((1, 2)).tolist() == [placed, 20 * 30]  # no cell of space's
    assert "space_20200103.tif: 64 of its 64 valid pixels have no latitude" in caplog.text
    assert np.nanmin(grid.fraction.sel({"class": "Fish"}).values) == 1.0
    unplaced = f"disk_20200101.tif: {size * size - placed} of its {size * size} valid pixels have no latitude"
    assert unplaced in caplog.text
    assert json.loads((tmp_path / "out" / "disk_20200101.json").read_text())["valid_pixels"] == size * size


def test_latitudes_of_a_full_disk_are_nan_exactly_where_proj_has_none(monkeypatch):
    """geo.lat_lon against PROJ point by point, through a transform as strict as rasterio's in a
    new process (it raises for any call holding a point off the disk; once it has, GDAL gives such
    points inf). Would catch: a band of rows dropped whole for one point off the disk, or a failed
    point given another point's latitude (halves joined out of order)."""
    import rasterio.warp
    from rasterio.crs import CRS
    from rasterio.transform import from_origin as origin

    from cloudseg.geo import lat_lon

    real, calls = rasterio.warp.transform, []

    def strict(source, target, xs, ys):
        calls.append(len(xs))
        lons, lats = real(source, target, xs, ys)
        if not np.isfinite(np.concatenate([lons, lats])).all():
            raise RuntimeError("Point outside of projection domain")
        return lons, lats

    crs, pixel = CRS.from_proj4(GEOSTATIONARY), 11e6 / 16
    transform = origin(-5.5e6, 5.5e6, pixel, pixel)
    valid = np.ones((16, 16), bool)
    valid[0, 0] = False
    lines, columns = np.nonzero(valid)
    expected = disk_lat_lon(pixel, lines + 4, columns)  # the rows from 4
    monkeypatch.setattr(rasterio.warp, "transform", strict)
    lats, lons = lat_lon(transform, crs, 4, valid)
    np.testing.assert_allclose(np.stack([lats, lons], 1), expected, rtol=0, atol=1e-9)
    assert 0 < np.isnan(lats).sum() < len(lats) and calls[0] == valid.sum() and len(calls) > 1


def test_a_summary_an_earlier_call_left_is_named_where_this_call_writes_none(tiny_ensemble, tmp_path, monkeypatch,
                                                                           caplog):
    """CPU. A call with --grid, then one without (its grid.nc is the first call's), then one whose
    only scene fails (its fractions.csv too). Would catch: an earlier call's summary left beside
    this call's outputs without a word, or a warning where this call wrote the summary."""
    checkpoint, _ = tiny_ensemble
    (tmp_path / "in").mkdir()
    scene = write_geotiff(tmp_path / "in" / "a_20200101.tif", smooth_scene(20, 30))
    args = ["--checkpoint", checkpoint, "--out", tmp_path / "out", "--tile", 16, 24]
    assert run_segment(monkeypatch, red_is_fish, scene, *args, "--grid", 10) == 0
    assert "earlier call" not in caplog.text
    assert run_segment(monkeypatch, red_is_fish, scene, *args) == 0
    assert f"{tmp_path / 'out' / 'grid.nc'} is an earlier call's" in caplog.text
    assert "fractions.csv is an" not in caplog.text
    caplog.clear()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.jpg").write_bytes(b"not a JPEG")
    assert run_segment(monkeypatch, red_is_fish, tmp_path / "bad" / "b.jpg", *args) == 1
    assert f"{tmp_path / 'out' / 'fractions.csv'} is an earlier call's" in caplog.text


def test_the_poles_the_antimeridian_and_rounding_past_them_count_in_the_grid_s_edge_cells():
    """Would catch: a cell index one past the grid's edge for latitude 90, longitude 180 or a
    value rounded past either (a row of cells at 90.5°N in grid.nc; with negative indices, keys
    packed into one integer crossing into the next row)."""
    from cloudseg.geo import grid_counts
    lats = np.array([90.0, -90.0, 89.99999999999999, 0.05, -90.00000000000001, 12.3])
    lons = np.array([180.0, -180.0, 179.99999999999997, 0.05, -180.00000000000003, -45.6])
    masks = np.array([[1, 0, 1, 1, 0, 1]])
    cells, counts = grid_counts(lats, lons, masks, 1.0)
    assert cells.tolist() == [[0, 0], [90, 180], [102, 134], [179, 359]]  # by hand: floor(lat + 90), floor(lon + 180)
    assert counts.tolist() == [[2, 0], [1, 1], [1, 1], [2, 2]]
    cells, _ = grid_counts(lats, lons, masks, 0.7)  # a step that divides neither 180 nor 360: ceil(180/0.7) = 258 rows
    assert cells[:, 0].max() == 257 and cells[:, 1].max() == 514 and cells.min() == 0


# ---------------------------------------------------------------------------------- many scenes, several processes


def write_pngs(folder, count, shape=(64, 96)):
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        cv2.imwrite(str(folder / f"scene{index:02d}.png"), smooth_scene(*shape, seed=index))
    return folder


def segment_processes(count: int, scenes: Path, checkpoint: Path, out: Path, device: str,
                      **environment: str) -> tuple[list, str]:
    """`cloudseg segment` in `count` processes under torchrun (with `environment` added to theirs):
    (rank, scene, device) of each scene mapped (tests/ddp_entry.py's record), and their stderr."""
    import os
    import subprocess
    import sys

    record = out.with_name(f"{out.name}-record.txt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
               str(Path(__file__).with_name("ddp_entry.py")), "--record-scenes", str(record),
               "segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(out), "--device", device]
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **environment})
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split() for line in record.read_text().splitlines()], result.stderr


def test_two_processes_map_every_scene_once_and_skip_the_done_ones(tiny_ensemble, tmp_path):
    """CPU, two gloo processes under torchrun over 9 scenes, 2 of them done by an earlier run.
    Would catch: both processes taking the same scenes (a scene mapped twice) or a shard lost
    (one never mapped), done scenes mapped again, a summary written before every process is
    through (fractions.csv short of scenes), a summary line counting process 0's scenes alone."""
    checkpoint, _ = tiny_ensemble
    scenes = write_pngs(tmp_path / "in", 9)
    out = tmp_path / "out"
    assert main(["segment", str(scenes / "scene03.png"), str(scenes / "scene07.png"), "--checkpoint", str(checkpoint),
                 "--out", str(out), "--device", "cpu"]) == 0
    done, stderr = segment_processes(2, scenes, checkpoint, out, "cpu")
    names = sorted(name for _, name, _ in done)
    assert names == [f"scene{i:02d}.png" for i in range(9) if i not in (3, 7)]  # each once, the done ones never
    assert {(rank, device) for rank, _, device in done} == {("0", "cpu"), ("1", "cpu")}
    table = (out / "fractions.csv").read_text().splitlines()
    assert len(table) == 1 + 9 and all((out / f"scene{i:02d}_masks.png").is_file() for i in range(9))
    assert "segment: 9 scenes, 2 done before, 0 failed, 2 processes;" in stderr  # both done by process 1


def test_fractions_csv_is_written_as_pandas_writes_the_table(tmp_path):
    """CPU. segment.write_fractions against pandas' to_csv of the same records (what segment wrote
    before it stopped importing pandas): a scene without a time, one without a valid pixel (NaN
    fractions), a name with a comma and an accent, the grid's extra keys left out. Would catch:
    "nan" or "None" written where pandas leaves the cell empty, a name with a comma not quoted,
    columns in another order or an extra one, Windows line endings, the locale's encoding (not
    UTF-8 in a C locale) instead of pandas' UTF-8."""
    import pandas as pd

    from cloudseg.segment import FRACTION_COLUMNS, write_fractions

    records = [{"name": "a.tif", "time": "2019-05-01 12:30:00", "height": 7000, "width": 18000,
                "valid_pixels": 125_000_000, "grid": 1.0, "cells": [[0, 1]], "Fish": 0.1, "Flower": 1 / 3,
                "Gravel": 0.0, "Sugar": 1.0},
               {"name": "b, nuage sombre é.png", "time": None, "height": 64, "width": 96, "valid_pixels": 0,
                "grid": None, "Fish": float("nan"), "Flower": float("nan"), "Gravel": float("nan"),
                "Sugar": float("nan")}]
    write_fractions(records, tmp_path / "fractions.csv")
    expected = pd.DataFrame(records)[list(FRACTION_COLUMNS)].to_csv(index=False, lineterminator="\n")
    assert (tmp_path / "fractions.csv").read_bytes() == expected.encode("utf-8")  # pandas' encoding, whatever the locale


def test_a_rerun_maps_only_the_scenes_without_outputs(tiny_ensemble, tmp_path, monkeypatch):
    """CPU, one process. Would catch: a rerun that maps everything again, or one that trusts a
    scene whose outputs were never finished (its NAME.json is written last)."""
    checkpoint, _ = tiny_ensemble
    scenes = write_pngs(tmp_path / "in", 4)
    arguments = ["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"),
                 "--device", "cpu"]
    assert main(arguments) == 0
    (tmp_path / "out" / "scene01.json").unlink()  # as if stopped while writing scene01's maps
    mapped = []
    real = segment_module.segment_scene
    monkeypatch.setattr(segment_module, "segment_scene", lambda path, *a: mapped.append(path.name) or real(path, *a))
    assert main(arguments) == 0
    assert mapped == ["scene01.png"]
    assert main([*arguments, "--grid", "1"]) == 0  # another grid: every scene again
    assert mapped == ["scene01.png", "scene00.png", "scene01.png", "scene02.png", "scene03.png"]


def write_wide_geotiff(path, height, width=20000, rows=512):
    """A height×width RGB GeoTIFF written `rows` at a time (vertical ramps; deflate keeps it small)."""
    band = np.tile(np.linspace(0, 255, rows).astype(np.uint8)[:, None], (1, width))
    with rasterio.open(path, "w", driver="GTiff", width=width, height=height, count=3, dtype="uint8", crs="EPSG:4326",
                       transform=from_origin(-60, 15, 0.01, 0.01), tiled=True, compress="deflate", zlevel=1) as out:
        for top in range(0, height, rows):
            count = min(rows, height - top)
            out.write(np.stack([band[:count]] * 3), window=rasterio.windows.Window(0, top, width, count))
    return path


@pytest.mark.slow
def test_memory_does_not_grow_with_the_scene(tiny_ensemble, tmp_path):
    """CPU, `make test-all` (about 15 s here: a 20000×8000 scene, 160 megapixels, through a per-pixel
    stand-in model in 256×256 windows). One process maps a 20000×800 scene, then the 20000×8000
    one, and reports its peak resident memory before and after each (tests/ddp_entry.py
    --memory-probe). Bounds: the second scene, ten times taller, adds under 192 MiB to the peak
    (its RGB pixels alone are 458 MiB, its float32 probabilities 2.4 GiB, its 8 output bands 1.2
    GiB); the first adds under 400 MiB (a row of windows in each of two strips: 2 × 256 rows ×
    20000 × 17 bytes = 166 MiB of sums and validity, with the batch, reads and output temporaries).
    Measured 2026-11-28 (2 cores): the first 140-220 MiB, the second 46-136 MiB; the peak levels
    off rather than grows with the scene: after scenes of 16000 rows three times, +62, +59 and +0
    MiB; a 32000-row one after a 4000-row one, +68 (the compressing threads' backlog, up to
    geo.PENDING_BYTES, GDAL's 64 MB block cache and the allocator's arenas filling up).
    Would catch: a scene read or blended whole, outputs gathered before writing, GDAL's block
    cache at 5% of the RAM (its default) holding the scene read (+448 MiB, tried)."""
    import os
    import subprocess
    import sys

    checkpoint, _ = tiny_ensemble
    write_wide_geotiff(tmp_path / "a_wide.tif", 800)
    write_wide_geotiff(tmp_path / "b_wide_and_tall.tif", 8000)
    command = [sys.executable, str(Path(__file__).with_name("ddp_entry.py")), "--memory-probe", "segment",
               str(tmp_path / "a_wide.tif"), str(tmp_path / "b_wide_and_tall.tif"), "predict.batch_size=4",
               "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--tile", "256", "256", "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = {name: (int(before), int(after)) for _, name, before, after in
             (line.split() for line in result.stdout.splitlines() if line.startswith("peak_rss_mib"))}
    (start, first), (_, second) = peaks["a_wide.tif"], peaks["b_wide_and_tall.tif"]
    assert second - first < 192 and first - start < 400, peaks
    with rasterio.open(tmp_path / "out" / "b_wide_and_tall.tif") as out:
        assert out.shape == (8000, 20000)


# ---------------------------------------------------------------------------------- bad input


def test_ctrl_c_is_one_line_and_leaves_no_map_of_the_scene_it_stopped(tiny_ensemble, tmp_path, monkeypatch, capsys):
    """CPU, a KeyboardInterrupt (Ctrl-C) from the model in the second scene's second batch. Would
    catch: a traceback for the user (38 lines), an exit status other than 130 (128 + SIGINT, as
    shells and training say), the second scene's map or a temporary of it left behind, or the
    first scene's outputs lost."""
    checkpoint, _ = tiny_ensemble
    (tmp_path / "in").mkdir()
    for name in ("a", "b"):
        write_geotiff(tmp_path / "in" / f"{name}.tif", smooth_scene(150, 230))
    calls = []

    def interrupted_in_the_second_scene(images):
        calls.append(len(images))
        if len(calls) == 5:  # 9 windows a scene in batches of 4, 4 and 1: the second scene's second batch
            raise KeyboardInterrupt
        return pixelwise(images)

    assert run_segment(monkeypatch, interrupted_in_the_second_scene, tmp_path / "in", "predict.batch_size=4",
                       "--checkpoint", checkpoint, "--out", tmp_path / "out", "--tile", 64, 96) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["cloudseg: interrupted"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["a.json", "a.tif"]


def test_bad_scenes_are_one_line_each_and_the_others_go_on(tiny_ensemble, tmp_path, capsys):
    """CPU. Would catch: a bad scene stopping the job or failing silently, a message without
    the file, an exit status that hides failures, a half-written output left behind, a scene
    smaller than a window refused (it is mapped as one window), --debug showing no traceback, or
    a grey PNG with alpha mapped as RGB (grey copied thrice) where one without is refused."""
    from PIL import Image

    checkpoint, _ = tiny_ensemble
    scenes = write_pngs(tmp_path / "in", 1)
    cv2.imwrite(str(scenes / "small.png"), smooth_scene(20, 30))
    (scenes / "garbage.jpg").write_bytes(b"not an image at all")
    cv2.imwrite(str(scenes / "cut.jpg"), smooth_scene(64, 96))
    (scenes / "cut.jpg").write_bytes((scenes / "cut.jpg").read_bytes()[:-600])
    cv2.imwrite(str(scenes / "grey.png"), smooth_scene(64, 96)[..., 0])
    Image.fromarray(np.stack([smooth_scene(64, 96)[..., 0], np.full((64, 96), 255, np.uint8)], -1), "LA").save(
        scenes / "greyalpha.png")  # OpenCV reads it as 4 bands: grey thrice and alpha
    cv2.imwrite(str(scenes / "deep.png"), smooth_scene(64, 96).astype(np.uint16) * 257)
    write_geotiff(scenes / "torn.tif", smooth_scene(200, 300))
    (scenes / "torn.tif").write_bytes((scenes / "torn.tif").read_bytes()[:60000])
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"),
                 "--device", "cpu"]) == 6
    lines = capsys.readouterr().err.strip().splitlines()
    messages = {Path(line.split(": ")[1]).name: line for line in lines if line.startswith("cloudseg segment: ")}
    assert sorted(messages) == ["cut.jpg", "deep.png", "garbage.jpg", "grey.png", "greyalpha.png", "torn.tif"], lines
    assert "truncated JPEG" in messages["cut.jpg"] and "not a JPEG" in messages["garbage.jpg"]
    assert "1-band scene" in messages["grey.png"] and "gdal_translate -b 1 -b 1 -b 1" in messages["grey.png"]
    assert "2-band scene" in messages["greyalpha.png"]
    assert "uint16 pixels" in messages["deep.png"] and "-ot Byte -scale" in messages["deep.png"]
    assert "Read error" in messages["torn.tif"]  # GDAL's cause, not rasterio's "See previous exception"
    table = (tmp_path / "out" / "fractions.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in table[1:]] == ["scene00.png", "small.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["fractions.csv", "scene00.json", "scene00_masks.png", "scene00_overlay.png", "small.json", "small_masks.png",
         "small_overlay.png"])  # nothing of the bad scenes, no temporary file
    assert main(["--debug", "segment", str(scenes / "grey.png"), "--checkpoint", str(checkpoint), "--out",
                 str(tmp_path / "out"), "--device", "cpu"]) == 1
    error = capsys.readouterr().err  # --debug: the scene's traceback, then its line
    assert error.startswith("Traceback (most recent call last):") and messages["grey.png"] in error.splitlines()


def test_an_unwritable_output_folder_or_mismatched_checkpoints_are_one_line(tiny_ensemble, tmp_path, capsys):
    """CPU. Would catch: a traceback, or a job that maps scenes it cannot write, blends models
    trained on other input sizes, overwrites a GeoTIFF scene with its map, or finds no scene and
    says nothing; an --out that is a file told as "not writable (File exists)"."""
    checkpoint, _ = tiny_ensemble
    scenes = write_pngs(tmp_path / "in", 1)
    (tmp_path / "file").write_text("")
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "file" / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"cloudseg: error: {tmp_path / 'file' / 'out'}: output folder is not "
                                               "writable (Not a directory)")
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip() == f"cloudseg: error: {tmp_path / 'file'}: --out is a file, not a folder"
    other = write_tiny_checkpoint(tmp_path / "other" / "best.pt", image_size=(128, 192))
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--checkpoint", str(other), "--out",
                 str(tmp_path / "out"), "--postprocess", "none", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"cloudseg: error: {other}: trained on images of (128, 192)") and "\n" not in error
    write_geotiff(scenes / "geo.tif", smooth_scene(64, 96))
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(scenes)]) == 2
    assert f"{scenes / 'geo.tif'}: --out is its folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["segment", str(tmp_path / "empty"), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o")]) == 2
    assert "no JPEG, PNG or GeoTIFF scenes in" in capsys.readouterr().err
    untold = write_tiny_checkpoint(tmp_path / "untold" / "best.pt", image_size=None)
    assert main(["segment", str(scenes), "--checkpoint", str(untold), "--out", str(tmp_path / "out"),
                 "--device", "cpu"]) == 2
    assert "trained without data.image_size" in capsys.readouterr().err


def test_scenes_are_the_scene_files_of_folders_and_patterns_each_once(tmp_path, monkeypatch):
    """Would catch: hidden files of a folder taken for scenes (macOS's ._a.tif, a killed run's
    .a.tif.RANDOM.tmp: each a failed scene), a pattern's GDAL sidecar (a.tif.aux.xml) or folder
    taken for one, or one file given twice (relative and absolute, or through a link) refused as
    two scenes of one name."""
    from cloudseg.segment import find_scenes

    folder = tmp_path / "in"
    (folder / "sub.tif").mkdir(parents=True)  # a folder named like a scene
    for name in ("a.tif", "b.jpg", "._a.tif", ".hidden.png", "a.tif.aux.xml", "notes.txt"):
        (folder / name).write_bytes(b"")
    (tmp_path / "link.jpg").symlink_to(folder / "b.jpg")
    assert find_scenes([str(folder)]) == [folder / "a.tif", folder / "b.jpg"]
    assert find_scenes([str(folder / "*")]) == [folder / "a.tif", folder / "b.jpg"]
    assert find_scenes([str(folder / ".hidden.png")]) == [folder / ".hidden.png"]  # named: taken
    monkeypatch.chdir(tmp_path)
    assert find_scenes(["in/b.jpg", str(folder / "b.jpg"), str(tmp_path / "link.jpg"), "in/../in/b.jpg"]) == [
        Path("in/b.jpg")]
    (tmp_path / "a.png").write_bytes(b"")  # another file, of a's name
    with pytest.raises(ValueError, match="two scenes named a would write the same outputs"):
        find_scenes([str(folder), str(tmp_path / "a.png")])


def test_a_scene_named_like_an_override_is_a_scene(tiny_ensemble, tmp_path, monkeypatch):
    """CPU. Would catch: run.v2=x.png, a file in the working folder, taken for the override
    `run.v2` (its scene never mapped), or a real override (predict.batch_size=1) taken for a scene
    (no such file)."""
    checkpoint, _ = tiny_ensemble
    monkeypatch.chdir(tmp_path)
    cv2.imwrite("run.v2=x.png", smooth_scene(64, 96))
    assert main(["segment", "run.v2=x.png", "predict.batch_size=1", "--checkpoint", str(checkpoint), "--out", "out",
                 "--device", "cpu"]) == 0
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "fractions.csv", "run.v2=x.json", "run.v2=x_masks.png", "run.v2=x_overlay.png"]


def test_an_out_folder_that_holds_scenes_is_refused(tiny_ensemble, tmp_path, capsys):
    """CPU. Would catch: JPEG scenes mapped into their own folder, where a rerun takes a_masks.png
    and a_overlay.png for scenes (a failed scene, a scene mapped from a map)."""
    checkpoint, _ = tiny_ensemble
    scenes = write_pngs(tmp_path / "in", 1)
    assert main(["segment", str(scenes), "--checkpoint", str(checkpoint), "--out", str(scenes)]) == 2
    assert capsys.readouterr().err.strip() == (f"cloudseg: error: {scenes / 'scene00.png'}: --out is its folder, "
                                               "where its maps would replace it or be taken for scenes by a rerun: "
                                               "choose another --out")
    assert sorted(path.name for path in scenes.iterdir()) == ["scene00.png"]


def test_without_the_geo_extra_the_message_names_it(monkeypatch):
    """Would catch: a bare ImportError (or a traceback) for users without rasterio/xarray."""
    import builtins

    from cloudseg import geo

    real_import = builtins.__import__

    def no_rasterio(name, *args, **kwargs):
        if name.startswith("rasterio"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_rasterio)
    monkeypatch.setattr(geo.importlib, "import_module", lambda name: no_rasterio(name))
    with pytest.raises(RuntimeError, match=r"rasterio is not installed: .*pip install cloudseg\[geo\]"):
        geo.geo_module("rasterio.windows")
