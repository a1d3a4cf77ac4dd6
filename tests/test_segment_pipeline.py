"""`cloudseg segment` across scenes (issue #38, item 2): a scene is finished (its last blocks
compressed, NAME.json written) in the writer's thread while the next scene is read and mapped,
and each scene's errors stay its own. CPU, small GeoTIFF scenes, a model that costs nothing."""

import json
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from cloudseg import geo
from cloudseg import segment as segment_module
from cloudseg.files import atomic_path
from cloudseg.stages import StageClock
from tests.test_segment import pixelwise, smooth_scene, stand_in, tiny_ensemble, write_geotiff  # noqa: F401

rasterio = pytest.importorskip("rasterio")

OPTIONS = segment_module.SegmentOptions((64, 96), 0.25)


@pytest.fixture(autouse=True)
def small_strips(monkeypatch):
    """Output strips of 16 rows, as these tests' scenes were sized for (20 strips of a 320-row map,
    5 of segment's 64): a failed write shows before the reads ahead are done with the scene."""
    monkeypatch.setattr(geo, "OUTPUT_STRIP_ROWS", 16)


@pytest.fixture
def scenes(tmp_path):
    """Three 320×230 GeoTIFF scenes, a.tif, b.tif and c.tif (7 rows of windows each)."""
    (tmp_path / "in").mkdir()
    return [write_geotiff(tmp_path / "in" / f"{name}.tif", smooth_scene(320, 230, seed))
            for seed, name in enumerate("abc")]


@pytest.fixture(params=[1, 2], ids=["one file at a time", "two files at once"])
def files_at_once(request, monkeypatch):
    """segment.FILES_AT_ONCE for the test: its errors must stay each scene's own either way."""
    monkeypatch.setattr(segment_module, "FILES_AT_ONCE", request.param)
    return request.param


def within(seconds: float, function):
    """function() in a thread of its own, its result or error; a test failure, not a hung run, where
    it takes longer than `seconds` (a deadlock of the writer's queue)."""
    outcome = {}

    def run():
        try:
            outcome["result"] = function()
        except BaseException as error:  # noqa: BLE001 -- raised in the test's thread below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a deadlock?"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def counting(ensemble, calls: list):
    """The ensemble with the pixelwise model, each call's batch size appended to `calls`."""
    return ensemble._replace(forwards=[lambda images: calls.append(len(images)) or pixelwise(images)])


def test_the_next_scene_is_read_and_mapped_while_the_last_one_is_finished(tiny_ensemble, scenes, tmp_path,
                                                                          monkeypatch):
    """CPU. Would catch: a loop that finishes each scene (its file closed, NAME.json written)
    before it reads the next one: the next scene's first read would come after a's finish."""
    _, ensemble = tiny_ensemble
    events = []
    read = geo.GeoTiffScene.read

    def logged_read(scene, *box, **out):
        events.append(("read", scene.path.stem, time.perf_counter()))
        return read(scene, *box, **out)

    def slow_done_file(path):
        if path.name == "a.json":
            time.sleep(0.5)
            events.append(("finished", "a", time.perf_counter()))
        return atomic_path(path)

    monkeypatch.setattr(geo.GeoTiffScene, "read", logged_read)
    monkeypatch.setattr(segment_module, "atomic_path", slow_done_file)
    assert segment_module.segment_scenes(scenes[:2], counting(ensemble, []), tmp_path / "out", OPTIONS) == 0
    first_read_of_b = min(when for what, name, when in events if what == "read" and name == "b")
    finished_a = next(when for what, name, when in events if what == "finished")
    assert first_read_of_b < finished_a
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["a.json", "a.tif", "b.json", "b.tif",
                                                                          "fractions.csv"]


