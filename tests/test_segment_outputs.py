"""`cloudseg segment`'s outputs (--outputs, --compress, --cog), its GDAL threads and its stage line
(cloudseg.stages), on the CPU with small scenes and models that cost nothing."""

import contextlib
import json
import logging
import re
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from cloudseg import geo
from cloudseg import segment as segment_module
from cloudseg.checkpoint import fingerprint, load_checkpoint, save_checkpoint
from cloudseg.stages import StageClock
from tests.test_segment import pixelwise, run_segment, smooth_scene, tiny_ensemble, write_geotiff  # noqa: F401

rasterio = pytest.importorskip("rasterio")


@pytest.fixture
def scene_dir(tmp_path):
    """One 150×230 GeoTIFF scene with a black (no-data) band of rows."""
    image = smooth_scene(150, 230)
    image[40:60] = 0
    (tmp_path / "in").mkdir()
    write_geotiff(tmp_path / "in" / "scene.tif", image)
    return tmp_path / "in"


def segmented(monkeypatch, checkpoint, scenes, out, *options) -> int:
    """The exit status of `cloudseg segment` of `scenes` into `out` with the pixelwise model, 64×96
    windows, no tuned rule and `options`."""
    return run_segment(monkeypatch, pixelwise, scenes, "--checkpoint", checkpoint, "--out", out, "--tile", 64, 96,
                       "--postprocess", "none", *options)


def mapped(monkeypatch, checkpoint, scenes, out, *options):
    """The bands of scene.tif mapped into `out` (`segmented`) with `options`, and (its codec, its
    band descriptions)."""
    assert segmented(monkeypatch, checkpoint, scenes, out, *options) == 0
    with rasterio.open(out / "scene.tif") as written:
        codec = written.compression.name.lower() if written.compression else "none"
        assert "--cog" in options or written.count == 1 or written.interleaving.value == "BAND"  # geo.INTERLEAVE
        return written.read(), (codec, written.descriptions)


@pytest.mark.parametrize("compress", ["zstd", "lerc", "none", "deflate"])
@pytest.mark.parametrize("threads", [1, 5])
def test_bands_are_identical_whichever_codec_and_threads(tiny_ensemble, scene_dir, tmp_path, monkeypatch,
                                                         compress, threads):
    """CPU. Would catch: a lossy codec setting (LERC with a tolerance), a codec option ignored (the
    file's compression is checked), or strips compressed in parallel landing out of place against
    the default write (one thread, or more than the cores: ours for ZSTD, GDAL's for the others), or the CLI's default codec not the documented one."""
    checkpoint, _ = tiny_ensemble
    reference, (default_codec, _) = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "reference")
    assert default_codec == geo.DEFAULT_CODEC == "zstd"  # docs/segment.md says why
    monkeypatch.setattr(geo, "WRITE_THREADS", threads)
    bands, (codec, _) = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "out", "--compress", compress)
    assert codec == compress
    assert bands.shape == (8, 150, 230) and np.array_equal(bands, reference)


def test_class_bits_decode_to_the_four_masks_and_outputs_choose_bands(tiny_ensemble, scene_dir, tmp_path, monkeypatch):
    """CPU. Would catch: bits in the wrong order (Fish must be bit 0), no-data not 255, a mask
    dropped, or --outputs writing other bands than asked, in another order."""
    checkpoint, _ = tiny_ensemble
    full, _ = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "full")
    bits, (_, names) = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "bits", "--outputs", "classbits")
    assert bits.shape == (1, 150, 230) and names[0].startswith("class bits (Fish 1, Flower 2")
    masks, valid = full[4:], full[4] != 255
    assert (bits[0][~valid] == 255).all() and not (bits[0][valid] > 15).any()
    for k in range(4):
        assert np.array_equal((bits[0][valid] >> k) & 1, masks[k][valid])
    assert masks[:, valid].any() and not masks[:, valid].all()  # the masks have both values: the check can fail
    chosen, _ = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "chosen", "--outputs", "masks,probs")
    assert np.array_equal(chosen, np.concatenate([full[4:], full[:4]]))


def test_cog_is_a_cloud_optimized_geotiff_with_the_same_bands(tiny_ensemble, tmp_path, monkeypatch):
    """CPU. Would catch: --cog ignored (a striped GeoTIFF has no COG layout, 16-row blocks and no
    overviews), overviews that average masks and no-data into other values, or pixels changed."""
    checkpoint, _ = tiny_ensemble
    image = smooth_scene(600, 1100)
    image[:100, :300] = 0
    (tmp_path / "in").mkdir()
    write_geotiff(tmp_path / "in" / "scene.tif", image)
    plain, _ = mapped(monkeypatch, checkpoint, tmp_path / "in", tmp_path / "plain", "--outputs", "classbits")
    bits, _ = mapped(monkeypatch, checkpoint, tmp_path / "in", tmp_path / "cog", "--outputs", "classbits",
                           "--cog", "--compress", "deflate")  # not the default: --compress reaches the COG
    assert np.array_equal(bits, plain)
    with rasterio.open(tmp_path / "cog" / "scene.tif") as cog:
        assert cog.tags(ns="IMAGE_STRUCTURE")["LAYOUT"] == "COG" and cog.compression.name.lower() == "deflate"
        assert cog.block_shapes[0] == (512, 512) and cog.overviews(1) == [2, 4]  # until under a block
        overview = cog.read(1, out_shape=(300, 550))
    assert set(np.unique(overview)) <= set(np.unique(plain))  # nearest neighbour: no new values
    assert not list((tmp_path / "cog").glob(".*"))  # no file of strips left behind


