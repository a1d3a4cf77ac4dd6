"""Does the two-command demo path beat the all-empty submission on data cloudseg never saw?

For each variant of benchmarks/kaggle_like.py (textures, label shapes, sizes and label
frequencies unlike `cloudseg synth`): generate a dataset, run exactly what a user runs

    cloudseg train -c configs/demo.yaml --out RUN data.dir=DATA train.epochs=6
    cloudseg predict --checkpoint RUN/best.pt --out default.csv

and score the submission against the test truth, beside three references: the all-empty
submission, `predict --postprocess none` (the config's untuned rule), an explicit `cloudseg
tune RUN` + `predict --postprocess FILE`, and the one-fold path: fold 0's model with its own rule,
what `train.every_fold=false` trains (where the run trained one fold, the default itself; on small
data the default trains every fold and predicts with their ensemble). On the noisy-label variants (`--variants
noisy`) also the box oracle (the true regions' boxes against the crowd's labels: the most a
model can hope for) and the share of the margin captured, (default − all-empty) / (box oracle
− all-empty). Every variant's data, run directory, submissions and command logs stay under
--out for inspection. `--retune` reuses the runs an earlier study left under --out: each
run's rule is tuned again by today's code (an every-fold run's in-sample probabilities made again,
`cloudseg oof --checkpoint RUN/best.pt`, then `cloudseg tune RUN --out RUN/postprocess.json`: what
training's last steps write) and the submissions made again, without training.

`--epochs` sets train.epochs; train.min_steps (200 by default) still raises it on small data, as
it does for a user (64 images: 16 epochs); `--set train.min_steps=0` trains exactly --epochs.

Two studies side by side on one machine: give each `OMP_NUM_THREADS` = cores / 2 (on 2 cores, two
trainings of 2 threads each ran 10× slower than two of 1 thread, 2026-11-25).

Usage: python benchmarks/robustness.py [--variants clean|noisy|all|a,b] [--n-train 64] [--n-test 16]
       [--epochs 6] [--out DIR] [--json FILE] [--size H W] [--seed-offset K] [--set key=value ...]
       [--device auto|cpu|cuda] [--retune]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from cloudseg.cli import add_device_option
from cloudseg.config import load_config
from cloudseg.data import read_label_csv, read_train_csv
from cloudseg.every_fold import in_sample_rule, is_every_fold_run
from cloudseg.metrics import evaluate_submission
from cloudseg.oof import IN_SAMPLE_FILE
from cloudseg.synth import TEST_SOLUTION_CSV
from cloudseg.task import ID_COLUMN, LABELS, RLE_COLUMN, SAMPLE_SUBMISSION_CSV
from cloudseg.units import human_duration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kaggle_like import BOX_ORACLE_CSV, VARIANTS, generate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
MARKER = ".robustness"  # marks a variant folder this script wrote, which a rerun may replace
COLUMNS = ("all-empty", "untuned", "one fold", "default", "explicit tune")
GROUPS = {"clean": [name for name, v in VARIANTS.items() if v.labellers is None],
          "noisy": [name for name, v in VARIANTS.items() if v.labellers is not None], "all": list(VARIANTS)}


def cloudseg(*args: str, log: Path, env: dict[str, str] | None = None) -> None:
    """Run `python -m cloudseg ARGS` as a user would (`env`: variables set on top of ours); its output
    goes to `log`; a failure says where."""
    with open(log, "a") as out:
        out.write(f"$ {''.join(f'{k}={v} ' for k, v in (env or {}).items())}cloudseg {' '.join(args)}\n")
        out.flush()
        done = subprocess.run([sys.executable, "-m", "cloudseg", *args], stdout=out, stderr=subprocess.STDOUT,
                              cwd=REPO, env={**os.environ, **(env or {})})
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"cloudseg {args[0]} exited with {done.returncode}; see {log}:\n{tail}")


def machine() -> str:
    """The machine line of a benchmark's header: processor, cores, and the load now (the CPU is shared)."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), load {os.getloadavg()[0]:.1f}"


def empty_folder(out: str | None, prefix: str) -> Path:
    """`out` (made when missing) or a new folder under /tmp; one with anything in it is refused."""
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise SystemExit(f"{root} is not empty; pick a new --out")
    return root


def fresh_folder(folder: Path) -> Path:
    """An empty folder; one left by an earlier run of this script is replaced, anything else refused."""
    if folder.exists():
        if not (folder / MARKER).exists():
            raise FileExistsError(f"{folder} exists and was not written by this script; pick another --out")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).touch()
    return folder