def test_a_band_is_encoded_in_pieces_while_the_model_makes_the_next_row_of_windows(tiny_ensemble, scenes, tmp_path,
                                                                                  monkeypatch):
    """CPU. The writer's thread encodes a band of final rows (a row of windows) in pieces of
    ENCODE_ROWS rows while the model goes on with the next row of windows: here the first band's
    second piece waits for the model's next call. Would catch: the mapping waiting for each piece
    in turn (the model idle while a band is encoded: that wait would time out), pieces taller than
    ENCODE_ROWS, rows encoded twice or never, or a map that depends on the pieces (compared with
    the same scene encoded a band at a time)."""
    _, ensemble = tiny_ensemble
    calls, pieces, went_on = [], [], []
    soon = geo.output_bands_soon

    def watched(probs, valid, thresholds):
        index, calls_then, bands_soon = len(pieces), len(calls), soon(probs, valid, thresholds)
        pieces.append(len(valid))

        def later():
            if index == 1:
                deadline = time.monotonic() + 10
                while len(calls) == calls_then and time.monotonic() < deadline:
                    time.sleep(0.005)
                went_on.append(len(calls) > calls_then)
            return bands_soon()
        return later

    monkeypatch.setattr(geo, "output_bands_soon", watched)
    monkeypatch.setattr(segment_module, "ENCODE_ROWS", 8)
    ensemble = counting(stand_in(pixelwise, ensemble.config, batch_size=2), calls)  # a model call between two bands
    assert segment_module.segment_scenes(scenes[:1], ensemble, tmp_path / "pieces", OPTIONS) == 0
    assert went_on == [True] and max(pieces) == 8 and sum(pieces) == 320
    monkeypatch.setattr(segment_module, "ENCODE_ROWS", 1000)
    first = len(pieces)
    assert segment_module.segment_scenes(scenes[:1], ensemble, tmp_path / "whole", OPTIONS) == 0
    assert len(pieces) - first == len(segment_module.tiling(320, 230, OPTIONS.tile, OPTIONS.overlap).tops)  # a band each
    assert sum(pieces[first:]) == 320
    with rasterio.open(tmp_path / "pieces" / "a.tif") as pieced, rasterio.open(tmp_path / "whole" / "a.tif") as whole:
        assert np.array_equal(pieced.read(), whole.read())


def test_two_files_at_once_write_the_same_maps_each_file_in_one_thread_in_order(tiny_ensemble, scenes, tmp_path,
                                                                                monkeypatch):
    """CPU. Would catch: FILES_AT_ONCE ignored (no two files' writes at the same time), a file's
    rows written from several threads or out of order, a queue that lets a third file start while
    two are unfinished, or maps and NAME.json other than one file at a time's."""
    _, ensemble = tiny_ensemble
    reference = tmp_path / "one"
    assert segment_module.segment_scenes(scenes, counting(ensemble, []), reference, OPTIONS) == 0
    writes, write = [], geo.write_geotiff_rows

    def slow_write(out, top, bands):
        start = time.perf_counter()
        time.sleep(0.02)
        write(out, top, bands)
        writes.append((Path(out.name).name.split(".")[1], top, threading.get_ident(), start, time.perf_counter()))

    monkeypatch.setattr(geo, "write_geotiff_rows", slow_write)
    monkeypatch.setattr(segment_module, "FILES_AT_ONCE", 2)
    assert within(120, lambda: segment_module.segment_scenes(scenes, counting(ensemble, []), tmp_path / "two",
                                                             OPTIONS)) == 0
    by_file = {name: [write for write in writes if write[0] == name] for name in "abc"}
    assert all(len({thread for _, _, thread, _, _ in rows}) == 1 for rows in by_file.values())
    assert all([top for _, top, *_ in rows] == sorted(top for _, top, *_ in rows) for rows in by_file.values())
    spans = {name: (rows[0][3], rows[-1][4]) for name, rows in by_file.items()}
    assert spans["b"][0] < spans["a"][1]  # b written while a still was
    assert spans["c"][0] >= min(spans["a"][1], spans["b"][1])  # c only once a or b was finished
    for path in sorted(reference.iterdir()):
        two = tmp_path / "two" / path.name
        if path.suffix == ".tif":
            with rasterio.open(path) as one_file, rasterio.open(two) as two_files:
                assert np.array_equal(one_file.read(), two_files.read())
        else:
            assert path.read_text() == two.read_text()


def test_the_rows_queued_for_the_files_stay_within_the_queue_bound(tiny_ensemble, scenes, tmp_path, monkeypatch):
    """CPU. Would catch: `Writer.reserve` never waiting (the encoded rows of whole scenes queued
    behind a slow disk), or bytes never released (the mapping stuck once the bound is reached)."""
    _, ensemble = tiny_ensemble
    bound = 3 * 8 * 32 * 230  # three releases of 32 rows of eight bands
    writer = segment_module.Writer(StageClock(), files=2, queue_bytes=bound)
    queued, write = [], geo.write_geotiff_rows

    def slow_write(out, top, bands):
        queued.append(writer.queued)
        time.sleep(0.03)
        write(out, top, bands)

    monkeypatch.setattr(geo, "write_geotiff_rows", slow_write)

    def map_all():
        with writer:
            return [segment_module.segment_scene(path, tmp_path / "out", counting(ensemble, []), OPTIONS,
                                                 writer.clock, writer) for path in scenes]

    finishes = within(120, map_all)
    assert all(finish.result()["height"] == 320 for finish in finishes)
    assert max(queued) <= bound and max(queued) >= 2 * 8 * 32 * 230  # the bound was reached, and held
    assert writer.queued == 0


