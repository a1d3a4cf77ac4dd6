"""`make bench` on a GPU: every GPU figure the project claims, written as one markdown report
(default bench/report.md, git-ignored), training first.

Parts, in this order (a part runs while the time budget lasts; each has its own limit, is killed
with its process group at that limit, and keeps what it printed by then):

  training   benchmarks/train_speed.py: the alternatives a user could run instead (careful
             Lightning, compiled as its guide says too, the plain loop done well), cloudseg's step
             eager and compiled, bf16 and fp16, the speed-up candidates of issue #37 (rows h, e
             again, i), the compiled step's split, the checkpointing modes, the careless baselines,
             inference with 4-flip TTA, loading; its JSON (rewritten after every row) feeds the
             ratio against the fastest alternative and the epoch part
  start      `cloudseg train` (configs/fullres.yaml, one window of 16 images): the time from the
             command to its first optimizer step, by stage, with inductor's cache and the probes
             cold (fresh folders), then warm (issue #60)
  memory     `cloudseg memory --limit-gb 6` and `8` (configs/fullres.yaml): real steps under each
             cap, what checkpointing auto picks there and its peak
  segment    benchmarks/segment_speed.py: rows a-f on two 7000x18000 scenes (as on 2026-11-26),
             the writes alone (one file at a time and both at once) and the fixed cost of a call
  epoch      `cloudseg train` end to end on synthetic full-size data (2 epochs): the second epoch's
             images/s against the compiled step's
  predict    `cloudseg predict` with 4-flip TTA on that run's Kaggle-size test images, end to end
  (opt-in)   --autotune: the training part again with inductor's max-autotune row among the
             candidates, whose compile alone is minutes

Training comes first and is sized for one window with a cold inductor cache (issue #59): its
compiles run side by side first (train_speed.py --warm-compiles), its rows most telling first,
within 560 s; the default budget, 570 s, is one 10-minute window, so the other parts run where a
larger --budget-s leaves them time (what does not fit is cut from the end, never from training).
Measured before (H100, 2026-11-26): the uncompiled rows took about 150 s, a cold compile of row e
1.1 min; estimates for the rest: memory 40-60 s, segment up to 300, epoch 60, predict 20-30. Every
part compiles into the folder of inductor's cache that cloudseg's commands use
(cli.keep_compiled_graphs: ~/.cache/cloudseg/inductor unless TORCHINDUCTOR_CACHE_DIR is set), so
the parts share their compiles and a second `make bench` on the same machine compiles from it.

--tiny runs every part at toy sizes (the CPU test of this script, tests/test_bench_report.py):
the same commands and flags, only sizes and device differ, so the GPU run cannot fail on a typo.

Usage: python benchmarks/report.py [--out bench/report.md] [--budget-s 570] [--device auto|cpu|cuda]
       [--parts training start memory segment epoch predict] [--autotune] [--tiny]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from cloudseg.cli import add_device_option, keep_compiled_graphs
from cloudseg.files import atomic_path
from cloudseg.hardware import resolve_device, resolve_precision

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("training", "start", "memory", "segment", "epoch", "predict")
LIMIT_S = {"training": 560, "start": 240, "memory": 120, "segment": 300, "epoch": 150, "predict": 90,
           "autotune": 560}  # each part's own limit, within the budget left
CAPS_GB = (6, 8)
# The opt-in part: the training benchmark again, with inductor's max-autotune among issue #37's candidates.
OPT_IN = {"autotune": ["--candidates", "--max-autotune", "--no-profile"]}


@dataclass
class Sizes:
    """What each part runs on: the real sizes on a GPU, toy ones for --tiny."""

    training: list[str]
    segment: list[str]
    synth: list[str]
    train: list[str]  # the config file, then overrides
    start_synth: list[str]  # the start part's data: one window of training images in fold 0's training folds
    start_train: list[str]  # its config file, then overrides
    memory: list[str]
    caps: tuple[int, ...]


FULL = Sizes(training=["--steps", "4", "--warmup", "2"],
             segment=["--tile", "1400", "2100", "--height", "7000", "--width", "18000", "--scenes", "2",
                      "--repeat", "1", "--config", "configs/fullres.yaml"],
             synth=["--n-train", "160", "--n-test", "32"],  # Kaggle's 1400x2100: synth's default size
             train=["configs/fullres.yaml", "model.encoder_weights=null", "train.epochs=2", "data.num_workers=8",
                    "train.every_fold=false", "train.min_steps=0"],  # 160 images would train every fold, and 25 epochs
             memory=["-c", "configs/fullres.yaml", "model.encoder_weights=null"], caps=CAPS_GB,
             start_synth=["--n-train", "20", "--n-test", "1"],  # 16 in fold 0's training folds: one window
             start_train=["configs/fullres.yaml", "model.encoder_weights=null", "train.epochs=1", "data.num_workers=8",
                          "train.every_fold=false", "train.min_steps=0"])
TINY = Sizes(training=["--height", "64", "--width", "96", "--encoder", "resnet18", "--micro-batch", "2",
                       "--effective-batch", "4", "--steps", "1", "--warmup", "1", "--loader-size", "64", "96",
                       "--loader-images", "2"],
             segment=["--tile", "64", "96", "--height", "128", "--width", "192", "--scenes", "1", "--repeat", "1",
                      "--no-fixed-cost"],
             synth=["--n-train", "12", "--n-test", "4", "--height", "64", "--width", "96"],
             train=["configs/demo.yaml", "train.epochs=2", "data.num_workers=0", "data.n_folds=3",
                    "model.decoder_channels=[32,32]", "model.cls_head=false", "train.every_fold=false",
                    "train.min_steps=0"],
             memory=["-c", "configs/demo.yaml", "data.image_size=[64,96]"], caps=(),  # a cap needs CUDA
             start_synth=["--n-train", "12", "--n-test", "1", "--height", "64", "--width", "96"],
             start_train=["configs/demo.yaml", "train.epochs=1", "data.num_workers=0", "data.n_folds=3",
                          "model.decoder_channels=[32,32]", "model.cls_head=false", "train.every_fold=false",
                          "train.min_steps=0"])


@dataclass
class Report:
    """The run's state: where it writes, what is left of the budget, and the markdown so far."""

    out: Path
    work: Path
    device: torch.device
    sizes: Sizes
    deadline: float
    sections: list[str] = field(default_factory=list)
    summary: list[tuple[str, float, str]] = field(default_factory=list)
    part_deadline: float = 0.0  # the running part's own limit, however many commands it runs

    def run(self, part: str, command: list[str], limit_s: float, env: dict | None = None) -> tuple[str, str]:
        """Run `command` (python arguments) in its own process group, with `env` added to the
        environment, killed at `limit_s`; returns (its output, status: ok, "exit N" or "cut at N s").
        The output goes to a file as it comes, so a part cut short keeps what it printed."""
        log = self.work / f"{part}-{len(self.summary)}.log"
        environment = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(log, "w") as sink:
            process = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=environment, stdout=sink,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = f"exit {process.wait(timeout=limit_s)}".replace("exit 0", "ok")
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                status = f"cut at {limit_s:.0f} s"
        return log.read_text(), status

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def start_part(self, part: str) -> None:
        self.part_deadline = time.monotonic() + LIMIT_S[part]