def refused_before_any_work(monkeypatch, checkpoint, scenes, out, capsys, option: list, named: str) -> None:
    """`cloudseg segment` with `option` exits 2 with one line, "cloudseg: error: " then `named`,
    before `out` is made."""
    assert run_segment(monkeypatch, pixelwise, scenes, "--checkpoint", checkpoint, "--out", out, *option) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"cloudseg: error: {named}") and "\n" not in error
    assert not out.exists()


@pytest.fixture
def file_size_limit():
    """Sets this process's file-size limit (RLIMIT_FSIZE) until the test ends: a write past it fails
    as on a full disk (EFBIG; Python ignores the SIGXFSZ that comes with it)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield lambda size: resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def bare_scene(tmp_path, height=150, width=230):
    """A scene of only the five fields geotiff_writer reads, and the path of its map in `tmp_path`."""
    scene = geo.GeoTiffScene.__new__(geo.GeoTiffScene)
    scene.height, scene.width = height, width
    scene.crs, scene.transform, scene.gcps = "EPSG:4326", rasterio.Affine(0.1, 0, 0, 0, -0.1, 0), ([], None)
    return scene, tmp_path / "map.tif"


@pytest.mark.parametrize("cog", [False, True], ids=["strips", "cog"])
def test_a_geotiff_cut_short_is_refused_naming_its_map(tmp_path, cog):
    """CPU. geo.check_whole against the file geo.geotiff_writer wrote, whole and cut short at
    several places. Would catch: a check that only opens the file (a file cut after its header
    opens: only its blocks' places tell), one of the first band or the last block alone, or an
    error that names the temporary file, not the map."""
    scene, written = bare_scene(tmp_path)
    with geo.geotiff_writer(written, scene, cog=cog) as out:
        geo.write_geotiff_rows(out, 0, np.concatenate([smooth_scene(150, 230, seed).transpose(2, 0, 1)
                                                       for seed in range(3)])[:8])
    geo.check_whole(written, written)  # whole
    data = written.read_bytes()
    for cut in (0.2, 0.5, 0.8, 0.99):
        (tmp_path / ".map.tif.tmp").write_bytes(data[:int(len(data) * cut)])
        with pytest.raises(OSError, match=r"^out/map\.tif: GDAL did not write the map whole \((band|it does not)"):
            geo.check_whole(tmp_path / ".map.tif.tmp", Path("out/map.tif"))


@pytest.mark.parametrize(("codec", "named"), [("zstd", "the map could not be written whole ([Errno 27] File too large)"),
                                              ("deflate", "GDAL did not write the map whole"),
                                              ("none", "GDAL could not write the map (TIFFAppendToStrip:")])
def test_a_map_that_could_not_be_written_whole_fails_its_scene_and_is_not_published(
        tiny_ensemble, scene_dir, tmp_path, monkeypatch, capsys, file_size_limit, codec, named):
    """CPU, a file-size limit as a full disk. GDAL (LERC) writes a compressed map's blocks and
    header when it closes it, and rasterio raises none of their errors there: the map was renamed
    into place cut short, with its NAME.json, so a rerun skipped it. Uncompressed, rasterio raises
    while writing, naming no file nor the cause (libtiff's error, under it, has no errno); our
    strips (ZSTD) fail in the spool's write, with an error that names no file. Would catch: a map
    published without geo.check_whole, that check's error lost, or the write's error not naming
    the map and what to look at."""
    checkpoint, _ = tiny_ensemble
    mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "whole", "--compress", codec)
    file_size_limit((tmp_path / "whole" / "scene.tif").stat().st_size // 2)
    assert run_segment(monkeypatch, pixelwise, scene_dir, "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--tile", 64, 96, "--postprocess", "none", "--compress", codec) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cloudseg")]
    assert len(errors) == 1 and errors[0].startswith(f"cloudseg segment: {scene_dir / 'scene.tif'}: ")
    assert f"{tmp_path / 'out' / 'scene.tif'}: {named}" in errors[0] and errors[0].endswith("is the disk full?")
    assert list((tmp_path / "out").iterdir()) == []  # no map, no NAME.json, no temporary file


def test_a_rerun_asking_for_another_map_format_maps_the_scene_again(tiny_ensemble, scene_dir, tmp_path, monkeypatch,
                                                                    caplog):
    """CPU. Would catch: a scene taken as done whatever --outputs, --compress or --cog the rerun
    asks for (the old eight zstd bands kept under a call for one deflated band of class bits), a
    rerun with the same options mapping again, or a NAME.json from before the format was recorded
    no longer counting as done."""
    checkpoint, _ = tiny_ensemble
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    mapped(monkeypatch, checkpoint, scene_dir, out)
    assert "1 scenes, 0 done before" in caplog.text
    for options, codec, bands in ((["--outputs", "classbits"], "zstd", 1), (["--outputs", "classbits"], "zstd", 1),
                                  (["--outputs", "classbits", "--compress", "deflate"], "deflate", 1),
                                  (["--outputs", "classbits", "--compress", "deflate", "--cog"], "deflate", 1)):
        caplog.clear()
        written, (wrote, _) = mapped(monkeypatch, checkpoint, scene_dir, out, *options)
        assert (wrote, len(written)) == (codec, bands)
        again = options == ["--outputs", "classbits"] and "1 scenes, 1 done before" in caplog.text
        assert again or "1 scenes, 0 done before" in caplog.text, options
    record = json.loads((out / "scene.json").read_text())
    assert (record["outputs"], record["compress"], record["cog"]) == (["classbits"], "deflate", True)
    for key in ("outputs", "compress", "cog"):
        del record[key]
    (out / "scene.json").write_text(json.dumps(record))  # as written before the format was recorded
    caplog.clear()
    mapped(monkeypatch, checkpoint, scene_dir, out)
    assert "1 scenes, 1 done before" in caplog.text


def test_a_rerun_with_another_model_or_windows_maps_the_scene_again(tiny_ensemble, scene_dir, tmp_path, monkeypatch,
                                                                    caplog):
    """CPU. Calls in turn after the first: the same (done), a copy of the checkpoint elsewhere (done:
    the same model), the checkpoint trained on (another step: mapped again), the same (done), then
    another --tile, --overlap, threshold (an override) and TTA, each mapped again; NAME.json says
    with what. Would catch: a scene taken as done whatever model or windows made it (another model's
    maps kept among the new ones, and in fractions.csv), a model told by its file's path (a copy
    mapped again, a node seeing it elsewhere disagreeing), a rerun with all the same mapping again,
    or a NAME.json from before this (or one key of it) was recorded no longer counting as done."""
    checkpoint, _ = tiny_ensemble
    caplog.set_level(logging.INFO)
    out, copy = tmp_path / "out", tmp_path / "elsewhere" / "best.pt"
    copy.parent.mkdir()
    copy.write_bytes(Path(checkpoint).read_bytes())

    def done_before(model, *options, tile=(64, 96)):
        caplog.clear()
        assert run_segment(monkeypatch, pixelwise, scene_dir, *options, "--checkpoint", model, "--out", out,
                           "--tile", *tile, "--postprocess", "none") == 0
        return int(re.search(r"1 scenes, (\d) done before", caplog.text).group(1))

    assert [done_before(checkpoint), done_before(checkpoint), done_before(copy)] == [0, 1, 1]
    state = load_checkpoint(copy)
    save_checkpoint(copy, {**state, "step": state["step"] + 1})  # trained on
    assert [done_before(copy), done_before(copy), done_before(checkpoint)] == [0, 1, 0]
    assert [done_before(checkpoint, tile=(64, 64)), done_before(checkpoint, "--overlap", 0.5),
            done_before(checkpoint, "predict.threshold=0.3"), done_before(checkpoint, "predict.tta=hflip")] == [0] * 4
    record = json.loads((out / "scene.json").read_text())
    assert record["made_with"] == {"checkpoints": [fingerprint(state)], "tta": "hflip", "threshold": [0.5] * 4,
                                   "tile": [64, 96], "overlap": 0.25}
    del record["made_with"]["tta"]
    (out / "scene.json").write_text(json.dumps(record))  # as written before the TTA was recorded
    assert done_before(checkpoint, "predict.tta=hflip") == 1
    del record["made_with"]
    (out / "scene.json").write_text(json.dumps(record))  # before anything of the model was recorded
    assert done_before(checkpoint, "predict.tta=hflip") == 1


@pytest.mark.parametrize("killed", [False, True])
def test_a_rerun_stopped_before_its_record_leaves_the_scene_to_map_again(tiny_ensemble, scene_dir, tmp_path,
                                                                        monkeypatch, caplog, killed):
    """CPU. A scene mapped, then mapped again with another --overlap whose NAME.json cannot be
    written (a full disk), its cleanup run or, as for a killed process, not run; then the first
    options again. Would catch: the first call's NAME.json left in place while the maps it describes
    are replaced (by the second call's, where it was killed: the third call then takes the scene as
    done and keeps them) or removed (where it failed: the third call keeps no map at all)."""
    checkpoint, _ = tiny_ensemble
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"

    def status_and_done_before(*options):
        caplog.clear()
        status = segmented(monkeypatch, checkpoint, scene_dir, out, *options)
        return status, re.search(r"1 scenes, (\d) done before", caplog.text).group(1)

    assert status_and_done_before() == (0, "0")
    first = (out / "scene.tif").read_bytes()
    real_atomic_path = segment_module.atomic_path

    def full_disk_for_records(path):
        if Path(path).suffix == ".json":
            raise OSError(28, "No space left on device", str(path))
        return real_atomic_path(path)

    with monkeypatch.context() as patched:
        patched.setattr(segment_module, "atomic_path", full_disk_for_records)
        if killed:  # a killed process removes nothing it published
            patched.setattr(segment_module, "published_together", lambda: contextlib.nullcontext([]))
        assert status_and_done_before("--overlap", 0.5) == (1, "0")
    assert not (out / "scene.json").exists()
    assert (out / "scene.tif").exists() == killed and (not killed or (out / "scene.tif").read_bytes() != first)
    assert status_and_done_before() == (0, "0")  # mapped again, as the first time
    assert (out / "scene.tif").read_bytes() == first
    assert json.loads((out / "scene.json").read_text())["made_with"]["overlap"] == 0.25


@pytest.mark.parametrize("failing", ["last rows", "removing the record"])
def test_a_rerun_that_fails_before_its_map_replaces_the_old_keeps_the_old_map_and_record(
        tiny_ensemble, scene_dir, tmp_path, monkeypatch, failing):
    """CPU, a scene mapped, then mapped again with another --overlap whose finish fails before its
    map is renamed into place: its last rows found missing, or the old NAME.json not removable.
    Would catch: the old NAME.json removed before the new map was known whole (the old map,
    still there, left without its record and out of fractions.csv), or, where its removal fails,
    the new map's temporary left in --out (the writer never closed)."""
    checkpoint, _ = tiny_ensemble
    out = tmp_path / "out"
    assert segmented(monkeypatch, checkpoint, scene_dir, out) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def fails(*args):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        if failing == "last rows":
            patched.setattr(geo.WholeStrips, "check_complete", lambda strips: fails())
        else:
            patched.setattr(segment_module, "remove", fails)
        assert segmented(monkeypatch, checkpoint, scene_dir, out, "--overlap", 0.5) == 1
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.name != "fractions.csv"} == {
        name: data for name, data in before.items() if name != "fractions.csv"}


