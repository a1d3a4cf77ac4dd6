"""A pytest plugin, `-p tests.report_now --report-now` (make test-gpu): each test's line (outcome,
seconds, seconds since the start, and the figures it recorded with pytest's `record_property`) and
any failure's traceback written the moment its report arrives. pytest itself prints tracebacks at
the end of the session, which a machine's time limit may never reach: on 2026-11-26 a GPU run cut
at six minutes lost its only failure's reason.

`--profile-slow DIR`: each test's call runs under cProfile, and a test slower than
`--profile-slow-s` (default 20) leaves DIR/<test>-<hash>.txt, its 30 costliest functions by their
own time and by cumulative time, also when the run is killed (SIGTERM) in that test. The
mixed-precision GPU epochs took 70 s each on an H100 on 2026-11-26 for a tiny model; one window's
run then says where, without a second one. Profiling slows Python code, so the times of such a
run are not comparable with others'."""

import cProfile
import hashlib
import os
import pstats
import re
import signal
import time
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--report-now", action="store_true",
                     help="print each test's outcome and time as it ends, and a failure's traceback at once")
    parser.addoption("--profile-slow", metavar="DIR", help="profile each test; keep the profile of slow ones in DIR")
    parser.addoption("--profile-slow-s", type=float, default=20.0, help="what is slow, in seconds (default 20)")


def pytest_configure(config):
    if config.getoption("--report-now"):
        config.pluginmanager.register(ReportNow(config), "report-now")
    if config.getoption("--profile-slow"):
        config.pluginmanager.register(ProfileSlow(Path(config.getoption("--profile-slow")),
                                                  config.getoption("--profile-slow-s")), "profile-slow")


class ReportNow:
    def __init__(self, config: pytest.Config):
        self.config, self.start = config, time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport):
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")  # registered after pytest_configure
        # a test skipped or failing in its setup has no call phase; a failing teardown gets its own line
        if report.when == "call" or not report.passed and report.when == "setup" or report.failed:
            phase = "" if report.when == "call" else f" in {report.when}"
            terminal.ensure_newline()
            figures = "".join(f" {name}={value}" for name, value in report.user_properties)
            terminal.write_line(f"[now] {report.nodeid} {report.outcome}{phase} {report.duration:.1f} s "
                                f"(at {time.monotonic() - self.start:.0f} s){figures}", flush=True)
        if report.failed:
            terminal.write_sep("!", f"{report.nodeid} failed in {report.when}", flush=True)
            terminal.write_line(report.longreprtext, flush=True)


class ProfileSlow:
    """Profiles each test's call; keeps the slow ones'. A run killed by its time limit (SIGTERM, as
    `timeout` sends) still keeps the profile of the test it was in, if that one was slow by then."""

    def __init__(self, folder: Path, slow_s: float):
        self.folder, self.slow_s, self.running = folder.resolve(), slow_s, None  # resolved before any chdir
        self.pid = os.getpid()  # a forked child (a loader's worker) inherits the handler, not the profile's owner
        self.previous = signal.signal(signal.SIGTERM, self.terminated) or signal.SIG_DFL  # None: set outside Python

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.running = item.nodeid, time.monotonic(), cProfile.Profile()
        self.running[2].enable()
        try:
            return (yield)
        finally:
            self.keep_if_slow()

    def terminated(self, signum, frame):
        if os.getpid() == self.pid:
            self.keep_if_slow()
        signal.signal(signum, self.previous)  # then whatever SIGTERM did before: by default, the end
        os.kill(os.getpid(), signum)

    def keep_if_slow(self) -> None:
        if self.running is None:
            return
        (nodeid, start, profile), self.running = self.running, None
        profile.disable()
        seconds = time.monotonic() - start
        if seconds < self.slow_s:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:8]  # two ids may sanitize alike
        with open(self.folder / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', nodeid)[-120:]}-{digest}.txt", "w") as out:
            out.write(f"{nodeid}: {seconds:.1f} s (the calling thread's functions; profiled, so slower than "
                      "without)\n")
            for order in ("tottime", "cumulative"):
                pstats.Stats(profile, stream=out).sort_stats(order).print_stats(30)
