"""`make bench`'s GPU report (benchmarks/report.py), proven on the CPU before it meets a GPU: every
part end to end at toy sizes beside the fake GPU, the GPU plan's arguments parsed by the parsers
that will read them, the budget's cut, and the pieces that turn outputs into markdown."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest
import torch

from cloudseg.cli import build_parser
from cloudseg.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = load_script("report")


def run_report(tmp_path, *options: str) -> tuple[str, str]:
    out = tmp_path / "bench" / "report.md"
    result = subprocess.run([sys.executable, "benchmarks/report.py", "--tiny", "--device", "cpu", "--out", str(out),
                             *options], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return out.read_text(), result.stdout


@pytest.mark.slow  # 80-95 s each on 2 cores: `make test-all`; the GPU plan's arguments are parsed below in make test
@pytest.mark.parametrize("parts", [("training", "memory"), ("start", "segment", "epoch", "predict")])
def test_every_part_runs_end_to_end_at_toy_sizes(parts, tmp_path):
    """Each part's commands, on the CPU beside the fake GPU, at toy sizes: every command exits 0, and
    the report holds each part's section and table. Would catch: a flag or override that a script
    or cloudseg refuses (the GPU plan passes the same ones), a part whose table is lost, the epoch
    part not finding its run or the training part's row, the predict part not finding the run.
    (Two tests, so that the suite's two workers share the minutes.)"""
    text, _ = run_report(tmp_path, "--budget-s", "900", "--parts", *parts)
    summary = text.split("\n## ")[0]
    assert "| ok |" in summary and "| exit" not in summary and "| cut at" not in summary, summary
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == list(parts)
    expected = {"training": ["| d. cloudseg eager, fp32 |", "batch-norm backend"],
                "memory": ["auto picks", "breakdown at micro-batch"],
                "start": ["cold: `python -m cloudseg train", "warm: `python -m cloudseg train",
                          "first optimizer step", "first window (loading + compile + step)"],
                "segment": ["| f. cloudseg segment, no model, overlap 0.25 (batch 4) |"],
                "epoch": ["best validation Dice", "(no comparison: training.json missing)"],  # training not run here
                "predict": ["test images with 4-flip TTA in"]}
    for part in parts:
        for snippet in expected[part]:
            assert snippet in text, (part, snippet, text)


def test_the_budget_cuts_a_part_and_leaves_out_the_rest(tmp_path):
    """A budget of 12 s: the first part's command (the training part's, about 30 s at toy sizes on 2
    cores; the segment part's now takes 10) is killed at what is left (its process group, so that
    the report goes on), and the next part is left out, saying so (a part starts only with 10 s
    left); the report is still written whole. Would catch: a part that outlives the budget (make
    bench past its window), a cut part that ends the report, a left-out part that is silently missing."""
    text, stdout = run_report(tmp_path, "--budget-s", "12", "--parts", "training", "segment")
    assert re.search(r"\| cut at 1[12] s \|", text), text
    assert "## segment\n\nleft out: the budget of 12 s is spent" in text, text
    assert "wrote" in stdout


GPU_PLAN = {"training": ("train_speed", [*report.FULL.training, "--profile"]),
            **{part: ("train_speed", [*report.FULL.training, *flags]) for part, flags in report.OPT_IN.items()},
            "segment": ("segment_speed", report.FULL.segment)}


@pytest.mark.parametrize("part", GPU_PLAN)
def test_the_gpu_plan_s_script_arguments_parse(part, monkeypatch):
    """The FULL plan's arguments of each benchmark script (the opt-in parts' too), parsed by that
    script's own parser (the device set to cpu, which is all that differs). Would catch: a typo in
    the GPU plan's flags, which the toy-size run above never passes (its sizes differ), or a flag
    a script has dropped (argparse exits)."""
    script, arguments = GPU_PLAN[part]
    monkeypatch.setattr(sys, "argv", [script, "--device", "cpu", *arguments])
    assert load_script(script).parse_args() is not None


def test_the_gpu_plan_s_cloudseg_commands_and_overrides_parse():
    """The FULL plan's `cloudseg train`, `memory` and `predict` command lines parsed by the CLI's
    parser, and their config overrides applied to their configs. Would catch: an unknown option or
    config key in the GPU plan (cloudseg refuses both)."""
    parser = build_parser()
    config, *overrides = report.FULL.train
    assert parser.parse_args(["train", "-c", config, "--out", "run", *overrides, "data.dir=d", "train.device=cuda"])
    load_config(config, [*overrides, "train.device=cuda"])
    for cap in report.FULL.caps:
        parser.parse_args(["memory", *report.FULL.memory, "train.device=cuda", "--limit-gb", str(cap)])
    load_config(report.FULL.memory[1], report.FULL.memory[2:])
    config, *overrides = report.FULL.start_train
    assert parser.parse_args(["train", "-c", config, "--out", "run", *overrides, "data.dir=d", "train.device=cuda"])
    load_config(config, [*overrides, "train.device=cuda"])
    assert parser.parse_args(["synth", "--out", "d", *report.FULL.start_synth])
    parser.parse_args(["predict", "--checkpoint", "best.pt", "--out", "s.csv", "--device", "cuda", "predict.tta=d4-lite"])


def test_markdown_keeps_tables_and_fences_the_rest():
    """Would catch: a table inside a code block (it would not render), or text lines run together
    into one paragraph."""
    output = "title line\nsecond line\n| a | b |\n|---|---|\n| 1 | 2 |\nafter\n\n"
    assert report.markdown(output) == ("```text\ntitle line\nsecond line\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |"
                                       "\n\n```text\nafter\n```")


def test_the_epoch_is_compared_with_the_step_that_training_runs(tmp_path):
    """On CUDA the compiled row of the GPU's auto precision (bf16 on an H100, fp16 before Ampere);
    figures by hand: 30 and 45 images/s against 60 are 50.0% and 75.0%. Would catch: the eager
    row or the other precision taken, or the share inverted."""
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"epoch": [1, 2], "images_per_s": [30.0, 45.0]}).to_csv(metrics, index=False)
    figures = tmp_path / "training.json"
    figures.write_text(json.dumps({"rows": {"d. cloudseg eager, bf16": [40.0, 9.0], "e. cloudseg compiled, bf16": [60.0, 9.0],
                                            "e. cloudseg compiled, fp16": [66.0, 9.0]}}))
    with mock.patch.object(report, "resolve_precision", lambda precision, device: "bf16"):
        table = report.epoch_against_step(metrics, figures, torch.device("cuda"))
    assert "| 1 | 30.00 | 60.00 (e. cloudseg compiled, bf16) | 50.0% |" in table
    assert "| 2 | 45.00 | 60.00 (e. cloudseg compiled, bf16) | 75.0% |" in table


def test_the_report_writes_the_ratio_against_the_fastest_alternative(tmp_path):
    """From the training part's JSON as train_speed.py writes it after each row, so a part cut short
    still gives the ratio it reached (here fp16's alternatives have not run). Would catch: the ratio
    lost when the part is cut (no table printed), the fastest alternative not named, a precision
    reported that has no ratio yet, or a missing JSON taken as an error of the report."""
    figures = tmp_path / "training.json"
    assert report.against_fastest(figures) == "(no ratio: the training part wrote no figures)"
    figures.write_text(json.dumps({"rows": {}, "against_fastest": {}}))
    assert report.against_fastest(figures) == "(no ratio: row e or every alternative did not run)"
    figures.write_text(json.dumps({"against_fastest": {"bf16": {
        "ratio": 1.3125, "cloudseg": 84.0, "fastest": "c2. Lightning careful, compiled (its guide), bf16",
        "fastest_images_per_s": 64.0}}}))
    assert report.against_fastest(figures) == ("**cloudseg compiled against the fastest alternative, bf16: 1.31x** (84.00 "
                                               "images/s against 64.00, c2. Lightning careful, compiled (its guide), bf16)")