def markdown(output: str) -> str:
    """A script's output as markdown: its pipe tables as tables, every other line in text blocks."""
    blocks, lines = [], output.rstrip().splitlines()
    for line in lines:
        kind = "table" if line.lstrip().startswith("|") else "text"
        if not blocks or blocks[-1][0] != kind:
            blocks.append((kind, []))
        blocks[-1][1].append(line)
    return "\n\n".join("\n".join(body) if kind == "table" else "```text\n" + "\n".join(body) + "\n```"
                       for kind, body in blocks if any(line.strip() for line in body))


def part_training(report: Report, extra: list[str] | None = None, name: str = "training") -> str:
    """benchmarks/train_speed.py: the table, the candidates (on by default with CUDA) and the
    compiled step's split (--profile), then the ratio against the fastest alternative; the opt-in
    part passes its own flags instead (OPT_IN)."""
    figures = report.work / f"{name}.json"
    command = ["benchmarks/train_speed.py", "--device", report.device.type, *report.sizes.training,
               "--json", str(figures), *(extra or ["--profile"])]
    return section(report, name, command) + "\n\n" + against_fastest(figures)


def against_fastest(training_json: Path) -> str:
    """The headline ratio (issue #59) in each precision, from what the training part measured
    (its JSON, rewritten after every row: a part cut short still gives the ratios it reached)."""
    if not training_json.is_file():
        return "(no ratio: the training part wrote no figures)"
    ratios = json.loads(training_json.read_text()).get("against_fastest", {})
    if not ratios:
        return "(no ratio: row e or every alternative did not run)"
    return "\n".join(f"**cloudseg compiled against the fastest alternative, {precision}: {r['ratio']:.2f}x** "
                     f"({r['cloudseg']:.2f} images/s against {r['fastest_images_per_s']:.2f}, {r['fastest']})"
                     for precision, r in ratios.items())


