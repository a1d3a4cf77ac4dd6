"""The benchmark scripts stay runnable at a tiny size (their figures are not checked): the speed
scripts on the device they pick (the GPU where there is one), the recipes on the CPU."""

import json
import subprocess
import sys

import pytest

from cloudseg.config import load_config


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=True).stdout


def test_training_benchmark_prints_its_table(tmp_path):
    out = run("benchmarks/train_speed.py", "--height", "64", "--width", "96", "--encoder", "resnet18",
              "--micro-batch", "2", "--effective-batch", "4", "--steps", "1", "--warmup", "1",
              "--loader-size", "64", "96", "--loader-images", "2", "--json", str(tmp_path / "b.json"))
    for row in ("a. textbook loop", "b. cloudseg default", "c. cloudseg checkpointing=full", "d. Lightning"):
        assert row in out
    assert "e. data loading:" in out and "4-flip TTA" in out and "3698 test images" in out
    figures = json.loads((tmp_path / "b.json").read_text())
    assert figures["rows"]["a. textbook loop (fp32)"][0] > 0 and figures["loader_samples_per_s_per_core"] > 0


def test_rle_benchmark_prints_its_table():
    out = run("benchmarks/rle_speed.py", "--repeat", "2")
    assert "decode ms" in out and "4 boxes" in out


def test_tuning_benchmark_prints_its_table():
    out = run("benchmarks/tune_speed.py", "--images", "4")
    assert "total" in out and "Sugar" in out


@pytest.mark.slow  # four trainings and predictions: run with make test-all
def test_recipes_benchmark_prints_one_row_per_option(tmp_path):
    """Catches an option that is not trained or not scored (a missing row or a Dice outside [0, 1]).
    On the CPU, as the demo it benchmarks (eight cloudseg processes: on a GPU machine each would
    start CUDA on a GPU that every test worker shares)."""
    out = run("benchmarks/recipes.py", "--epochs", "1", "--n-train", "12", "--n-test", "4", "--size", "64", "96",
              "--device", "cpu", "--out", str(tmp_path / "r"))
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-4:]}
    assert {load_config(tmp_path / "r" / option / "config.yaml").train.device for option in rows} == {"cpu"}
    assert set(rows) == {"unet", "ema", "fpn", "unetplusplus"}
    assert all(0 <= float(row[3]) <= 1 and 0 <= float(row[4]) <= 1 for row in rows.values())
