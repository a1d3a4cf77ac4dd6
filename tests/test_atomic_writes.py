"""A writer killed or interrupted midway leaves the old file (or none), never part of a new one."""

import signal
import subprocess
import sys

import pandas as pd
import pytest

from cloudseg.files import atomic_path
from cloudseg.predict import write_submission
from cloudseg.task import LABELS

# Writes 1 MiB chunks through atomic_path forever, with the CLI's signal handling,, saying when the first one is on disk.
ENDLESS_WRITER = """
import sys, time
from cloudseg.cli import exit_on_sigterm
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


def test_atomic_path_is_the_target_only_after_success(tmp_path):
    target = tmp_path / "postprocess.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("{")
            assert not target.exists()
            raise RuntimeError("failed midway")
    assert list(tmp_path.iterdir()) == []
