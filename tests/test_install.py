"""`make install TORCH_BACKEND=...`: what the install step would run (make -n runs nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def planned_install(venv: Path, *args: str) -> str:
    """The commands `make install` would run, for a .venv at `venv`."""
    return subprocess.run(["make", "-n", "install", f"VENV={venv}", *args], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_default_install_keeps_the_pinned_build(tmp_path):
    """Catches the knob changing today's install when it is not used."""
    plan = planned_install(tmp_path / "venv")
    assert "-r requirements.txt -e '.[dev,geo]'" in plan and "--torch-backend" not in plan


@pytest.mark.parametrize("backend", ["", "cu126"])
def test_the_install_compiles_bytecode(tmp_path, backend):
    """Catches an install that leaves bytecode to the first import (uv's default): where Python
    may not write it, every new process compiles torch's sources again."""
    installs = [line for line in planned_install(tmp_path / "venv", f"TORCH_BACKEND={backend}").splitlines()
                if " pip install " in line]
    assert installs and all("--compile-bytecode" in line for line in installs)


def test_a_throwaway_install_can_leave_the_bytecode_out(tmp_path):
    """Catches BYTECODE= not reaching uv: tests/test_kaggle_data.py's throwaway venv would compile
    torch's modules again (about 35 s of the suite on 2 cores)."""
    installs = [line for line in planned_install(tmp_path / "venv", "BYTECODE=").splitlines() if " pip install " in line]
    assert installs and not any("--compile-bytecode" in line for line in installs)


def test_every_uv_install_compiles_bytecode():
    """Catches a target (test-oldest, the kaggle or lab extras) installing with uv directly, which
    would leave its packages' bytecode to the first import."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    recipes = [line for line in lines if not line.startswith("UV_PIP ")]  # all but UV_PIP's own definition
    assert any("$(UV_PIP)" in line for line in recipes)
    assert not [line for line in recipes if "$(UV) pip install" in line]


def test_a_backend_installs_torch_from_it_without_the_pins_of_the_default_build(tmp_path):
    """Catches the backend not reaching uv, and a filter that keeps the default build's torch or
    CUDA libraries (uv would then ask that backend for torch==<pinned>, or install both CUDAs) or
    drops the other pins."""
    venv = tmp_path / "venv"
    venv.mkdir()
    plan = planned_install(venv, "TORCH_BACKEND=cu126")
    assert f"--torch-backend cu126 -r {venv}/requirements-without-torch.txt -e '.[dev,geo]'" in plan
    filtering = next(line for line in plan.splitlines() if line.startswith("grep "))
    subprocess.run(filtering, shell=True, cwd=ROOT, check=True)
    kept = set(re.findall(r"^([a-z0-9-]+)==", (venv / "requirements-without-torch.txt").read_text(), re.M))
    pinned = set(re.findall(r"^([a-z0-9-]+)==", (ROOT / "requirements.txt").read_text(), re.M))
    dropped = pinned - kept
    assert {"torch", "torchvision"} <= dropped
    assert all(re.match(r"torch$|torchvision$|triton$|nvidia-|cuda-", name) for name in dropped)
    assert {"numpy", "segmentation-models-pytorch", "albumentations", "timm"} <= kept


def test_the_backend_is_remembered_by_later_targets(tmp_path):
    """After `make install TORCH_BACKEND=cu126`, a plain `make test` must not reinstall the
    default build over it. Catches a stamp that ignores the remembered backend."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".torch-backend").write_text("cu126\n")
    assert "--torch-backend cu126" in planned_install(venv)
    assert "--torch-backend" not in planned_install(venv, "TORCH_BACKEND=")
