"""How long `cloudseg train` takes from the command to its first optimizer step, stage by stage.

Data path: beside the run (train.py), which marks the end of each stage of its start here and logs
one line once its first window has stepped: start-up (Python, the imports, the config), the data
index, the model, the memory probes (`train.checkpointing` and `train.micro_batch: auto`), the
set-up (optimizer, run folder, loaders; a resume's checkpoint), and the first window (its loading,
its compile where `train.compile` compiles, its step). Each stage runs from the previous mark to
its own, so the stages add up to the total.
"""

from __future__ import annotations

import os
import time


def seconds_since_process_start() -> float | None:
    """How long ago this process started, from Linux's /proc; None where there is no /proc."""
    try:
        with open("/proc/self/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        with open("/proc/uptime") as file:
            uptime = float(file.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): clock ticks after boot
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - started)


_first_run = [True]  # the first run in this process is the one whose start-up is the process's


class StartClock:
    """The stages of a run's start, each `mark`ed as it ends. The first run of a process starts
    with start-up, the time from the process's start to the clock's (where /proc tells it); a later
    one (the next fold of an every-fold run) from its own start. `age`: the process's, for tests."""

    def __init__(self, clock=time.monotonic, age: float | None = None):
        self.clock = clock
        self.last = clock()
        if age is None and _first_run[0]:
            age = seconds_since_process_start()
        _first_run[0] = False
        self.stages: list[tuple[str, float]] = [] if age is None else [("start-up", age)]

    def mark(self, stage: str) -> None:
        """`stage` ends now: its seconds are those since the last mark."""
        now = self.clock()
        self.stages.append((stage, now - self.last))
        self.last = now

    def total(self) -> float:
        return sum(seconds for _, seconds in self.stages)

    def line(self) -> str:
        """One line of the whole start, stage by stage."""
        stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.stages)
        since = "the command started" if self.stages and self.stages[0][0] == "start-up" else "this run's start"
        return f"first optimizer step {self.total():.1f} s after {since}: {stages}"