def test_a_killed_run_s_temporaries_of_a_scene_go_when_it_is_mapped_again(tiny_ensemble, scene_dir, tmp_path,
                                                                          monkeypatch):
    """CPU, the hidden temporaries a SIGKILL leaves (files.new_hidden_file's names) beside a
    scene's map and NAME.json, and others' beside them; then one beside the map of a scene done
    (a call with other options killed, its NAME.json still the first's). Would catch: a killed
    run's temporaries left for good (a map's size each: nothing else removes them), those of a
    scene counted as done kept, or another scene's (sceneb.tif, maybe being written by another
    process), a name that only starts like one, or a file of the user's removed."""
    checkpoint, _ = tiny_ensemble
    out = tmp_path / "out"
    out.mkdir()
    killed = [".scene.tif.0123456789abcdef.tmp", ".scene.json.fedcba9876543210.tmp"]
    others = [".sceneb.tif.0123456789abcdef.tmp", ".scene.tif.x_masks.png.0123456789abcdef.tmp",
              ".scene.tif.notes.tmp", "scene.tif.0123456789abcdef.tmp"]
    for name in killed + others:
        (out / name).write_bytes(b"half a map")
    assert run_segment(monkeypatch, pixelwise, scene_dir, "--checkpoint", checkpoint, "--out", out,
                       "--tile", 64, 96) == 0
    assert sorted(path.name for path in out.iterdir()) == sorted(others + ["fractions.csv", "scene.json", "scene.tif"])
    (out / killed[0]).write_bytes(b"half a map")
    assert run_segment(monkeypatch, pixelwise, scene_dir, "--checkpoint", checkpoint, "--out", out,
                       "--tile", 64, 96) == 0  # done: not mapped again
    assert not (out / killed[0]).exists()


