"""The clock of a run's start (cloudseg/startclock.py), on the CPU: stages from marks, the
process's age from /proc. tests/test_train.py reads the line a real training run logs."""

import subprocess
import sys

from cloudseg.startclock import StartClock, seconds_since_process_start


def test_each_stage_runs_from_the_mark_before_and_they_add_up_to_the_total():
    """Hand-computed: a process 3 s old when the clock starts at 10, marks at 12.5, 13 and 20.
    Would catch: a stage timed from the clock's start rather than the mark before (2.5, 3, 10),
    the start-up left out of the total, or the line not naming a stage."""
    clock = StartClock(clock=iter([10.0, 12.5, 13.0, 20.0]).__next__, age=3.0)
    for stage in ("data index", "probes", "first window"):
        clock.mark(stage)
    assert clock.stages == [("start-up", 3.0), ("data index", 2.5), ("probes", 0.5), ("first window", 7.0)]
    assert clock.total() == 13.0
    assert clock.line() == ("first optimizer step 13.0 s after the command started: start-up 3.0 s, "
                            "data index 2.5 s, probes 0.5 s, first window 7.0 s")


def test_the_process_s_age_is_read_from_its_start():
    """A process that sleeps 1 s before asking is at least 1 s old, and not minutes. Would catch:
    the wrong field of /proc/self/stat (a process's start is a few seconds, not hours, before
    its question here), or ticks taken for seconds."""
    code = "import time; time.sleep(1.0); from cloudseg.startclock import seconds_since_process_start as s; print(s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= age < 30


def test_a_later_run_in_the_process_counts_from_its_own_start(monkeypatch):
    """The next fold of an every-fold run starts long after the process did: its line counts from
    its own start, with no start-up stage. Would catch: each fold's start-up taken as the process's
    age (the folds before it counted again in every later fold's total)."""
    from cloudseg import startclock

    monkeypatch.setattr(startclock, "_first_run", [True])
    monkeypatch.setattr(startclock, "seconds_since_process_start", lambda: 40.0)
    first = StartClock(clock=iter([0.0, 1.0]).__next__)
    first.mark("data index")
    later = StartClock(clock=iter([100.0, 101.5]).__next__)
    later.mark("data index")
    assert first.stages == [("start-up", 40.0), ("data index", 1.0)]
    assert later.stages == [("data index", 1.5)]
    assert later.line() == "first optimizer step 1.5 s after this run's start: data index 1.5 s"
