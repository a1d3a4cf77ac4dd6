"""How a `cloudseg` process ends once its command is done (`cli.exit_now`): without the
interpreter's teardown, with everything an exit must do. CPU; each case in a new process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# An exit handler, a line left in stdout's buffer (a pipe: block-buffered), an object whose __del__
# only the interpreter's teardown would run (module globals are cleared there), then the exit.
ENDING = """
import atexit, sys, threading, time
from pathlib import Path
folder = Path(sys.argv[1])
atexit.register(lambda: (folder / "handler").write_text("ran"))

class Teardown:
    def __del__(self):
        (folder / "teardown").write_text("ran")

kept = Teardown()
print("printed, not flushed", end="")
if sys.argv[2] == "thread":  # still running when the command is done, not a daemon
    threading.Thread(target=lambda: (time.sleep(0.5), (folder / "thread").write_text("ended"))).start()
if sys.argv[2] == "python":
    sys.exit(3)
from cloudseg.cli import exit_now
exit_now(3)
"""


def end(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    folder = tmp_path / how
    folder.mkdir()
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a user's
    done = subprocess.run([sys.executable, "-c", ENDING, str(folder), how], cwd=ROOT, env=buffered,
                          capture_output=True, text=True, timeout=120)
    return done, {path.name for path in folder.iterdir()}


def test_a_command_ends_with_its_status_handlers_and_output_but_no_teardown(tmp_path):
    """The control first: ended by sys.exit, the interpreter's teardown finalizes the module's
    object (so the case below can tell). exit_now(3): status 3, the exit handler ran and the
    unflushed line came out, the teardown did not run (what saves a second a call). Would catch:
    os._exit without the exit handlers (logging's last lines, the data loaders' workers left
    behind) or without flushing stdout, the status lost, or the teardown still run."""
    done, written = end(tmp_path, "python")
    assert done.returncode == 3 and written == {"handler", "teardown"}, (written, done.stderr)
    done, written = end(tmp_path, "exit_now")
    assert done.returncode == 3 and done.stdout == "printed, not flushed", done.stderr
    assert written == {"handler"}


def test_a_thread_still_running_is_waited_for(tmp_path):
    """A thread that is not a daemon, still running when the command is done: exit_now ends the
    interpreter as usual, which waits for it. Would catch: the thread cut short (its file never
    written), as os._exit would."""
    done, written = end(tmp_path, "thread")
    assert done.returncode == 3 and done.stdout == "printed, not flushed", done.stderr
    assert {"handler", "thread"} <= written