def write_all_empty(data_dir: Path, out: Path) -> Path:
    """The submission that predicts no cloud anywhere: every row of sample_submission.csv, empty."""
    rows = pd.read_csv(data_dir / SAMPLE_SUBMISSION_CSV, usecols=[ID_COLUMN])
    rows[RLE_COLUMN] = ""
    rows.to_csv(out, index=False)
    return out


def label_shares(table: pd.DataFrame) -> list[float]:
    """Share of images with each class (LABELS order) in a table of RLE strings per image."""
    return [float(share) for share in table[list(LABELS)].ne("").mean()]


def study_variant(name: str, variant, args, root: Path) -> dict:
    """Generate one variant's data, train, predict four ways and score each; return the figures."""
    started = time.perf_counter()
    folder = root / name
    data, run, log = folder / "data", folder / "run", folder / "commands.log"
    if args.retune:
        if not (run / "best.pt").is_file():
            raise FileNotFoundError(f"{run}/best.pt: --retune needs the runs of an earlier study under --out")
        if is_every_fold_run(run) and in_sample_rule(load_config(run / "config.yaml")):  # as training's last step
            (run / IN_SAMPLE_FILE).unlink(missing_ok=True)  # made again by today's code
            cloudseg("oof", "--checkpoint", str(run / "best.pt"), "--device", args.device, log=log)
        cloudseg("tune", str(run), "--out", str(run / "postprocess.json"), log=log)
    else:
        fresh_folder(folder)
        generate(variant, data, args.n_train, args.n_test)
        cloudseg("train", "-c", str(DEMO_CONFIG), "--out", str(run), f"data.dir={data}",
                 f"train.epochs={args.epochs}", f"train.device={args.device}", *args.set, log=log)
    train_seconds = time.perf_counter() - started
    best, device = f"{run}/best.pt", ("--device", args.device)
    cloudseg("predict", "--checkpoint", best, "--out", str(folder / "default.csv"), *device, log=log)
    cloudseg("predict", "--checkpoint", best, "--out", str(folder / "untuned.csv"), "--postprocess", "none", *device,
             log=log)
    folds = sorted(run.glob("fold*/")) or [run]  # an every-fold run (train.every_fold), or one fold
    cloudseg("tune", str(run), "--out", str(folder / "tuned.json"), log=log)  # an every-fold run: its folds' pooled
    cloudseg("predict", "--checkpoint", best, "--out", str(folder / "explicit.csv"),
             "--postprocess", str(folder / "tuned.json"), *device, log=log)
    # the one-fold path: fold 0's model and its own rule, what train.every_fold=false would have trained
    cloudseg("predict", "--checkpoint", str(folds[0] / "best.pt"), "--out", str(folder / "one_fold.csv"), *device,
             log=log)
    submissions = dict(zip(COLUMNS, (write_all_empty(data, folder / "all_empty.csv"), folder / "untuned.csv",
                                     folder / "one_fold.csv", folder / "default.csv", folder / "explicit.csv")))
    if (data / BOX_ORACLE_CSV).is_file():
        submissions["box oracle"] = data / BOX_ORACLE_CSV
    truth = data / TEST_SOLUTION_CSV
    scores = {column: evaluate_submission(path, truth) for column, path in submissions.items()}
    return {
        "variant": name, "size": list(variant.size), "frequencies": list(variant.frequencies),
        "train_label_shares": label_shares(read_train_csv(data)),
        "test_label_shares": label_shares(read_label_csv(truth)),
        "scores": scores, "margin": scores["default"]["dice"] - scores["all-empty"]["dice"],
        "captured": captured(scores["default"]["dice"], scores),
        "captured_one_fold": captured(scores["one fold"]["dice"], scores), "folds": len(folds),
        "rule": json.loads((run / "postprocess.json").read_text()),
        "train_seconds": train_seconds, "seconds": time.perf_counter() - started, "folder": str(folder),
    }


def captured(dice: float, scores: dict) -> float:
    """The share of the margin a submission scoring `dice` captures, (dice − all-empty) / (box
    oracle − all-empty); NaN without a box oracle (clean labels) or without a margin to capture."""
    if "box oracle" not in scores:
        return float("nan")
    room = scores["box oracle"]["dice"] - scores["all-empty"]["dice"]
    return (dice - scores["all-empty"]["dice"]) / room if room > 0 else float("nan")


