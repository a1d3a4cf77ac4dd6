"""Stopping a long job on request: SIGINT or SIGTERM (a cluster's pre-emption warning) asks,
and the loops of the data path (training windows, validation, out-of-fold prediction) answer
within one batch, after which the run saves a resumable checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

log = logging.getLogger("cloudseg")


class Interrupted(Exception):
    """A run stopped on SIGINT or SIGTERM after saving a resumable checkpoint."""


class StopRequested(Exception):
    """Raised inside a loop by `until_stopped` when a stop was asked for."""


@contextlib.contextmanager
def stop_requests():
    """Within: SIGINT and SIGTERM ask the loops to stop after the current window or batch (a
    second SIGINT stops at once). Yields a function that says whether a stop was asked for."""
    requested, owner, in_worker = [], os.getpid(), []

    def ask_to_stop(signum, frame):
        if os.getpid() != owner:  # a DataLoader worker, forked with this handler: Ctrl-C reaches the whole group,
            in_worker.append(signum)  # and the main process answers the first (else each worker said the warning)
            if in_worker.count(signal.SIGINT) > 1:  # the second stops the worker too, as it stops the main process
                raise KeyboardInterrupt
            return
        if requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not requested:  # under torchrun the launcher passes the signal on too: say it once
            log.warning("%s: finishing the current window or batch, then saving a resumable checkpoint",
                        signal.Signals(signum).name)
        requested.append(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield lambda: False
        return
    previous = {s: signal.signal(s, ask_to_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(requested)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def until_stopped(batches, stop_requested=None, count: int | None = None):
    """The batches, asking `stop_requested()` before each and raising StopRequested when it
    says yes. With `count`, it asks exactly `count` times and yields what there is: a stop
    check that all processes answer together must be asked equally often on each."""
    batches = iter(batches)
    for _ in range(count) if count is not None else iter(int, 1):
        if stop_requested is not None and stop_requested():
            raise StopRequested
        batch = next(batches, None)
        if batch is None:
            if count is None:
                return
            continue
        yield batch