@pytest.mark.parametrize("seed", range(4))
def test_whole_strips_write_every_row_once_in_whole_strips(monkeypatch, seed):
    """CPU. Would catch: releases written as they come (a strip written in part), held rows lost or
    written twice, rows of a strip held as a view of the caller's array (the caller overwrites it
    after each call here), or the scene's last, shorter strip held back."""
    strip, height = geo.OUTPUT_STRIP_ROWS, 150  # 150 = 2 strips of 64 and 22 rows
    rows = np.random.default_rng(seed).integers(0, 256, (2, height, 7), dtype=np.uint8)
    cuts = np.sort(np.random.default_rng(seed + 100).choice(np.arange(1, height), 9, replace=False))
    written = []
    monkeypatch.setattr(geo, "write_geotiff_rows", lambda out, top, bands: written.append((top, bands.copy())))
    strips = geo.WholeStrips(None, height)
    for top, end in zip([0, *cuts], [*cuts, height]):
        released = rows[:, top:end].copy()
        strips.write(top, released)
        released[:] = 0  # the caller's buffer, reused
    strips.check_complete()
    assert all(top % strip == 0 for top, _ in written)
    assert all(bands.shape[1] % strip == 0 or top + bands.shape[1] == height for top, bands in written)
    assert [top for top, _ in written] == sorted({top for top, _ in written})  # in order, each once
    assert np.array_equal(np.concatenate([bands for _, bands in written], axis=1), rows)


def test_whole_strips_refuse_rows_out_of_order_and_tell_rows_never_written(monkeypatch):
    """CPU. Would catch: rows accepted out of order (a map with rows shifted), or a file finished
    though its last rows never came (held, or never released)."""
    strip = geo.OUTPUT_STRIP_ROWS
    monkeypatch.setattr(geo, "write_geotiff_rows", lambda out, top, bands: None)
    strips = geo.WholeStrips(None, 2 * strip + 8)
    strips.write(0, np.zeros((1, strip + 4, 3), np.uint8))
    with pytest.raises(ValueError, match=f"rows from {strip + 8}: expected row {strip + 4}"):
        strips.write(strip + 8, np.zeros((1, 16, 3), np.uint8))
    with pytest.raises(RuntimeError, match=f"rows {strip} to {2 * strip + 8} of the output were never written"):
        strips.check_complete()