def test_a_failed_write_fails_its_own_scene_stops_it_and_leaves_no_file(tiny_ensemble, scenes, tmp_path,
                                                                       monkeypatch, files_at_once, capsys):
    """CPU. Would catch: a write's error raised while the next scene is mapped (c blamed, or c
    not mapped), a temporary file left behind, or a scene mapped to its end though its output
    cannot be written (b's model calls as many as a's)."""
    _, ensemble = tiny_ensemble
    write = geo.write_geotiff_rows

    def failing_for_b(out, top, bands):
        if Path(out.name).name.startswith(".b.tif."):  # the dataset of b.tif's temporary file
            raise OSError(28, "No space left on device")
        return write(out, top, bands)

    calls, first_call = [], {}  # first_call: each scene's, by the model calls before its first read
    read = geo.GeoTiffScene.read

    def logged_read(scene, *box, **out):
        first_call.setdefault(scene.path.stem, len(calls))
        return read(scene, *box, **out)

    monkeypatch.setattr(geo.GeoTiffScene, "read", logged_read)
    monkeypatch.setattr(geo, "write_geotiff_rows", failing_for_b)
    clock = StageClock()
    assert segment_module.segment_scenes(scenes, counting(ensemble, calls), tmp_path / "out", OPTIONS,
                                         clock=clock) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"cloudseg segment: {scenes[1]}") and "No space left" in error[0]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["a.json", "a.tif", "c.json", "c.tif",
                                                                          "fractions.csv"]
    calls_a, calls_b = first_call["b"] - first_call["a"], first_call["c"] - first_call["b"]
    assert 0 < calls_b < calls_a


def test_a_failed_write_stops_the_mapping_before_the_next_row_of_windows(tiny_ensemble, scenes, tmp_path,
                                                                         monkeypatch):
    """CPU, one file at a time (its writes in the writer's thread), batches of two windows, three
    windows a row. The first band's write fails, slowly: the mapping stops as it hands over the second band
    (whose hand-over waited for the first), so the model made rows of windows 0 to 2 (batches 0 to
    3: window (2, 0) is the seventh), not one row more. Would catch: the failure noticed only at
    the band after (a row of windows read and predicted for nothing: 5 calls)."""
    _, ensemble = tiny_ensemble

    def failing(out, top, bands):
        time.sleep(0.3)  # slower than a row of windows: still writing when the second band comes
        raise OSError(28, "No space left on device")

    calls = []
    monkeypatch.setattr(geo, "write_geotiff_rows", failing)
    assert segment_module.segment_scenes(scenes[:1], counting(stand_in(pixelwise, ensemble.config, batch_size=2),
                                                              calls), tmp_path / "out", OPTIONS) == 1
    assert len(calls) == 4


def test_a_scene_stopped_by_a_failed_write_is_closed_only_after_its_reads_ahead(tiny_ensemble, scenes, tmp_path,
                                                                                 monkeypatch, files_at_once):
    """CPU. Would catch: the scene's GDAL handles closed while a read ahead (in the reader thread)
    still uses one, when a failed write stops the mapping early: a read of a closed dataset, which
    crashed a test worker (a segmentation fault) before the rows' generator was closed first."""
    _, ensemble = tiny_ensemble
    events, read, close, write = [], geo.GeoTiffScene.read, geo.GeoTiffScene.close, geo.write_geotiff_rows

    def slow_read(scene, *box, **out):
        if scene.path.stem == "b":
            events.append(("read", time.perf_counter()))
            time.sleep(0.05)
        return read(scene, *box, **out)

    def logged_close(scene):
        if scene.path.stem == "b":
            events.append(("close", time.perf_counter()))
        close(scene)

    def failing_for_b(out, top, bands):
        if Path(out.name).name.startswith(".b.tif."):
            raise OSError(28, "No space left on device")
        return write(out, top, bands)

    monkeypatch.setattr(segment_module, "READ_ROWS", 16)  # the scene in many strips: stopping early shows
    monkeypatch.setattr(geo.GeoTiffScene, "read", slow_read)
    monkeypatch.setattr(geo.GeoTiffScene, "close", logged_close)
    monkeypatch.setattr(geo, "write_geotiff_rows", failing_for_b)
    assert segment_module.segment_scenes(scenes[:2], counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    closed = next(when for what, when in events if what == "close")
    assert all(when + 0.05 <= closed for what, when in events if what == "read")  # each read done before
    with rasterio.open(scenes[1]) as scene:
        strips = segment_module.read_strips(scene.height, scene.block_shapes[0][0])
    assert sum(what == "read" for what, _ in events) < len(strips)  # stopped early


def gdal_error(message: str) -> Exception:
    """An error as GDAL raises it through rasterio: of rasterio's CPLE_* classes, none of them an
    OSError, ValueError or RuntimeError."""
    return pytest.importorskip("rasterio._err").CPLE_AppDefinedError(1, 1, message)


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), gdal_error("TIFFFlush failed")],
                         ids=["OSError", "GDAL's"])