def table(results: list[dict]) -> str:
    """The study's table: one row per variant (Dice of each submission, the box oracle where
    there is one, the share captured by the default and by the one-fold path), then mean and
    worst case (the smallest margin)."""
    header = (f"{'variant':<24}{'size':>9}  {'labels % F/Fl/G/S':<18}" + "".join(f"{c:>14}" for c in COLUMNS)
              + f"{'box oracle':>11}{'margin':>9}{'captured':>9}{'one fold':>9}{'seconds':>9}")
    figures = np.array([[r["scores"][c]["dice"] for c in COLUMNS]
                        + [r["scores"].get("box oracle", {"dice": np.nan})["dice"], r["margin"], r["captured"],
                           r["captured_one_fold"], r["seconds"]] for r in results])
    lines = [header]
    for r, row in zip(results, figures):
        labels = "/".join(f"{100 * f:.0f}" for f in r["frequencies"])
        lines.append(f"{r['variant']:<24}{r['size'][0]:>4}x{r['size'][1]:<4}  {labels:<18}" + figure_cells(row))
    worst = figures[np.argmin(figures[:, -4])]  # the variant with the smallest margin over all-empty
    for label, row in (("mean", figures.mean(axis=0)), ("worst case", worst)):
        lines.append(f"{label:<24}{'':>9}  {'':<18}" + figure_cells(row))
    return "\n".join(lines)


def figure_cells(row) -> str:
    """A table row's figures: the submissions' Dice, box oracle, margin, shares captured (the
    default's, the one-fold path's), seconds."""
    *dice, oracle, margin, share, share_one_fold, seconds = row
    shares = "".join(f"{s:>8.0%} " if np.isfinite(s) else f"{'-':>9}" for s in (share, share_one_fold))
    return ("".join(f"{v:>14.4f}" for v in dice) + (f"{oracle:>11.4f}" if np.isfinite(oracle) else f"{'-':>11}")
            + f"{margin:>+9.4f}" + shares + f"{seconds:>9.0f}")


def per_class_table(results: list[dict]) -> str:
    """Test Dice of the default submission per class, and each class's pooled share in its rule."""
    lines = [f"{'variant':<24}" + "".join(f"{label:>9}" for label in LABELS) + "  pooled share F/Fl/G/S"]
    for r in results:
        shares = "/".join(f"{100 * r['rule']['pooled_weight'][label]:.0f}" for label in LABELS)
        lines.append(f"{r['variant']:<24}" + "".join(f"{r['scores']['default'][label]:>9.4f}" for label in LABELS)
                     + f"  {shares} %")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="clean",
                        help=f"clean (the default), noisy (crowd-drawn labels), all, or comma-separated names from "
                             f"{', '.join(VARIANTS)}")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", help="folder for every variant's data and run (default: a new one under /tmp)")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="every variant at this size (tests)")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="add this to every variant's seed: fresh images and labels of the same kinds, "
                             "to check a recipe on draws it was not chosen on")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra training config override, e.g. train.lr=1e-3 (repeatable)")
    parser.add_argument("--retune", action="store_true",
                        help="no training: tune the runs left under --out again with today's code, and predict again")
    add_device_option(parser, "training and prediction run (train.device, predict --device)")
    args = parser.parse_args(argv)
    args.variants = GROUPS.get(args.variants) or [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.retune and not args.out:
        parser.error("--retune needs --out: the folder of an earlier study")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="cloudseg-robustness-"))
    print(f"robustness of `train -c configs/demo.yaml train.epochs={args.epochs}` + `predict`: "
          f"{args.n_train} train / {args.n_test} test images per variant, seed offset {args.seed_offset} "
          f"{' '.join(args.set)}\n"
          f"{machine()}; data and runs in {root}", flush=True)
    results = []
    for name in args.variants:
        variant = replace(VARIANTS[name], seed=VARIANTS[name].seed + args.seed_offset)
        variant = replace(variant, size=tuple(args.size)) if args.size else variant
        results.append(study_variant(name, variant, args, root))
        shares = results[-1]["train_label_shares"]
        print(f"  {name}: default {results[-1]['scores']['default']['dice']:.4f}, all-empty "
              f"{results[-1]['scores']['all-empty']['dice']:.4f} ({human_duration(results[-1]['seconds'])}); training labels: "
              f"{sum(shares):.2f} per image, {1 - sum(shares) / len(LABELS):.0%} of pairs empty", flush=True)
    print(f"\nmean Dice at 350x525 on the test images (load at end {os.getloadavg()[0]:.1f})")
    print(table(results))
    print("\ndefault submission, test Dice per class")
    print(per_class_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
