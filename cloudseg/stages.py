"""Seconds per stage of a `cloudseg segment` run, and the one line that says what bounds it.

Data path (beyond the competition): beside `cloudseg.segment`, which times its stages here: the
reads (in the reader threads), to the device, the model and the blend (the main thread), the
encode (on a GPU queued by the main thread, awaited by the writer thread; on a CPU the writer's)
and the write (the writer thread), and the main thread's waits for the reader and the writer. A
stage's seconds are summed over the threads that run it, so stages overlap and may add up to more
than the wall time; the bound is judged by each stage's busiest thread.

Host clocks only, and no host sync of their own: on a GPU the model and the blend are queued, not
run, when their clock stops, so their seconds are the host's time to queue them; the GPU's own time
shows where the host waits for it, in `encode` (the one named host sync per row of windows,
`syncs.NAMED["segment rows"]`: the writer waits for the finished rows' encode and copy to the host,
queued by the main thread as it released them).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

ORDER = ("read", "to device", "model", "blend", "encode", "write")  # in the line, the data's order
WAITS = {"wait for reads": "reads", "wait for writes": "writes"}  # the main thread idle, by what it awaits


class StageClock:
    """Seconds per stage, added from any thread (`with clock("model"): ...`)."""

    def __init__(self):
        self.per_thread: collections.Counter[tuple[str, int]] = collections.Counter()  # by (stage, thread)
        self.spans: dict[str, tuple[float, float]] = {}  # stage -> (its first start, its last end): perf_counter
        # (perf_counter, the process's CPU seconds) at the first stage's start and at the last one's end, for `cores`
        self.first_start: tuple[float, float] | None = None
        self.last_end: tuple[float, float] | None = None
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        if stage in ORDER:
            with self.lock:
                if self.first_start is None or start < self.first_start[0]:  # the earliest, whoever locks first
                    self.first_start = (start, time.process_time())
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        """`seconds` of `stage` in this thread, ending now."""
        if stage not in ORDER and stage not in WAITS:
            raise KeyError(f"{stage!r} is not a stage ({', '.join((*ORDER, *WAITS))})")
        end = time.perf_counter()
        with self.lock:
            self.per_thread[stage, threading.get_ident()] += seconds
            first, last = self.spans.get(stage, (end - seconds, end))
            self.spans[stage] = (min(first, end - seconds), max(last, end))
            if stage in ORDER and (self.last_end is None or end > self.last_end[0]):  # a later end, whoever locks first
                self.last_end = (end, time.process_time())

    def timed(self) -> list[tuple[tuple[str, int], float]]:
        """((stage, thread), seconds) so far, read under the lock (other threads still add)."""
        with self.lock:
            return list(self.per_thread.items())

    @property
    def seconds(self) -> collections.Counter[str]:
        """Seconds per stage, summed over the threads that ran it."""
        total = collections.Counter()
        for (stage, _), seconds in self.timed():
            total[stage] += seconds
        return total

    def bound_by(self) -> str | None:
        """The busiest stage: the one that, made faster, would make the run faster (threads
        overlap the others with it), judged by the thread that spent the most time in it: four
        reader threads busy 0.6 s each bound a run less than one writer busy 2 s (a thread started
        after another ended may reuse its ident: one lane, one after the other). None before any
        stage ran."""
        timed = self.timed()
        busiest = {stage: max((seconds for (name, _), seconds in timed if name == stage), default=0) for stage in ORDER}
        busy = {stage: seconds for stage, seconds in busiest.items() if seconds > 0}
        return max(busy, key=busy.get) if busy else None

    def timeline(self) -> str:
        """E.g. `from the first read: read 0.00 to 1.95 s · model 0.10 to 1.98 · encode 0.30 to 2.05 ·
        write 0.32 to 2.18; 7.9 cores busy (17.2 CPU s in 2.18 s)`: each stage's first start and last
        end, in seconds from the first read's start (or the first stage's): how long the pipeline
        takes to fill (the first write comes late) and to drain (the writes end long after the
        model's), which the seconds summed per stage cannot tell; then how many cores it kept busy
        meanwhile (`cores`)."""
        with self.lock:
            spans = {stage: span for stage, span in self.spans.items() if stage in ORDER}  # not the waits
        if not spans:
            return "from the first read: nothing timed"
        zero = spans["read"][0] if "read" in spans else min(first for first, _ in spans.values())
        parts = [f"{stage} {spans[stage][0] - zero:.2f} to {spans[stage][1] - zero:.2f}" for stage in ORDER
                 if stage in spans]
        return f"from the first read: {parts[0]} s" + "".join(f" · {part}" for part in parts[1:]) + self.cores()

    def cores(self) -> str:
        """E.g. `; 7.9 cores busy (9.0 CPU s in 1.14 s)`: the process's CPU seconds over the wall
        seconds from the first stage's start to the last one's end (the loading before and the
        summaries after left out; any thread of the process counts), or "" where no stage was timed
        by `with clock(stage)`."""
        with self.lock:
            first, last = self.first_start, self.last_end
        if first is None or last is None or last[0] <= first[0]:
            return ""
        wall, cpu = last[0] - first[0], last[1] - first[1]
        return f"; {cpu / wall:.1f} cores busy ({cpu:.1f} CPU s in {wall:.2f} s)"

    def line(self, gpu: bool = False) -> str:
        """E.g. `stages: read 1.2 s · to device 0.1 · model 3.4 · blend 0.8 · encode 0.3 · write 2.1
        (waits: for reads 0.4, for writes 0.2) — bound by: model`; on a GPU encode is named
        "GPU wait, to host, encode" (see the module's docstring)."""
        names, seconds = ({"encode": "GPU wait, to host, encode"} if gpu else {}), self.seconds
        parts = [f"{names.get(stage, stage)} {seconds[stage]:.1f}" for stage in ORDER]
        waits = ", ".join(f"for {what} {seconds[stage]:.1f}" for stage, what in WAITS.items())
        bound = self.bound_by()
        return (f"stages: {parts[0]} s · {' · '.join(parts[1:])} (waits: {waits}) — bound by: "
                f"{names.get(bound, bound) if bound else 'nothing timed'}")
