"""benchmarks/demo_spread.py: the demo's outcome over training seeds, datasets and thread counts."""

import json
import shlex
import subprocess
import sys

import pandas as pd
import pytest

from benchmarks.demo_spread import makefile_synth_args, spread, with_seed
from cloudseg.config import load_config
from cloudseg.data import make_folds, read_train_csv
from cloudseg.metrics import evaluate_submission


def test_synth_args_are_the_ones_make_passes():
    """make itself expands SYNTH_ARGS (the reference). Would catch: a regex that reads another line,
    keeps the `?=` or a comment, or splits the value wrongly."""
    expanded = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-synth: ; @echo $(SYNTH_ARGS)",
                               "print-synth"], capture_output=True, text=True, check=True).stdout
    assert makefile_synth_args() == shlex.split(expanded)


def test_with_seed_replaces_or_adds_the_seed():
    """Would catch: a second --seed appended after the old one (argparse keeps the last, but the
    log would name both), the seed's value left behind, or other arguments dropped."""
    assert with_seed(["--n-train", "8", "--seed", "0", "--height", "64"], 3) == [
        "--n-train", "8", "--height", "64", "--seed", "3"]
    assert with_seed(["--n-train", "8"], 1) == ["--n-train", "8", "--seed", "1"]


def test_spread_by_hand():
    """Valid 0.9, 0.8, 0.95: mean 0.8833, spread 0.15, farthest from the mean 0.0833 (0.8).
    Would catch: a spread taken as a standard deviation, min and max swapped, or figures mixed up."""
    results = [{"valid_tuned": v, "test": t} for v, t in ((0.9, 0.7), (0.8, 0.72), (0.95, 0.74))]
    summary = spread(results)
    assert summary["valid_tuned"] == pytest.approx({"mean": 2.65 / 3, "min": 0.8, "max": 0.95, "spread": 0.15,
                                                    "off_mean": 2.65 / 3 - 0.8})
    assert summary["test"] == pytest.approx({"mean": 0.72, "min": 0.7, "max": 0.74, "spread": 0.04,
                                             "off_mean": 0.02})


@pytest.mark.slow  # two trainings and predictions: run with make test-all
def test_script_runs_each_seed_on_the_folds_make_train_uses(tmp_path):
    """Two seeds, one epoch, tiny images, through the real commands, on the CPU. Would catch: the
    seed or the device not reaching the run, folds made with the training seed (each seed would
    hold out other images), and a test Dice that is not the submission's score."""
    out = tmp_path / "spread"
    printed = subprocess.run(
        [sys.executable, "benchmarks/demo_spread.py", "--seeds", "5,6", "--threads", "1", "--out", str(out),
         "--synth-args", "--n-train 20 --n-test 4 --height 64 --width 96", "--json", str(tmp_path / "s.json"),
         "--set", "train.epochs=1", "--set", "train.min_steps=0", "--set", "data.num_workers=0", "--device", "cpu"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    assert any(line.startswith("spread") for line in printed.splitlines())
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["seed"] for r in results] == [5, 6]
    configs = [load_config(out / f"d0-t1-s{seed}" / "config.yaml") for seed in (5, 6)]
    assert [config.seed for config in configs] == [5, 6] and {config.train.device for config in configs} == {"cpu"}
    assert "--device cpu" in (out / "d0-t1-s6.log").read_text()  # predict too
    demo_seed = load_config("configs/demo.yaml").seed
    labels = read_train_csv(out / "data0")
    saved = pd.read_csv(out / "data0" / "folds.csv", index_col="image_id")["fold"].to_numpy()
    assert (saved == make_folds(labels, 5, demo_seed).to_numpy()).all()
    assert (saved != make_folds(labels, 5, 5).to_numpy()).any()  # the first seed's folds would differ
    assert results[1]["test"] == evaluate_submission(out / "d0-t1-s6" / "submission.csv",
                                                     out / "data0" / "test_solution.csv")["dice"]
