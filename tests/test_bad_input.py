"""Every bad-input case through the CLI: `cloudseg check` reports it, `cloudseg train` stops
with one line naming the file or row (exit 2), and `data.on_bad_sample=skip` trains around it."""

import os
import re
import shutil
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from cloudseg.cli import main
from cloudseg.synth import synthesize
from tests.conftest import TINY

SHAPE = (64, 96)
FAST = [*TINY, "train.epochs=1", f"data.image_size=[{SHAPE[0]},{SHAPE[1]}]"]


@pytest.fixture(scope="module")
def clean_data(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("clean"), n_train=40, n_test=4, height=SHAPE[0], width=SHAPE[1], seed=5)


@pytest.fixture
def data(clean_data, tmp_path):
    return shutil.copytree(clean_data, tmp_path / "data")


# ------------------------------------------------------------------------- seeding each case
# Each function spoils one image (or its rows) and returns (what the message must name, what it must say).


def image_path(data, image_id):
    return data / "train_images" / image_id


def truncated(data, image_id):
    path = image_path(data, image_id)
    path.write_bytes(path.read_bytes()[:-300])
    return str(path), "truncated JPEG"


def zero_byte(data, image_id):
    image_path(data, image_id).write_bytes(b"")
    return str(image_path(data, image_id)), "empty file"


def not_a_jpeg(data, image_id):
    image_path(data, image_id).write_bytes(cv2.imencode(".png", np.zeros((*SHAPE, 3), np.uint8))[1].tobytes())
    return str(image_path(data, image_id)), "not a JPEG file"


def grayscale(data, image_id):
    Image.fromarray(np.full(SHAPE, 128, np.uint8), "L").save(image_path(data, image_id), format="JPEG")
    return str(image_path(data, image_id)), "grayscale JPEG; expected a 3-channel RGB image"


def cmyk(data, image_id):
    Image.fromarray(np.full((*SHAPE, 4), 128, np.uint8), "CMYK").save(image_path(data, image_id), format="JPEG")
    return str(image_path(data, image_id)), "CMYK JPEG; expected a 3-channel RGB image"


def corrupt(data, image_id):
    image_path(data, image_id).write_bytes(b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9")
    return str(image_path(data, image_id)), "corrupt JPEG"


def wrong_size(data, image_id):
    cv2.imwrite(str(image_path(data, image_id)), np.zeros((32, 96, 3), np.uint8))
    return str(image_path(data, image_id)), "image is 32x96, expected 64x96"


def missing(data, image_id):
    image_path(data, image_id).unlink()
    return str(image_path(data, image_id)), "image not found"


def set_rle(rle, message):
    def spoil(data, image_id):
        frame = read(data)
        row = frame.index[frame["Image_Label"] == f"{image_id}_Fish"][0]
        frame.loc[row, "EncodedPixels"] = rle
        write(data, frame)
        return f"({image_id}_Fish)", message

    spoil.__name__ = f"rle {rle!r}"
    return spoil


def duplicate_row(data, image_id):
    frame = read(data)
    row = frame[frame["Image_Label"] == f"{image_id}_Gravel"]
    write(data, pd.concat([frame, row]))
    return f"duplicate Image_Label {image_id}_Gravel", "on lines"


def unknown_label(data, image_id):
    frame = read(data)
    frame.loc[frame["Image_Label"] == f"{image_id}_Sugar", "Image_Label"] = f"{image_id}_Cumulus"
    write(data, frame)
    return f"({image_id}_Cumulus)", "unknown label 'Cumulus'; expected one of Fish, Flower, Gravel, Sugar"


def read(data):
    return pd.read_csv(data / "train.csv", dtype=str, keep_default_na=False)


def write(data, frame):
    frame.to_csv(data / "train.csv", index=False)


SKIPPABLE = [truncated, zero_byte, not_a_jpeg, grayscale, cmyk, corrupt, wrong_size, missing,
             set_rle("1 2 3", "odd number of values"), set_rle("1 x", "non-integer value 'x'"),
             set_rle("0 5", "starts count from 1"), set_rle("1 0", "lengths are at least 1"),
             set_rle("10 2 1 2", "unsorted or overlapping"), set_rle("1 5 3 2", "unsorted or overlapping"),
             set_rle("6000 200", "ends past the last pixel 6144"),
             set_rle("1 1 9223372036854775701 7252", "larger than any image"),  # it wrapped around: a segfault
             duplicate_row, unknown_label]


def image_ids(data):
    return read(data)["Image_Label"].str.rpartition("_")[0].drop_duplicates().tolist()


# ------------------------------------------------------------------------- one case at a time


def test_a_run_refused_before_it_starts_leaves_no_folder(tmp_path, capsys):
    """A data folder without train.csv: one line, and no runs/<name>/ holding only the log of
    the refusal. A folder the user made beforehand stays (with the log). Would catch: the empty run folder that
    a refused `make train` used to leave (and `make predict` then took for the newest run)."""
    (tmp_path / "empty").mkdir()
    for out, kept in ((tmp_path / "runs/new", False), (tmp_path / "mine", True)):
        if kept:
            out.mkdir()
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(out), f"data.dir={tmp_path / 'empty'}", *FAST]) == 2
        assert "train.csv" in capsys.readouterr().err
        assert out.is_dir() is kept