def test_compressed_strips_wait_while_their_threads_are_behind_and_lay_out_every_strip(tmp_path, monkeypatch):
    """CPU. geo.CompressedStrips with slow compression (20 ms a strip, 3 threads) and room for 16
    strips of rows pending (four tasks of four bands' strips; the 32 strips of the map do not
    fit). Would catch: a writer that never waits (the rows of a whole map held for threads far
    behind), strips compressed in the writer's thread alone, strips laid out out of place (the file
    read back must equal the bands), or a spool left beside the map."""
    scene, path = bare_scene(tmp_path, height=8 * geo.OUTPUT_STRIP_ROWS)
    strip_bytes = geo.OUTPUT_STRIP_ROWS * scene.width
    monkeypatch.setattr(geo, "PENDING_BYTES", 16 * strip_bytes)
    monkeypatch.setattr(geo, "WRITE_THREADS", 3)
    threads, compressed, zstd = set(), [], geo.STRIP_ENCODERS["zstd"]

    def slow(strip):
        threads.add(threading.get_ident())
        time.sleep(0.02)
        compressed.append(strip.nbytes)
        return zstd(strip)

    monkeypatch.setitem(geo.STRIP_ENCODERS, "zstd", slow)
    bands = np.random.default_rng(0).integers(0, 255, (4, scene.height, scene.width), dtype=np.uint8)
    pending = []
    with geo.geotiff_writer(path, scene, ("probs",), "zstd") as out:
        for top in range(0, scene.height, geo.OUTPUT_STRIP_ROWS):  # whole strips, as WholeStrips hands them
            out.write(top, bands[:, top:top + geo.OUTPUT_STRIP_ROWS])
            handed = bands[:, :top + geo.OUTPUT_STRIP_ROWS].nbytes
            pending.append(handed - sum(compressed))  # rows handed to the threads and not yet compressed
    assert max(pending) <= 16 * strip_bytes and max(pending) > 0  # waited for the threads, which were behind
    assert len(threads) > 1 and threading.get_ident() not in threads
    assert [file.name for file in tmp_path.iterdir()] == ["map.tif"]
    with rasterio.open(path) as written:
        assert written.compression.name.lower() == "zstd" and np.array_equal(written.read(), bands)
        assert written.block_shapes[0] == (geo.OUTPUT_STRIP_ROWS, scene.width)


def test_compressed_strips_keep_a_task_for_each_thread_however_small_the_backlog(tmp_path, monkeypatch):
    """CPU. geo.CompressedStrips with a backlog of one byte, 3 threads and slow compression, rows
    handed one strip at a time: each thread still gets a task (every band's strip at a row) while
    the writer hands over the next rows, and no more are held. Would catch: the writer waiting for
    every task before the next (one thread at work: the threads idle while it fetches rows, which
    the coarse tasks of every band's strip would cause under a backlog in bytes alone), or a
    backlog that holds more than a task a thread."""
    scene, path = bare_scene(tmp_path, height=8 * geo.OUTPUT_STRIP_ROWS)
    task_bytes = 4 * geo.OUTPUT_STRIP_ROWS * scene.width  # four bands' strips
    monkeypatch.setattr(geo, "PENDING_BYTES", 1)
    monkeypatch.setattr(geo, "WRITE_THREADS", 3)
    running, most, lock, zstd = [0], [0], threading.Lock(), geo.STRIP_ENCODERS["zstd"]

    def slow(strip):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.005)
        with lock:
            running[0] -= 1
        return zstd(strip)

    monkeypatch.setitem(geo.STRIP_ENCODERS, "zstd", slow)
    bands = np.random.default_rng(1).integers(0, 255, (4, scene.height, scene.width), dtype=np.uint8)
    with geo.CompressedStrips(path, bands.shape, "zstd") as strips:
        held = []
        for top in range(0, scene.height, geo.OUTPUT_STRIP_ROWS):
            strips.write(top, bands[:, top:top + geo.OUTPUT_STRIP_ROWS])
            held.append(strips.pending_bytes)
    assert most[0] == 3 and max(held) <= 3 * task_bytes
    with rasterio.open(path) as written:
        assert np.array_equal(written.read(), bands)


