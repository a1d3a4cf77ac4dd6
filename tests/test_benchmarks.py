"""The benchmark scripts stay runnable at a tiny size (their figures are not checked), each on the
CPU, named: the rows and defaults that the tests expect are the CPU's (on a GPU the training
benchmark prints bf16 and fp16 rows instead of fp32 ones)."""

import json
import subprocess
import sys

import pytest

from cloudseg.config import load_config


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=True).stdout


TRAIN_SPEED = ["benchmarks/train_speed.py", "--device", "cpu", "--height", "64", "--width", "96", "--encoder", "resnet18",
               "--micro-batch", "2", "--effective-batch", "4", "--steps", "1", "--warmup", "1",
               "--loader-size", "64", "96", "--loader-images", "2"]
ROWS = ("a. textbook loop", "b. Lightning at its defaults", "c. Lightning careful", "d. cloudseg eager, fp32",
        "e. cloudseg compiled, fp32", "f. cloudseg eager, fp32, checkpointing=encoder",
        "f. cloudseg eager, fp32, checkpointing=full", "g. cloudseg compiled, fp32, checkpointing=encoder",
        "g. cloudseg compiled, fp32, checkpointing=full")


def test_training_benchmark_prints_its_table(tmp_path):
    out = run(*TRAIN_SPEED, "--no-compiled", "--profile", "--json", str(tmp_path / "b.json"))
    for row in ROWS:
        assert f"| {row}" in out
    assert "| e. cloudseg compiled, fp32 | skipped |" in out  # --no-compiled
    assert "data loading:" in out and "4-flip TTA, eager" in out and "3698 test images" in out
    assert "4-flip TTA, compiled" not in out  # --no-compiled
    assert "MFU:" in out and "targets" in out and "checkpointing=full, eager: time per image" in out
    assert "batch-norm backend in training: fp32 " in out and "fp32, eager, ms per image (CPU self time)" in out
    assert "batch norm" in out and "optimizer step" in out and "fp32, compiled, ms per image" not in out
    figures = json.loads((tmp_path / "b.json").read_text())
    assert figures["rows"]["a. textbook loop (fp32)"][0] > 0 and figures["loader_samples_per_s_per_core"] > 0
    assert figures["flops_per_image"] > 0 and figures["profiles"]["fp32"]["batch_norm_ms_per_image"] > 0


@pytest.mark.slow  # four compiles of a resnet18 UNet, even with aot_eager: minutes on 2 cores
def test_training_benchmark_runs_its_compiled_rows(tmp_path):
    """Would catch: a compiled row skipped, the compiled step not profiled (issue #32's profile),
    or its trace not written."""
    out = run(*TRAIN_SPEED, "--compiled", "--backend", "aot_eager", "--profile", "--trace", str(tmp_path))
    for row in ROWS[4:]:
        assert f"| {row} | skipped" not in out and f"| {row} |" in out
    assert "compiled (aot_eager), fp32, checkpointing=full: first window" in out
    assert "4-flip TTA, compiled:" in out and "fp32, compiled, ms per image (CPU self time)" in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fp32-compiled.json", "fp32-eager.json"]


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


SEGMENT_SPEED = ["benchmarks/segment_speed.py", "--scenes", "1", "--height", "128", "--width", "192", "--tile", "64", "96",
                 "--repeat", "1", "--device", "cpu"]


def test_segment_benchmark_prints_its_table():
    """Would catch: a row missing, the pipeline without a model among them."""
    out = run(*SEGMENT_SPEED, "--no-fixed-cost")
    for row in ("a. naive loop (batch 1, no overlap)", "b. cloudseg segment, overlap 0.0 (batch 4)",
                "c. cloudseg segment, overlap 0.25 (batch 4)", "d. naive loop, no model (batch 1, no overlap)",
                "e. cloudseg segment, no model, overlap 0.0 (batch 4)", "f. cloudseg segment, no model, overlap 0.25 (batch 4)"):
        assert f"| {row} |" in out
    assert "scenes/s | megapixels/s" in out and "fixed cost" not in out


@pytest.mark.slow  # three new processes that import cloudseg: about 45 s on 2 cores
def test_segment_benchmark_reports_a_call_s_fixed_cost():
    out = run(*SEGMENT_SPEED)
    assert "fixed cost of a call" in out and "a second call" in out and "of which imports" in out


@pytest.mark.slow  # four new processes that import cloudseg's commands
def test_import_benchmark_prints_its_table():
    """Would catch: a row missing, a heavy module not reported (segment's --help loads no torch)."""
    out = run("benchmarks/import_time.py", "--repeat", "1")
    for row in ("cloudseg segment --help", "import cloudseg.segment", "import cloudseg.predict", "import cloudseg.train"):
        assert f"| {row} |" in out
    assert "| cloudseg segment --help | " in out and "| none |" in out and "tensorboard" in out