@pytest.mark.parametrize("spoil", SKIPPABLE, ids=lambda spoil: spoil.__name__)
def test_check_reports_it_and_train_stops_with_one_line_naming_it(data, tmp_path, capsys, spoil):
    named, message = spoil(data, image_ids(data)[-1])
    assert main(["check", "--data-dir", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "1 problem(s):" in out
    problem = out.splitlines()[-1]
    assert named in problem and message in problem, out

    assert main(["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "run"), f"data.dir={data}", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cloudseg: error: ") and len(err.splitlines()) == 1, err
    assert named in err and message in err, err


def test_an_image_the_system_will_not_read_is_a_problem_naming_it(data, monkeypatch):
    """A JPEG whose read fails in the operating system (permissions, an I/O error; simulated, as
    root reads every file): a ValueError naming it, which `cloudseg check` reports and skip mode
    skips like any bad image. Would catch the OSError escaping (check ended in a traceback and
    lost every other problem it had found)."""
    from cloudseg.data import read_jpeg_bytes

    path = image_path(data, image_ids(data)[0])
    real = np.fromfile

    def refused(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(np, "fromfile", refused)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: cannot be read \(Permission denied\)"):
        read_jpeg_bytes(path)


def test_a_bad_image_in_a_loader_worker_is_still_one_line(data, tmp_path, capsys):
    named, message = truncated(data, image_ids(data)[0])
    run = ["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "run"), f"data.dir={data}", *FAST]
    assert main([*run, "data.num_workers=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and message in err and "Traceback" not in err, err


def test_a_wrong_header_is_an_error_in_both_modes(data, tmp_path, capsys):
    frame = read(data).rename(columns={"Image_Label": "ImageId"})
    frame.to_csv(data / "train.csv", index=False)
    expected = f"{data / 'train.csv'}: missing column(s) ['Image_Label']"
    assert main(["check", "--data-dir", str(data), "--workers", "1"]) == 1
    assert expected in capsys.readouterr().out
    for policy in ("raise", "skip"):
        run = ["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / policy), f"data.dir={data}", *FAST]
        assert main([*run, f"data.on_bad_sample={policy}"]) == 2
        assert expected in capsys.readouterr().err


@pytest.mark.parametrize("content, named", [(b"", "empty file"), (b"Image_Label,EncodedPixels\n", "no rows under its header"),
                                            (None, "line 3 is not UTF-8 text (byte 0xe9)")],
                         ids=["empty", "header only", "Latin-1"])
def test_an_empty_header_only_or_non_utf8_csv_is_one_line_naming_it(data, tmp_path, capsys, content, named):
    """train.csv, then sample_submission.csv, empty, a header alone, or with one Latin-1 byte on its
    third line. Would catch: pandas' "No columns to parse from file" or Python's codec error
    without the file's name, a header alone taken as a dataset of no images ("no problems found",
    then "cannot split 0 images into 5 folds"; a submission of no rows written by predict)."""
    for name, command in (("train.csv", ["check", "--data-dir", str(data), "--workers", "1"]),
                          ("sample_submission.csv", ["evaluate", "--submission", str(data / "sample_submission.csv"),
                                                     "--truth", str(data / "train.csv")])):
        original = (data / name).read_bytes()
        if content is None:
            lines = original.split(b"\n")
            lines[2] = lines[2].replace(b",", b",\xe9", 1)
        (data / name).write_bytes(b"\n".join(lines) if content is None else content)
        assert main(command) in (1, 2)
        captured = capsys.readouterr()
        assert f"{data / name}: {named}" in captured.out + captured.err, name
        (data / name).write_bytes(original)
    (data / "train.csv").write_bytes(b"Image_Label,EncodedPixels\n" if content is not None else b"")
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "run"), f"data.dir={data}", *FAST]) == 2
    assert capsys.readouterr().err.startswith(f"cloudseg: error: {data / 'train.csv'}: ")


@pytest.mark.parametrize("line", [2, 5])
def test_a_row_with_more_fields_than_the_header_is_one_line_naming_it(data, capsys, line):
    """An extra field on the first data row or a later one, in train.csv (check) and in a
    submission (evaluate). Would catch: pandas taking the first column as an index when the first
    data row has one more field (every column shifted: 'Image_Label <an RLE> is not of the form
    <image>_<label>' on each row), or its "Expected 2 fields in line 5, saw 3" naming no file."""
    for name, command in (("train.csv", ["check", "--data-dir", str(data), "--workers", "1"]),
                          ("sample_submission.csv", ["evaluate", "--submission", str(data / "sample_submission.csv"),
                                                     "--truth", str(data / "train.csv")])):
        original = (data / name).read_text()
        rows = original.splitlines()
        rows[line - 1] += ",extra"
        (data / name).write_text("\n".join(rows) + "\n")
        assert main(command) in (1, 2)
        captured = capsys.readouterr()
        assert f"{data / name}, line {line}: 3 fields, where the header has 2" in captured.out + captured.err, name
        (data / name).write_text(original)


def test_byte_order_mark_and_windows_line_endings_simply_work(data, tmp_path, capsys):
    for name in ("train.csv", "sample_submission.csv"):
        text = (data / name).read_text()
        (data / name).write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert main(["check", "--data-dir", str(data), "--workers", "1"]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "run"), f"data.dir={data}", *FAST]) == 0


# ------------------------------------------------------------------------- every case at once


@pytest.fixture
def every_case(data):
    """The dataset with each skippable case in its own image; (image id, named, message) per case."""
    ids = image_ids(data)
    return data, [(image_id, *spoil(data, image_id)) for image_id, spoil in zip(ids[1:], SKIPPABLE)]


def test_check_reads_on_the_cores_the_process_may_use(clean_data, monkeypatch):
    """CPU. Without --workers, check reads on as many threads as the process's CPU affinity allows
    (taskset, a Slurm job's cpuset), not the machine's cores. Would catch: os.cpu_count() (a
    2-core job on a 128-core node starting 128 decoding threads)."""
    from cloudseg import check

    threads = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    monkeypatch.setattr(check, "unreadable", lambda dataset, workers, desc: threads.append(workers) or [])
    check.check_dataset(clean_data)
    assert threads == [3, 3]  # train, test


def test_check_reports_every_case(every_case, capsys):
    data, cases = every_case
    assert main(["check", "--data-dir", str(data), "--workers", "2"]) == 1
    out = capsys.readouterr().out
    assert f"{len(cases)} problem(s):" in out
    lines = out.splitlines()[-len(cases):]
    for _, named, message in cases:
        assert sum(named in line and message in line for line in lines) == 1, (named, out)
    assert "test: 4 images with valid rows; 0 bad rows, 0 bad images" in out


def test_skip_mode_trains_around_every_case_and_lists_them(every_case, tmp_path, capsys):
    data, cases = every_case
    run = tmp_path / "run"
    args = ["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *FAST, "data.on_bad_sample=skip"]
    assert main(args) == 0
    skipped = pd.read_csv(run / "skipped.csv", dtype=str, keep_default_na=False)
    assert sorted(skipped["image_id"]) == sorted(image_id for image_id, _, _ in cases)
    for image_id, named, message in cases:
        problem = skipped.loc[skipped["image_id"] == image_id, "problem"].item()
        assert named in problem and message in problem
    # Bad rows are left out when train.csv is read (no epoch); bad images, and runs past the
    # image's end (only the image size tells), when an epoch reaches them.
    row_cases = skipped["problem"].str.contains(r"train.csv(?:, line|: duplicate)")
    assert row_cases.sum() == 9  # set_rle's but the run past the image's end, duplicate_row, unknown_label
    assert (skipped.loc[row_cases, "epoch"] == "").all() and (skipped.loc[~row_cases, "epoch"] == "1").all()
    metrics = pd.read_csv(run / "metrics.csv")
    assert metrics["skipped_samples"].tolist() == [(~row_cases).sum()]
    log = (run / "train.log").read_text()
    assert re.search(rf"unreadable samples in epoch 1: {(~row_cases).sum()} left out", log)


def test_predict_stops_on_a_bad_test_image_naming_it_and_writes_nothing(data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *FAST,
                 "data.on_bad_sample=skip"]) == 0  # prediction needs every test image, even so
    image = sorted((data / "test_images").iterdir())[-1]
    image.write_bytes(image.read_bytes()[:-300])
    submission = tmp_path / "submission.csv"
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(submission), "--device", "cpu",
                 "data.num_workers=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"cloudseg: error: {image}: truncated JPEG (no end-of-image marker)"
    assert not submission.exists() and list(tmp_path.glob(".submission.csv*")) == []