def test_compressed_strips_refuse_rows_off_their_strips_and_name_the_rows_never_written(tmp_path):
    """CPU. Would catch: rows off a strip's first row compressed as a strip (a map with rows
    shifted), a strip cut short inside the map, or a map laid out with strips missing (tifffile
    would stop at a missing key with a bare KeyError, or write a map with rows never given)."""
    strip = geo.OUTPUT_STRIP_ROWS
    scene, path = bare_scene(tmp_path, height=2 * strip + strip // 2)
    rows = np.zeros((1, strip, scene.width), np.uint8)
    with pytest.raises(ValueError, match=rf"map\.tif: rows 8 to {strip + 8} of {scene.height} are no whole strips"):
        with geo.geotiff_writer(path, scene, ("classbits",)) as out:
            out.write(8, rows)
    with pytest.raises(ValueError, match=rf"rows 0 to 10 of {scene.height} are no whole strips"):
        with geo.geotiff_writer(path, scene, ("classbits",)) as out:
            out.write(0, rows[:, :10])
    with pytest.raises(RuntimeError, match=rf"map\.tif: band 1's rows from {strip} were never written"):
        with geo.geotiff_writer(path, scene, ("classbits",)) as out:
            out.write(0, rows)
            out.write(2 * strip, rows[:, :strip // 2])  # the last strip, shorter
    assert list(tmp_path.iterdir()) == []  # neither the map nor its temporary file


def test_compressed_strips_name_the_map_when_a_strip_fails_and_leave_no_thread_or_file(tmp_path, monkeypatch):
    """CPU. Would catch: a compression thread's error (a MemoryError) raised bare, naming no map,
    or the pool's threads and the spool left behind after it."""
    scene, path = bare_scene(tmp_path)

    def failing(strip):
        raise MemoryError("no room for a strip")

    monkeypatch.setitem(geo.STRIP_ENCODERS, "zstd", failing)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match=r"map\.tif: a strip could not be compressed \(MemoryError"):
        with geo.geotiff_writer(path, scene, ("classbits",)) as out:
            geo.write_geotiff_rows(out, 0, np.zeros((1, scene.height, scene.width), np.uint8))
    assert out.closed and out.spool.closed and threading.active_count() == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bigtiff", [False, True])
def test_a_map_whose_compressed_strips_outgrow_classic_tiff_is_a_bigtiff(tmp_path, monkeypatch, bigtiff):
    """CPU, the classic TIFF's limit lowered to 0 bytes for the BigTIFF case. Would catch: the
    layout left to tifffile, which counts an iterator of compressed strips as no data and writes
    a classic TIFF whose 32-bit offsets fail past 4 GB (a struct.error at the very end of a map)."""
    if bigtiff:
        monkeypatch.setattr(geo, "CLASSIC_TIFF_BYTES", 0)
    scene, path = bare_scene(tmp_path)
    bands = np.random.default_rng(1).integers(0, 255, (8, scene.height, scene.width), dtype=np.uint8)
    with geo.geotiff_writer(path, scene) as out:
        geo.write_geotiff_rows(out, 0, bands)
    assert path.read_bytes()[2:4] == (b"\x2b\x00" if bigtiff else b"\x2a\x00")  # TIFF 43: BigTIFF; 42: classic
    with rasterio.open(path) as written:
        assert np.array_equal(written.read(), bands) and written.crs.to_epsg() == 4326


@pytest.mark.parametrize("compress", ["zstd", "deflate", "lerc", "none"])
def test_four_bands_are_grey_and_undefined_not_rgba_in_every_codec(tmp_path, compress):
    """CPU. Would catch: GDAL's default for four uint8 bands (RGBA: viewers would draw the fourth
    probability, Sugar's, as transparency) in the codecs GDAL writes, against ours for ZSTD."""
    scene, path = bare_scene(tmp_path)
    with geo.geotiff_writer(path, scene, ("probs",), compress) as out:
        geo.write_geotiff_rows(out, 0, np.zeros((4, scene.height, scene.width), np.uint8))
    with rasterio.open(path) as written:
        assert [interp.name for interp in written.colorinterp] == ["gray", "undefined", "undefined", "undefined"]


def test_a_tiling_off_the_strips_maps_the_same_bands_as_writing_each_release(tiny_ensemble, scene_dir, tmp_path,
                                                                           monkeypatch):
    """CPU. Windows 60x90 at overlap 0.25 release rows from 45, 90, ... (no multiple of the 16-row
    strips). Would catch: rows held for a strip written out of place or never, against the bands
    of each release written as it comes."""
    checkpoint, _ = tiny_ensemble
    tops = []
    write = geo.write_geotiff_rows
    monkeypatch.setattr(geo, "write_geotiff_rows", lambda out, top, bands: (tops.append(top), write(out, top, bands)))
    whole, _ = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "whole", "--tile", 60, 90)
    assert tops and all(top % geo.OUTPUT_STRIP_ROWS == 0 for top in tops)
    monkeypatch.setattr(geo.WholeStrips, "write", lambda strips, top, bands: geo.write_geotiff_rows(strips.out, top,
                                                                                                      bands))
    monkeypatch.setattr(geo.WholeStrips, "check_complete", lambda strips: None)
    tops.clear()  # GDAL's writer (uncompressed) takes rows off the strips; ours refuses them
    each, _ = mapped(monkeypatch, checkpoint, scene_dir, tmp_path / "each", "--tile", 60, 90, "--compress", "none")
    assert any(top % geo.OUTPUT_STRIP_ROWS for top in tops)  # the releases were off the strips
    assert np.array_equal(whole, each)


def test_bad_outputs_or_codec_is_one_line_naming_the_option(tiny_ensemble, scene_dir, tmp_path, monkeypatch, capsys):
    """CPU. Would catch: an unknown output or codec silently ignored (GDAL only warns and writes
    uncompressed; a codec this GDAL cannot write left untried for GeoTIFF scenes), a traceback, or
    work done before the error."""
    checkpoint, _ = tiny_ensemble
    for option, value in (("--outputs", "probs,clouds"), ("--outputs", "masks,masks"), ("--compress", "jpeg2000")):
        refused_before_any_work(monkeypatch, checkpoint, scene_dir, tmp_path / "out", capsys, [option, value],
                                f"{option} {value}: ")
    monkeypatch.setitem(geo.CODECS, "lerc", dict(compress="webp"))  # a codec this GDAL cannot put in a GeoTIFF
    geo.check_codec.cache_clear()
    cv2.imwrite(str(scene_dir / "a.jpg"), smooth_scene(40, 60))  # first of the folder's scenes, not a GeoTIFF
    assert run_segment(monkeypatch, pixelwise, scene_dir, "--checkpoint", checkpoint, "--out", tmp_path / "out",
                       "--compress", "lerc") == 2  # a GeoTIFF among the scenes: the codec tried before any is mapped
    assert re.search(r"cloudseg: error: --compress lerc: this GDAL .* cannot write it", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    # the default unwritable: a user who never passed --compress is told it is the default, and what else
    monkeypatch.setitem(geo.CODECS, geo.DEFAULT_CODEC, dict(compress="webp"))
    geo.check_codec.cache_clear()
    with pytest.raises(ValueError, match=rf"--compress {geo.DEFAULT_CODEC} \(the default\): this GDAL .* "
                                         r"cannot write it .*; choose another of .*deflate"):
        geo.check_codec(geo.DEFAULT_CODEC)
    geo.check_codec.cache_clear()


@pytest.mark.parametrize("library", ["zstandard", "tifffile"])
def test_a_missing_library_of_our_writer_is_one_line_before_any_work(tiny_ensemble, scene_dir, tmp_path, monkeypatch,
                                                                      capsys, library):
    """CPU, the library hidden from imports. Would catch: a missing python-zstandard or tifffile
    found only once a scene's first strip is compressed or its map laid out (a scene failed after
    its mapping, with a bare ImportError from a worker thread), instead of the geo extra named."""
    checkpoint, _ = tiny_ensemble
    monkeypatch.setitem(sys.modules, library, None)  # import raises ImportError
    geo.check_codec.cache_clear()
    try:
        assert run_segment(monkeypatch, pixelwise, scene_dir, "--checkpoint", checkpoint, "--out", tmp_path / "out") == 2
    finally:
        geo.check_codec.cache_clear()
    error = capsys.readouterr().err.strip()
    assert error == (f"cloudseg: error: {library} is not installed: GeoTIFF scenes and --grid need the geo extra "
                     "(pip install cloudseg[geo])")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", [["--grid", "0"], ["--grid", "-1"], ["--grid", "nan"], ["--grid", "181"],
                                    ["--tile", "0", "0"], ["--tile", "-5", "96"], ["--overlap", "-0.1"],
                                    ["--overlap", "0.95"], ["--overlap", "nan"]])