def part_memory(report: Report) -> str:
    caps = report.sizes.caps or (None,)
    texts = [section(report, "memory", ["-m", "cloudseg", "memory", *report.sizes.memory, f"train.device={report.device.type}",
                                        *(["--limit-gb", str(cap)] if cap else [])]) for cap in caps]
    return "\n\n".join(texts)


def part_segment(report: Report) -> str:
    return section(report, "segment", ["benchmarks/segment_speed.py", "--device", report.device.type,
                                       *report.sizes.segment])


def part_epoch(report: Report) -> str:
    """A real training run on synthetic data, then its second epoch against the step of the training part."""
    data, run = report.work / "data", report.work / "run"
    text = section(report, "epoch", ["-m", "cloudseg", "synth", "--out", str(data), *report.sizes.synth])
    config, *overrides = report.sizes.train
    text += "\n\n" + section(report, "epoch", ["-m", "cloudseg", "train", "-c", config, "--out", str(run), *overrides,
                                               f"data.dir={data}", f"train.device={report.device.type}"],
                             keep_lines=8)
    return text + "\n\n" + epoch_against_step(run / "metrics.csv", report.work / "training.json", report.device)


def epoch_against_step(metrics_csv: Path, training_json: Path, device: torch.device) -> str:
    """| epoch | images/s end to end | the step's images/s | share |, the step being the training
    part's cloudseg row that `cloudseg train` runs here (compiled on CUDA, in its auto precision)."""
    if not metrics_csv.is_file() or not training_json.is_file():
        return f"(no comparison: {metrics_csv.name if not metrics_csv.is_file() else training_json.name} missing)"
    rows = json.loads(training_json.read_text())["rows"]
    precision = resolve_precision("auto", device) if device.type == "cuda" else "fp32"
    wanted = f"e. cloudseg compiled, {precision}" if device.type == "cuda" else f"d. cloudseg eager, {precision}"
    name = next((row for row, figures in rows.items() if row.startswith(wanted) and figures), None)
    if name is None:
        return f"(no comparison: the training part has no row '{wanted}')"
    step = rows[name][0]
    lines = ["| epoch | images/s end to end | step images/s | share of the step |", "|---|---|---|---|"]
    for epoch, rate in pd.read_csv(metrics_csv)[["epoch", "images_per_s"]].itertuples(index=False):
        lines.append(f"| {epoch} | {rate:.2f} | {step:.2f} ({name}) | {rate / step:.1%} |")
    return "\n".join(lines)


def part_start(report: Report) -> str:
    """How long `cloudseg train` (configs/fullres.yaml on a GPU) takes from the command to its first
    optimizer step, by stage (its log's line, cloudseg/startclock.py): first with an empty folder of
    inductor's cache and no remembered probes (cold), then again with what the first left (warm)."""
    data = report.work / "start-data"
    text = section(report, "start", ["-m", "cloudseg", "synth", "--out", str(data), *report.sizes.start_synth])
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(report.work / "start-inductor"),
              "CLOUDSEG_PROBE_CACHE": str(report.work / "start-probes.json")}
    config, *overrides = report.sizes.start_train
    for when in ("cold", "warm"):
        text += f"\n\n{when}: " + section(report, "start", [
            "-m", "cloudseg", "train", "-c", config, "--out", str(report.work / f"start-{when}"), *overrides,
            f"data.dir={data}", f"train.device={report.device.type}"], env=caches, matching="first optimizer step")
    return text


