"""cloudseg reaches the network only when asked (make data, cloudseg download): importing it and
running a command must not, on machines without any (GPU clusters, Kaggle kernels). CPU only."""

import os
import subprocess
import sys

# Every module of the package imported, then a command run, with each socket connection or name
# look-up recorded through Python's audit hooks (and refused, so nothing leaves the machine).
PROBE = """
import pkgutil, socket, sys
tried = []
def audit(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        tried.append((event, str(args[1] if event == "socket.connect" else args[0])))
        raise OSError("no network in this test")
sys.addaudithook(audit)
import cloudseg, cloudseg.cli
for module in pkgutil.iter_modules(cloudseg.__path__):
    if module.name not in ("__main__",):
        __import__(f"cloudseg.{module.name}")
try:
    cloudseg.cli.main(["doctor"])
except SystemExit:
    pass
print("TRIED", tried)
"""


def test_importing_cloudseg_and_running_a_command_reach_no_network():
    """Would catch: albumentations' check of its newest version at import (so until issue 30:
    up to 2 s and a warning on every command of an offline machine), or any other module that
    looks a host up when imported. The user's own NO_ALBUMENTATIONS_UPDATE is removed first."""
    env = {key: value for key, value in os.environ.items() if key != "NO_ALBUMENTATIONS_UPDATE"}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TRIED []" in result.stdout, result.stdout[-2000:]
    assert "Error fetching version info" not in result.stderr