def test_a_grid_tile_or_overlap_out_of_range_is_refused_before_any_work(tiny_ensemble, scene_dir, tmp_path, monkeypatch,
                                                                   capsys, option):
    """CPU. Would catch: --grid 0 taken as no grid (no grid.nc, no word), a negative or NaN cell
    (cells of garbage, or NaN != NaN making no scene ever done), a window of no pixels (OpenCV's
    assertion stopping the run) or of negative ones (every scene failing) accepted; an overlap below
    0 (gaps between windows: every scene failing), NaN, or so near 1 that the windows' list alone
    takes gigabytes (0.999: 44 million windows in a 7000×18000 scene) accepted."""
    checkpoint, _ = tiny_ensemble
    refused_before_any_work(monkeypatch, checkpoint, scene_dir, tmp_path / "out", capsys, option, f"{option[0]} ")


@pytest.mark.parametrize("pattern", ["(", r"(?P<y>\d{8})", r"(?P<year>\d{4})(?P<month>\d{2})",
                                     r"(?P<year>\d{4})(?P<doy>\d{3})(?P<band>\w)"])
def test_a_time_pattern_scene_time_cannot_read_is_refused_before_any_work(tiny_ensemble, scene_dir, tmp_path,
                                                                          monkeypatch, capsys, pattern):
    """CPU. Would catch: a pattern checked only at the first scene's time (the model loaded and a
    scene failed first: a KeyError's bare `year`, or re.error's traceback), a group missing or one
    scene_time cannot read (int() of a band letter) let through."""
    checkpoint, _ = tiny_ensemble
    refused_before_any_work(monkeypatch, checkpoint, scene_dir, tmp_path / "out", capsys, ["--time-pattern", pattern],
                            f"--time-pattern {pattern}: ")
    for readable in (geo.TIME_PATTERN, r"A(?P<year>\d{4})(?P<doy>\d{3})",
                     r"(?P<year>\d{4})(?P<month>\d{2})(?P<day>\d{2})T(?P<hour>\d{2})(?P<minute>\d{2})"):
        geo.check_time_pattern(readable)


@pytest.mark.parametrize(("name", "pattern", "time"), [
    ("MOD_A2020366.tif", r"A(?P<year>\d{4})(?P<doy>\d{3})", "2020-12-31T00:00:00"),  # a leap year's last day
    ("MOD_A2021366.tif", r"A(?P<year>\d{4})(?P<doy>\d{3})", None),  # 2021 has 365
    ("MOD_A2021000.tif", r"A(?P<year>\d{4})(?P<doy>\d{3})", None),
    ("b_12345678.tif", geo.TIME_PATTERN, None),  # the default pattern finds a number that is no date
    ("c_2019-05-01.png", geo.TIME_PATTERN, "2019-05-01T00:00:00")])
def test_a_match_that_is_no_time_fails_its_scene_naming_the_match(name, pattern, time):
    """Would catch: a day of the year rolled into the next year (2021's day 366 as 2022-01-01) or
    the one before (day 0), and a bare datetime error that does not say which part of the name was
    read as a time, nor that --time-pattern says where it is."""
    if time:
        assert str(geo.scene_time(Path(name), {}, pattern)) == time
    else:
        match = re.search(pattern, name).group(0)
        with pytest.raises(ValueError, match=rf"^'{match}' in its name is not a time \(.*\): .*--time-pattern$"):
            geo.scene_time(Path(name), {}, pattern)


