"""`make test-gpu`'s report (tests/report_now.py), on the CPU: a run cut short still says why."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CUT_SHORT = '''
import time
from pathlib import Path

def test_records_a_figure(record_property):
    record_property("distance", 0.25)

def test_fails_first():
    assert 1 == 2, "planted failure"

def test_runs_past_the_limit():
    Path("hanging").touch()
    time.sleep(120)
'''


def output_when_cut(tmp_path, *options: str) -> str:
    """Runs CUT_SHORT's two tests, killed a second after the second one has started (as a lent
    machine's time limit kills a run): what the run had printed by then."""
    (tmp_path / "test_cut_short.py").write_text(CUT_SHORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options,
                            "test_cut_short.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "hanging").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    run.kill()
    return run.communicate()[0]


def test_a_failure_is_reported_before_the_run_is_cut(tmp_path):
    """With `-p tests.report_now --report-now` (make test-gpu), the failed test's traceback and
    its time are printed before the next test ends, and a passed test's recorded figures on its
    line. Would catch: the traceback left to pytest's end-of-session summary, which a killed run
    never reaches, and figures (the resume test's distances) seen only when a test fails."""
    out = output_when_cut(tmp_path, "-p", "tests.report_now", "--report-now")
    assert "AssertionError: planted failure" in out, out
    assert "[now] test_cut_short.py::test_fails_first failed" in out, out
    assert "test_cut_short.py::test_records_a_figure passed" in out and " distance=0.25" in out, out


def test_the_control_without_the_plugin_a_cut_run_loses_the_reason(tmp_path):
    """The same run without the plugin: the reason is lost. Shows that the test above can fail."""
    out = output_when_cut(tmp_path)
    assert "planted failure" not in out, out


PROFILED = '''
import time
from pathlib import Path

def test_slow():
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        spin_here()

def spin_here():
    sum(range(1000))

def test_fast():
    pass

def test_killed_while_slow():
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        spin_until_killed()
    Path("slow by now").touch()
    while True:
        spin_until_killed()

def spin_until_killed():
    sum(range(1000))
'''


def test_profile_slow_keeps_the_profile_of_slow_tests_alone_even_when_killed(tmp_path):
    """`--profile-slow DIR` (make test-gpu in benchmarks/gpu_window.sh): each test slower than
    --profile-slow-s leaves its profile, naming the function it spent its time in, also the one a
    time limit's SIGTERM kills; the fast one leaves none. Would catch: no profile written, one per
    test, a profile of the wrong phase (the setup, which spins nothing), or the killed test's lost
    (the cut 70-s test is the one to explain)."""
    (tmp_path / "test_profiled.py").write_text(PROFILED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.report_now",
                            "--profile-slow", "profiles", "--profile-slow-s", "0.3", "test_profiled.py"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "slow by now").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    run.terminate()
    run.communicate()
    profiles = {path.name.rsplit("-", 1)[0]: path.read_text() for path in (tmp_path / "profiles").iterdir()}
    assert sorted(profiles) == ["test_profiled.py_test_killed_while_slow", "test_profiled.py_test_slow"]
    assert profiles["test_profiled.py_test_slow"].startswith("test_profiled.py::test_slow: ")
    assert "(spin_here)" in profiles["test_profiled.py_test_slow"]
    assert "(spin_until_killed)" in profiles["test_profiled.py_test_killed_while_slow"]
