"""The Makefile's choices, read with `make -n` (print the commands, run none) on a fake runs/ tree."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make_dry_run(directory: Path, *args: str) -> str:
    result = subprocess.run(["make", "-f", str(MAKEFILE), "-C", str(directory), "--no-print-directory", "-n", *args],
                            capture_output=True, text=True, check=True)
    return result.stdout


@pytest.fixture
def project(tmp_path):
    """A folder with the install stamps (so `make predict` has nothing to install) and runs/
    holding, oldest to newest: two finished runs, a run still in its first epoch (last.pt only),
    make cv's folder (best.pt only inside its folds) and the notebooks' folder (no checkpoint)."""
    for name in ("pyproject.toml", "requirements.txt", ".tools/bin/uv", ".venv/.installed"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    runs = {"20240101-000000": ["best.pt"], "20240102-000000": ["best.pt", "last.pt"],
            "20240103-000000": ["last.pt"], "cv": ["fold0/best.pt"], "notebooks": []}
    for age, (run, files) in enumerate(reversed(runs.items())):
        for file in files:
            (tmp_path / "runs" / run / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "runs" / run / file).touch()
        (tmp_path / "runs" / run).mkdir(parents=True, exist_ok=True)
        os.utime(tmp_path / "runs" / run, (1e9 - 3600 * age, 1e9 - 3600 * age))  # set after its files
    return tmp_path


def test_predict_takes_the_newest_run_that_holds_a_best_checkpoint(project):
    """Catches taking the newest run folder whatever it holds (runs/notebooks, runs/cv or an
    unfinished run: the Makefile did), descending into make cv's folds, or ignoring RUN=."""
    commands = make_dry_run(project, "predict")
    assert "cloudseg predict --checkpoint runs/20240102-000000/best.pt" in commands
    commands = make_dry_run(project, "predict", "RUN=runs/20240101-000000")
    assert "cloudseg predict --checkpoint runs/20240101-000000/best.pt" in commands


def test_predict_without_any_best_checkpoint_names_the_problem(project):
    """Catches handing cloudseg an empty or made-up checkpoint path."""
    for best in project.glob("runs/2024*/best.pt"):
        best.unlink()
    result = subprocess.run(["make", "-f", str(MAKEFILE), "-C", str(project), "--no-print-directory", "predict"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "make predict: no run with best.pt" in result.stdout


@pytest.mark.parametrize("target", ["tune", "submit"])
def test_tune_and_submit_without_folds_name_the_problem(project, target):
    """Catches `make tune` handing cloudseg tune no run (argparse's usage and 'the following
    arguments are required: RUN_DIR')."""
    result = subprocess.run(["make", "-f", str(MAKEFILE), "-C", str(project), "--no-print-directory", target,
                             "CV_DIR=runs/none"], capture_output=True, text=True)
    assert result.returncode != 0 and f"make {target}: no runs/none/fold" in result.stdout
    assert "usage:" not in result.stdout + result.stderr


@pytest.mark.parametrize("target", ["test-gpu", "test-gpu-all"])
def test_test_gpu_without_cuda_says_so_and_fails(project, target):
    """CUDA hidden from PyTorch (on any machine). Catches `make test-gpu` (or its whole tier)
    running pytest anyway, where every gpu test is skipped and the run "passes" having checked nothing."""
    result = subprocess.run(["make", "-f", str(MAKEFILE), "-C", str(project), "--no-print-directory", target,
                             f"PY={sys.executable}"], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode != 0 and "make test-gpu: needs a CUDA GPU" in result.stdout
    assert "pytest" not in result.stdout + result.stderr
