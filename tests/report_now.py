"""A pytest plugin, `-p tests.report_now --report-now` (make test-gpu): each test's line (outcome,
seconds, seconds since the start, and the figures it recorded with pytest's `record_property`) and
any failure's traceback written the moment its report arrives. pytest itself prints tracebacks at the end of the session, which a machine's time limit
may never reach: on 2026-11-26 a GPU run cut at six minutes lost its only failure's reason."""

import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--report-now", action="store_true",
                     help="print each test's outcome and time as it ends, and a failure's traceback at once")


def pytest_configure(config):
    if config.getoption("--report-now"):
        config.pluginmanager.register(ReportNow(config), "report-now")


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
