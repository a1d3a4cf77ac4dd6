"""How a `cloudseg` process ends once its command is done (`cli.exit_now`): without the
interpreter's teardown, with everything an exit must do. CPU; each case in a new process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An exit handler, a line left in stdout's buffer (a pipe: block-buffered) and one in C's stdio's,
# an object whose __del__ only the interpreter's teardown would run (module globals are cleared
# there), then the exit, by the case's way (argv[2]).
ENDING = """
import atexit, ctypes, os, sys, threading, time
from pathlib import Path
from cloudseg.cli import exit_now
folder, case = Path(sys.argv[1]), sys.argv[2]
atexit.register(lambda: (folder / "handler").write_text("ran"))

class Teardown:
    def __del__(self):
        (folder / "teardown").write_text("ran")

kept = Teardown()
print("printed, not flushed", end="")
ctypes.CDLL(None).printf(b" and from C")
if case == "thread":  # still running when the command is done, not a daemon
    threading.Thread(target=lambda: (time.sleep(0.5), (folder / "thread").write_text("ended"))).start()
if case.startswith("closed"):  # stdout gone before its buffer is flushed, as `| head` leaves it
    sys.stdout.flush = lambda: (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe"))
if case in ("python", "closed by python"):
    sys.exit(0 if case.startswith("closed") else 3)
exit_now(0 if case.startswith("closed") else 3)
"""


def end(tmp_path: Path, case: str, **env: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    folder = tmp_path / case.replace(" ", "-")
    folder.mkdir()
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    profiled = ["-m", "cProfile", "-o", str(folder / "profile")] if case == "profiled" else []  # writes it at the end
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a user's
    done = subprocess.run([sys.executable, *profiled, str(script), str(folder), case], cwd=ROOT,
                          env={**buffered, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, timeout=120)
    return done, {path.name for path in folder.iterdir()}


def both_lines(stdout: str) -> bool:
    """Python's buffered text and C's, each once, in either order (the buffers are flushed apart)."""
    return stdout.count(" and from C") == 1 and stdout.replace(" and from C", "") == "printed, not flushed"


def test_a_command_ends_with_its_status_handlers_and_output_but_no_teardown(tmp_path):
    """The control first: ended by sys.exit, the interpreter's teardown finalizes the module's
    object (so the case below can tell). exit_now(3): status 3, the exit handler ran, the lines
    left in Python's and C's buffers came out, the teardown did not run (what saves a second a
    call). Would catch: os._exit without the exit handlers (logging's last lines, the data
    loaders' workers left behind), without flushing stdout or C's stdio, the status lost, or the
    teardown still run."""
    done, written = end(tmp_path, "python")
    assert done.returncode == 3 and written == {"handler", "teardown"}, (written, done.stderr)
    done, written = end(tmp_path, "exit_now")
    assert done.returncode == 3 and both_lines(done.stdout), done.stderr
    assert written == {"handler"}


@pytest.mark.parametrize("case, env, witness", [("thread", {}, {"thread", "teardown"}), ("profiled", {}, {"profile"}),
                                                 ("switched off", {"CLOUDSEG_FAST_EXIT": "0"}, {"teardown"})])
def test_the_interpreter_ends_as_usual_where_something_waits_for_it(tmp_path, case, env, witness):
    """A thread that is not a daemon still running when the command is done, `python -m cProfile`
    watching (it writes its profile after the command), CLOUDSEG_FAST_EXIT=0: exit_now ends the
    interpreter as usual, which waits for the thread and runs the teardown. Would catch: the thread
    cut short (its file never written), the profile never written, the switch ignored."""
    done, written = end(tmp_path, case, **env)
    assert done.returncode == (0 if case == "profiled" else 3), done.stderr  # cProfile takes the SystemExit
    assert both_lines(done.stdout) and {"handler", *witness} <= written, (written, done.stderr)


def test_a_reader_gone_before_the_flush_gives_python_s_status(tmp_path):
    """stdout's flush fails as it does when the reader of a pipe is gone (`cloudseg ... | head`):
    the status is 120, as Python's own exit gives (the control), the handlers still ran, and no
    traceback of exit_now's. Would catch: the flush's error raised out of the exit (a traceback,
    and the teardown run after all), or a status of 0 for output that was lost."""
    done, _ = end(tmp_path, "closed by python")
    assert done.returncode == 120, done.stderr
    done, written = end(tmp_path, "closed")
    assert done.returncode == 120 and written == {"handler"} and "Traceback" not in done.stderr, done.stderr