def part_predict(report: Report) -> str:
    """`cloudseg predict` with 4-flip TTA on the epoch part's run, timed end to end (start-up,
    loading, compiling included)."""
    checkpoint = report.work / "run" / "best.pt"
    if not checkpoint.is_file():
        return "(skipped: the epoch part left no best.pt)"
    test_images = len(list((report.work / "data" / "test_images").glob("*.jpg")))
    start = time.monotonic()
    text = section(report, "predict", ["-m", "cloudseg", "predict", "--checkpoint", str(checkpoint),
                                       "--out", str(report.work / "submission.csv"), "--device", report.device.type,
                                       "predict.tta=d4-lite"], keep_lines=6)
    seconds = time.monotonic() - start
    if report.summary[-1][2] != "ok":
        return text
    return text + (f"\n\n{test_images} test images with 4-flip TTA in {seconds:.1f} s end to end: "
                   f"{test_images / seconds:.2f} images/s (a new process: imports, loading and compiling included)")


def section(report: Report, part: str, command: list[str], keep_lines: int | None = None, env: dict | None = None,
            matching: str | None = None) -> str:
    """Runs one command of `part` within its limit and the budget, with `env` added to its
    environment; its output as markdown. `keep_lines`: only the output's last lines (a training
    run's log); `matching`: only the lines that hold it."""
    limit = min(report.part_deadline - time.monotonic(), report.left_s())
    if limit < 1:
        return f"`{command[0]} {command[1]}`: left out, the part's {LIMIT_S[part]} s are spent"
    start = time.monotonic()
    output, status = report.run(part, command, limit, env)
    seconds = time.monotonic() - start
    report.summary.append((" ".join(command[:3]), seconds, status))
    if matching:
        output = "\n".join(line for line in output.splitlines() if matching in line)
    if keep_lines:
        output = "\n".join(output.splitlines()[-keep_lines:])
    shown = " ".join(["python", *command]).replace(str(report.work), "WORK")
    return f"`{shown}`: {status}, {seconds:.1f} s\n\n{markdown(output)}"


PART_FUNCTIONS = {"training": part_training, "start": part_start, "memory": part_memory, "segment": part_segment,
                  "epoch": part_epoch,
                  "predict": part_predict}


def header(device: torch.device, budget_s: float) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cudnn = torch.backends.cudnn.version()
        what = f"{name}, CUDA {torch.version.cuda}, cuDNN {cudnn}"
    else:
        what = f"CPU ({platform.processor() or platform.machine()})"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (f"# cloudseg benchmark report\n\n{what}; {os.cpu_count()} CPU cores; torch {torch.__version__}; "
            f"commit {commit or 'unknown'}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"budget {budget_s:.0f} s")


def write(report: Report, head: str) -> None:
    """The report as it stands: written after every part, so a run cut short leaves a valid one."""
    rows = ["| command | seconds | status |", "|---|---|---|",
            *(f"| `{command}` | {seconds:.1f} | {status} |" for command, seconds, status in report.summary)]
    text = "\n\n".join([head, "\n".join(rows), *report.sections]) + "\n"
    with atomic_path(report.out) as tmp:
        tmp.write_text(text)


def main() -> None:
    args = parse_args()
    keep_compiled_graphs()  # the parts' processes inherit cloudseg's folder of inductor's cache
    device = resolve_device(args.device)
    parts = [*args.parts, *(["autotune"] if args.autotune else [])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / "work"  # this script's own scratch folder: emptied first
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    report = Report(args.out, work, device, TINY if args.tiny else FULL, time.monotonic() + args.budget_s)
    head = header(device, args.budget_s)
    for part in parts:
        report.start_part(part)
        if report.left_s() < 10:
            text = f"left out: the budget of {args.budget_s:.0f} s is spent"
        elif part in OPT_IN:
            text = part_training(report, OPT_IN[part], part)
        else:
            text = PART_FUNCTIONS[part](report)
        report.sections.append(f"## {part}\n\n{text}")
        write(report, head)
        print(f"report: {part} done, {report.left_s():.0f} s of the budget left", flush=True)
    print(f"wrote {args.out}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "report.md")
    parser.add_argument("--budget-s", type=float, default=570,
                        help="wall-clock seconds for all parts together (default: one 10-minute window, training first)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--autotune", action="store_true", help="also inductor's max-autotune row (minutes of compile)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: the CPU test of this script")
    add_device_option(parser, "the benchmarks run")
    return parser.parse_args()


if __name__ == "__main__":
    main()