def test_the_stage_line_adds_up_and_names_the_planted_slow_stage(tiny_ensemble, scene_dir, tmp_path, monkeypatch):
    """CPU. Would catch: a stage never timed (0 s), time counted twice or under another stage (the
    planted sleeps must land in their own stage, not beyond the wall time), or "bound by" naming
    anything but the slowest stage."""
    checkpoint, ensemble = tiny_ensemble
    ensemble = ensemble._replace(forwards=[pixelwise])
    scenes = [scene_dir / "scene.tif"]
    options = segment_module.SegmentOptions((64, 96), 0.25)
    write, writes = geo.write_geotiff_rows, []
    monkeypatch.setattr(geo, "write_geotiff_rows", lambda *a: (writes.append(time.sleep(0.1)), write(*a)))
    clock, start = StageClock(), time.perf_counter()
    assert segment_module.segment_scenes(scenes, ensemble, tmp_path / "a", options, clock=clock) == 0
    wall = time.perf_counter() - start
    assert len(writes) >= 150 // geo.OUTPUT_STRIP_ROWS  # the whole strips written
    assert clock.bound_by() == "write" and len(writes) * 0.1 <= clock.seconds["write"] < wall
    assert all(clock.seconds[stage] > 0 for stage in ("read", "to device", "model", "blend", "encode"))
    assert clock.seconds["wait for writes"] > 0.05  # the main thread waited on the slow writer
    monkeypatch.setattr(geo, "write_geotiff_rows", write)
    slow = ensemble._replace(forwards=[lambda images: (time.sleep(0.2), pixelwise(images))[1]])
    clock = StageClock()
    assert segment_module.segment_scenes(scenes, slow, tmp_path / "b", options, clock=clock) == 0
    assert clock.bound_by() == "model" and clock.seconds["model"] >= 0.2
    assert clock.line().endswith("— bound by: model") and clock.line().startswith("stages: read ")


def test_the_bound_is_the_stage_whose_busiest_thread_spent_the_most():
    """CPU. Would catch: the bound judged by seconds summed over threads: four readers of 0.6 s
    each (2.4 s summed) named over one writer busy 2.0 s, which the main thread waited for."""
    clock, together = StageClock(), threading.Barrier(4)  # alive at once: no thread's ident reused by the next

    def read():
        clock.add("read", 0.6)
        together.wait()

    readers = [threading.Thread(target=read) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    clock.add("write", 2.0)
    assert clock.seconds["read"] == pytest.approx(2.4) and clock.bound_by() == "write"
    clock.add("read", 1.5)  # this thread: now 1.5 s of reads, with its 2.0 s of writes
    assert clock.bound_by() == "write"
    clock.add("read", 0.6)
    assert clock.bound_by() == "read"


def test_the_timeline_gives_each_stage_s_first_start_and_last_end():
    """CPU. Would catch: a stage's span taken from its summed seconds (write's would start at 0.00
    and end at 0.10, not 0.15), the start of a later call kept over the first one's, times not
    counted from the first read, or a run that timed only waits (every scene failed) crashing it."""
    clock = StageClock()
    clock.add("wait for writes", 0.1)  # a wait is no stage of the timeline
    assert clock.timeline() == "from the first read: nothing timed"
    with clock("model"):  # before the first read: a negative start
        time.sleep(0.05)
    with clock("read"):
        time.sleep(0.05)
    for _ in range(2):
        with clock("write"):
            time.sleep(0.05)
    spans = {stage: (float(first), float(last))
             for stage, first, last in re.findall(r"(\w[\w ]*?) (-?\d+\.\d\d) to (-?\d+\.\d\d)", clock.timeline())}
    assert list(spans) == ["read", "model", "write"]  # the data's order
    assert spans["read"][0] == 0 and spans["read"][1] == pytest.approx(0.05, abs=0.02)
    assert spans["model"][0] == pytest.approx(-0.05, abs=0.02) and spans["model"][1] <= 0.01
    assert spans["write"][0] == pytest.approx(0.05, abs=0.02) and spans["write"][1] == pytest.approx(0.15, abs=0.03)


def test_the_timeline_counts_the_cores_busy_from_the_first_stage_to_the_last():
    """CPU. A stage asleep for 0.2 s, 0.2 s with no stage, then one busy for 0.2 CPU s in another
    thread: about 0.2 CPU s in 0.6 s or more, a third of a core at most (a wait before, not a
    stage, counts for neither). Would catch: the wall taken from the stages' summed seconds (0.4 s)
    or from the first stage's end, the CPU seconds of the calling thread alone (none) or of the
    whole run (the wait's spin), and the waits counted."""
    clock = StageClock()
    with clock("wait for reads"):
        busy(0.2)
    with clock("read"):
        time.sleep(0.2)
    time.sleep(0.2)
    writer = threading.Thread(target=timed_busy, args=(clock, "write", 0.2))
    writer.start()
    writer.join()
    cores, cpu, wall = map(float, re.search(r"; (\d+\.\d) cores busy \((\d+\.\d) CPU s in (\d+\.\d\d) s\)$",
                                            clock.timeline()).groups())
    assert cpu == pytest.approx(0.2, abs=0.05) and wall >= 0.59 and cores <= 0.4
    assert StageClock().cores() == ""


def timed_busy(clock: StageClock, stage: str, cpu_seconds: float) -> None:
    with clock(stage):
        busy(cpu_seconds)


def busy(cpu_seconds: float) -> None:
    """Spin in this thread for `cpu_seconds` of the process's CPU time."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def test_the_stage_line_reads_as_documented():
    """CPU. Would catch: stages out of the data's order, waits counted as a bound, or an unknown stage
    taken silently (a typo would time nothing)."""
    clock = StageClock()
    for stage, seconds in (("write", 2.1), ("model", 3.4), ("read", 1.2), ("wait for reads", 9.0), ("blend", 0.8)):
        clock.add(stage, seconds)
    assert clock.line() == ("stages: read 1.2 s · to device 0.0 · model 3.4 · blend 0.8 · encode 0.0 · write 2.1 "
                            "(waits: for reads 9.0, for writes 0.0) — bound by: model")
    assert "GPU wait, to host, encode 0.0" in clock.line(gpu=True)
    with pytest.raises(KeyError, match="'modle' is not a stage"):
        clock.add("modle", 1.0)
