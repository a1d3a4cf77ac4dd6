"""A writer killed or interrupted midway leaves the old file (or none), never part of a new one."""

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from cloudseg.files import atomic_path
from cloudseg.predict import write_submission
from cloudseg.task import LABELS

# Writes 1 MiB chunks through atomic_path forever, with the CLI's signal handling, saying when the first one is on disk.
ENDLESS_WRITER = """
import signal, sys, time
from cloudseg.cli import exit_on_sigterm
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
from cloudseg.files import atomic_path
exit_on_sigterm()  # as every cloudseg command does
with atomic_path(sys.argv[1]) as tmp, open(tmp, "wb") as file:
    while True:
        file.write(b"new" * 349525)
        file.flush()
        print("writing", flush=True)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_a_writer_killed_midway_leaves_the_old_file(tmp_path, signum):
    target = tmp_path / "last.pt"
    target.write_bytes(b"the old checkpoint")
    writer = subprocess.Popen([sys.executable, "-c", ENDLESS_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signum)
    assert writer.wait(timeout=30) != 0
    assert target.read_bytes() == b"the old checkpoint"
    leftovers = [p.name for p in tmp_path.iterdir() if p != target]
    if signum == signal.SIGKILL:  # nothing can clean up after SIGKILL; the half-file is hidden and named .tmp
        assert len(leftovers) == 1 and leftovers[0].startswith(".last.pt.") and leftovers[0].endswith(".tmp")
    else:
        assert leftovers == [], leftovers


def test_an_interrupted_submission_write_leaves_no_file(tiny_data, tmp_path, monkeypatch):
    ids = pd.read_csv(tiny_data / "sample_submission.csv")["Image_Label"].str.rpartition("_")[0].unique()
    rows = [(f"{image_id}_{label}", "1 3") for image_id in ids for label in LABELS]
    real_to_csv = pd.DataFrame.to_csv

    def write_half_then_interrupt(frame, path, **kwargs):
        real_to_csv(frame.iloc[: len(frame) // 2], path, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pd.DataFrame, "to_csv", write_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_submission(rows, tiny_data / "sample_submission.csv", tmp_path / "submission.csv")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(pd.DataFrame, "to_csv", real_to_csv)
    written = write_submission(rows, tiny_data / "sample_submission.csv", tmp_path / "submission.csv")
    assert len(pd.read_csv(written)) == len(rows) and list(tmp_path.iterdir()) == [written]


def test_a_submission_follows_the_sample_s_own_row_order_and_names_what_is_amiss(tiny_data, tmp_path):
    """A sample_submission.csv sorted by label (all Fish rows first), not image by image. Would
    catch: rows rebuilt as image order x label order (the file's other rows moved), or a mismatch
    told by its row counts alone."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    sample = pd.read_csv(data / "sample_submission.csv")
    parts = sample["Image_Label"].str.rpartition("_")
    sample = sample.iloc[np.lexsort([parts[0], parts[2]])]  # by label, then image
    sample.to_csv(data / "sample_submission.csv", index=False)
    assert sample["Image_Label"].iloc[1].endswith("_Fish")  # not image by image
    rows = [(key, "1 3") for key in sample["Image_Label"].sample(frac=1, random_state=0)]  # in any order
    written = write_submission(rows, data / "sample_submission.csv", tmp_path / "submission.csv")
    assert pd.read_csv(written)["Image_Label"].tolist() == sample["Image_Label"].tolist()
    with pytest.raises(ValueError, match=rf"asks for {len(sample)}; missing {sample['Image_Label'].iloc[0]}; "
                                         r"not asked for x\.jpg_Fish$"):
        write_submission([r for r in rows if r[0] != sample["Image_Label"].iloc[0]] + [("x.jpg_Fish", "")],
                         data / "sample_submission.csv", tmp_path / "submission.csv")


def test_atomic_path_is_the_target_only_after_success(tmp_path):
    target = tmp_path / "postprocess.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("{")
            assert not target.exists()
            raise RuntimeError("failed midway")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_in_the_way_is_named_and_no_temporary_is_left(tmp_path):
    """Would catch: the folder found only by the final rename, whose error names the hidden
    temporary file (`[Errno 21] Is a directory: '.x.1234.tmp' -> 'x'`), not the path asked for."""
    (tmp_path / "submission.csv").mkdir()
    with pytest.raises(IsADirectoryError, match=f"^{tmp_path / 'submission.csv'}: is a folder"):
        with atomic_path(tmp_path / "submission.csv") as tmp:
            tmp.write_text("rows")
    assert [path.name for path in tmp_path.iterdir()] == ["submission.csv"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o027, 0o640)])
def test_a_written_file_has_the_mode_open_would_give_it(tmp_path, umask, mode):
    """Catches mkstemp's 0600 surviving the rename (umask 022, 027) and a fixed chmod 0644 (077)."""
    previous = os.umask(umask)
    try:
        with atomic_path(tmp_path / "folds.csv") as tmp:
            tmp.write_text("image_id,fold\n")
        with open(tmp_path / "plain.csv", "w") as file:  # the reference: what open() gives
            file.write("image_id,fold\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "folds.csv").st_mode) == mode
    assert stat.S_IMODE(os.stat(tmp_path / "plain.csv").st_mode) == mode


def test_the_file_is_synced_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    """Catches no fsync, an fsync before the caller has written (size 0), an fsync after the
    rename (the new name could point at unwritten data), and a missing folder fsync."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def recording_fsync(descriptor):
        status = os.fstat(descriptor)
        events.append(("fsync", "folder" if stat.S_ISDIR(status.st_mode) else "file", status.st_ino, status.st_size))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", lambda *paths: events.append(("replace",)) or real_replace(*paths))
    target = tmp_path / "run" / "metrics.csv"
    with atomic_path(target) as tmp:
        tmp.write_text("epoch,dice\n1,0.5\n")
    file_inode, folder_inode = os.stat(target).st_ino, os.stat(target.parent).st_ino
    folder_size = os.stat(target.parent).st_size
    assert events == [("fsync", "file", file_inode, len("epoch,dice\n1,0.5\n")), ("replace",),
                      ("fsync", "folder", folder_inode, folder_size)]


def test_a_filesystem_that_cannot_sync_folders_still_gets_the_file(tmp_path, monkeypatch):
    """Some FUSE and network mounts refuse fsync on a folder (EINVAL): the rename has happened,
    so the write must not fail. Catches treating that error as a failed write, and swallowing
    every error (EIO is still raised)."""
    real_fsync = os.fsync

    def folder_sync_fails(descriptor, error=errno.EINVAL):
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(error, os.strerror(error))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", folder_sync_fails)
    with atomic_path(tmp_path / "submission.csv") as tmp:
        tmp.write_text("Image_Label,EncodedPixels\n")
    assert (tmp_path / "submission.csv").read_text() == "Image_Label,EncodedPixels\n"
    monkeypatch.setattr(os, "fsync", lambda descriptor: folder_sync_fails(descriptor, errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_path(tmp_path / "folds.csv") as tmp:
            tmp.write_text("image_id,fold\n")