def test_a_failed_finish_is_its_own_scene_s_error(tiny_ensemble, scenes, tmp_path, monkeypatch, files_at_once,
                                                  capsys, error):
    """CPU. Would catch: the error of a's finish (here its NAME.json) raised while b is mapped and
    reported as b's, or b then left unmapped, or, for an error of a class cloudseg does not raise
    itself (GDAL's), the whole call stopped there (b unmapped, no fractions.csv) or its class
    unsaid; a keeps no NAME.json, so a rerun maps it again, and its map, renamed into place before
    NAME.json failed, is removed again (nothing of a failed scene left in --out)."""
    _, ensemble = tiny_ensemble

    def failing_for_a(path):
        if path.name == "a.json":
            raise error
        return atomic_path(path)

    monkeypatch.setattr(segment_module, "atomic_path", failing_for_a)
    assert segment_module.segment_scenes(scenes[:2], counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    named = "" if isinstance(error, OSError) else f"{type(error).__name__}: "
    assert lines == [f"cloudseg segment: {scenes[0]}: {named}{error}"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["b.json", "b.tif", "fractions.csv"]
    assert not segment_module.is_done(tmp_path / "out", scenes[0], OPTIONS)


@pytest.mark.parametrize("error", [cv2.error("(-215:Assertion failed) in function 'resize'"), MemoryError()],
                         ids=["OpenCV's", "MemoryError"])
def test_a_scene_s_error_of_any_class_while_mapped_is_its_own(tiny_ensemble, scenes, tmp_path, monkeypatch, capsys,
                                                              error):
    """CPU, a's mapping stopped by an error of a class cloudseg does not raise itself. Would catch:
    the whole call stopped by it (b and c unmapped, no fractions.csv; under torchrun the other
    processes left waiting for this one's counts), a line that does not say which error it was,
    or no traceback under cloudseg --debug (a bug in segment told by one line alone)."""
    _, ensemble = tiny_ensemble
    real = segment_module.blended_rows

    def failing_for_a(scene, *args, **kwargs):
        if Path(scene.path).name == "a.tif":
            raise error
        return real(scene, *args, **kwargs)

    monkeypatch.setattr(segment_module, "blended_rows", failing_for_a)
    assert segment_module.segment_scenes(scenes, counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    line = f"cloudseg segment: {scenes[0]}: {type(error).__name__}" + (f": {error}" if str(error) else "")
    assert lines == [line]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["b.json", "b.tif", "c.json", "c.tif",
                                                                         "fractions.csv"]
    # cloudseg --debug: its traceback too, from where it was raised, then the same line
    assert segment_module.segment_scenes(scenes[:1], counting(ensemble, []), tmp_path / "again", OPTIONS,
                                         tracebacks=True) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "in failing_for_a" in "".join(lines) and lines[-1] == line


@pytest.mark.parametrize("failing", ["a_overlay.png", "a.json"])
def test_a_jpeg_scene_s_outputs_are_published_all_or_none(tiny_ensemble, tmp_path, monkeypatch, capsys, failing):
    """CPU, a JPEG scene then a PNG one. Would catch: a_masks.png left in --out when the overlay
    after it, or the NAME.json after both, fails; or the error blamed on the next scene."""
    _, ensemble = tiny_ensemble
    (tmp_path / "in").mkdir()
    scenes = [tmp_path / "in" / "a.jpg", tmp_path / "in" / "b.png"]
    for seed, path in enumerate(scenes):
        cv2.imwrite(str(path), smooth_scene(130, 170, seed))
    real = {"atomic_path": segment_module.atomic_path, "write_png": geo.write_png}

    def failing_for_a(function):
        def maybe_failing(path, *args):
            if path.name == failing:
                raise OSError(28, "No space left on device")
            return real[function](path, *args)
        return maybe_failing

    monkeypatch.setattr(segment_module, "atomic_path", failing_for_a("atomic_path"))
    monkeypatch.setattr(geo, "write_png", failing_for_a("write_png"))
    assert segment_module.segment_scenes(scenes, counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"cloudseg segment: {scenes[0]}") and "No space left" in error[0]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["b.json", "b_masks.png", "b_overlay.png",
                                                                          "fractions.csv"]


def test_an_error_while_mapping_removes_the_scene_s_file(tiny_ensemble, scenes, tmp_path, monkeypatch, files_at_once,
                                                         capsys):
    """CPU. Would catch: the scene's temporary GeoTIFF still there when its error is reported (left
    to the garbage collector), the file closed while a queued write of it still runs, the error
    blamed on b, or b not mapped."""
    _, ensemble = tiny_ensemble
    read, write, report = geo.GeoTiffScene.read, geo.write_geotiff_rows, segment_module.scene_error
    closed_while_writing, left_when_reported = [], []

    def failing_read(scene, top, left, height, width, out=None):
        if scene.path.stem == "a" and top > 150:
            raise OSError(5, "Read failed")
        return read(scene, top, left, height, width, out)

    def slow_write(out, top, bands):
        time.sleep(0.05)
        closed_while_writing.append(out.closed)
        write(out, top, bands)

    def reported(path, error):
        left_when_reported.extend(sorted(p.name for p in (tmp_path / "out").iterdir()))
        return report(path, error)

    monkeypatch.setattr(geo.GeoTiffScene, "read", failing_read)
    monkeypatch.setattr(geo, "write_geotiff_rows", slow_write)
    monkeypatch.setattr(segment_module, "scene_error", reported)
    assert segment_module.segment_scenes(scenes[:2], counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    assert capsys.readouterr().err.startswith(f"cloudseg segment: {scenes[0]}")
    assert left_when_reported == [] and closed_while_writing and not any(closed_while_writing)
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["b.json", "b.tif", "fractions.csv"]


def test_a_failed_last_write_publishes_nothing_of_its_scene(tiny_ensemble, scenes, tmp_path, monkeypatch,
                                                            files_at_once, capsys):
    """CPU. Would catch: a finish that closes and renames the file though its last rows failed to
    be written (a map with missing rows, and its NAME.json, published), or the error lost."""
    _, ensemble = tiny_ensemble
    write = geo.write_geotiff_rows

    def failing_last_rows_of_b(out, top, bands):
        if Path(out.name).name.startswith(".b.tif.") and top + bands.shape[1] == 320:
            raise OSError(28, "No space left on device")
        return write(out, top, bands)

    monkeypatch.setattr(geo, "write_geotiff_rows", failing_last_rows_of_b)
    assert segment_module.segment_scenes(scenes, counting(ensemble, []), tmp_path / "out", OPTIONS) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"cloudseg segment: {scenes[1]}") and "No space left" in error[0]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["a.json", "a.tif", "c.json", "c.tif",
                                                                          "fractions.csv"]


def test_a_scene_whose_time_cannot_be_read_fails_before_any_work(tiny_ensemble, tmp_path, capsys):
    """CPU. Would catch: the scene's time read after its mapping (the model run for nothing, and its
    file left open to the garbage collector while the writer may still write it), a message that
    does not say the tag is what is wrong (strptime's alone), or TIFF's "unknown" date (blanks and
    colons) failing the scene where its name has the time."""
    _, ensemble = tiny_ensemble
    (tmp_path / "in").mkdir()
    bad = write_geotiff(tmp_path / "in" / "a.tif", smooth_scene(320, 230),
                        tags={"TIFFTAG_DATETIME": "2020-01-01 00:00"})  # not YYYY:MM:DD HH:MM:SS
    unknown = write_geotiff(tmp_path / "in" / "b_20200203.tif", smooth_scene(320, 230),
                            tags={"TIFFTAG_DATETIME": "    :  :     :  :  "})  # TIFF's "unknown"
    calls = []
    (tmp_path / "out").mkdir()
    assert segment_module.segment_scenes([bad], counting(ensemble, calls), tmp_path / "out", OPTIONS) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"cloudseg segment: {bad}: its TIFFTAG_DATETIME '2020-01-01 00:00' is not a time") and calls == []
    assert list((tmp_path / "out").iterdir()) == []
    assert segment_module.segment_scenes([unknown], counting(ensemble, calls), tmp_path / "out", OPTIONS) == 0
    assert json.loads((tmp_path / "out" / "b_20200203.json").read_text())["time"].startswith("2020-02-03")
