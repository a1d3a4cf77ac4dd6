"""How much does the demo's outcome depend on the seed and the machine?

For every synthetic dataset (`cloudseg synth` with the Makefile's SYNTH_ARGS, its --seed
replaced by each of --data-seeds), every torch thread count (OMP_NUM_THREADS: another order of
floating-point sums, a proxy for another machine) and every training seed, run what `make train`
and `make predict` run:

    cloudseg train -c configs/demo.yaml --out RUN data.dir=DATA seed=S [--set ...]
    cloudseg predict --checkpoint RUN/best.pt --out RUN/submission.csv

and score the submission on the test truth. Prints one row per run, then the mean, min, max and
spread (max - min) of the validation Dice that `make train` reports (the best epoch's, under the
run's tuned rule) and of the test Dice that `make predict` reports.

The folds are made once per dataset with the config's seed, as `make train` makes them, so every
training seed holds out the same images: the spread is the training's, not the fold draw's.

Usage: python benchmarks/demo_spread.py [--seeds 0,1,2] [--data-seeds 0] [--threads 2] [--jobs 1]
       [--set key=value ...] [--synth-args "..."] [--out DIR] [--json FILE] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from cloudseg.cli import add_device_option
from cloudseg.config import load_config
from cloudseg.metrics import evaluate_submission
from cloudseg.synth import TEST_SOLUTION_CSV
from cloudseg.units import human_duration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import DEMO_CONFIG, REPO, cloudseg, empty_folder, machine  # noqa: E402

FIGURES = {"valid_tuned": "valid Dice (tuned)", "test": "test Dice"}


def makefile_synth_args(makefile: Path = REPO / "Makefile") -> list[str]:
    """The arguments `make train` gives `cloudseg synth` (the Makefile's SYNTH_ARGS)."""
    found = re.search(r"^SYNTH_ARGS\s*\?=(.*)$", makefile.read_text(), re.MULTILINE)
    if not found:
        raise ValueError(f"{makefile}: no SYNTH_ARGS line")
    return shlex.split(found.group(1))


def with_seed(synth_args: list[str], seed: int) -> list[str]:
    """`synth_args` with its --seed replaced (or added)."""
    args = list(synth_args)
    if "--seed" in args:
        del args[args.index("--seed"):args.index("--seed") + 2]
    return [*args, "--seed", str(seed)]


def make_dataset(root: Path, synth_args: list[str], data_seed: int) -> Path:
    """One synthetic dataset and its folds, made with the demo config's seed as `make train` makes them."""
    data, log = root / f"data{data_seed}", root / f"data{data_seed}.log"
    config = load_config(DEMO_CONFIG)
    cloudseg("synth", "--out", str(data), *with_seed(synth_args, data_seed), log=log)
    cloudseg("folds", "--data-dir", str(data), "--n-folds", str(config.data.n_folds), "--seed", str(config.seed),
             log=log)
    return data


def demo_run(data: Path, run: Path, seed: int, threads: int, overrides: list[str], device: str = "auto") -> dict:
    """`make train` then `make predict` on `data` with training seed `seed` on `threads` threads,
    both on `device` (train.device, predict --device); the figures."""
    started, log, env = time.perf_counter(), run.with_suffix(".log"), {"OMP_NUM_THREADS": str(threads)}
    cloudseg("train", "-c", str(DEMO_CONFIG), "--out", str(run), f"data.dir={data}", f"seed={seed}",
             f"train.device={device}", "train.every_fold=false", *overrides, log=log, env=env)  # as make train's demo
    train_seconds = time.perf_counter() - started
    cloudseg("predict", "--checkpoint", str(run / "best.pt"), "--out", str(run / "submission.csv"), "--device", device,
             log=log, env=env)
    metrics = pd.read_csv(run / "metrics.csv")
    best = metrics.loc[metrics["dice_tuned"].idxmax()]
    return {"data_seed": int(data.name.removeprefix("data")), "threads": threads, "seed": seed,
            "best_epoch": int(best["epoch"]), "valid_untuned": float(best["dice"]),
            "valid_tuned": float(best["dice_tuned"]),
            "test": evaluate_submission(run / "submission.csv", data / TEST_SOLUTION_CSV)["dice"],
            "train_seconds": train_seconds}


def spread(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per figure: mean, min, max, spread (max - min) and the largest distance from the mean."""
    summary = {}
    for key in FIGURES:
        values = np.array([r[key] for r in results])
        summary[key] = {"mean": values.mean(), "min": values.min(), "max": values.max(),
                        "spread": values.max() - values.min(), "off_mean": np.abs(values - values.mean()).max()}
    return summary


def table(results: list[dict]) -> str:
    """One row per run, then mean, min, max, spread and the largest distance from the mean."""
    lines = [f"{'data':>5}{'threads':>8}{'seed':>6}{'best epoch':>11}{'valid Dice':>11}"
             + "".join(f"{label:>20}" for label in FIGURES.values()) + f"{'train s':>9}"]
    for r in results:
        lines.append(f"{r['data_seed']:>5}{r['threads']:>8}{r['seed']:>6}{r['best_epoch']:>11}{r['valid_untuned']:>11.3f}"
                     + "".join(f"{r[key]:>20.3f}" for key in FIGURES) + f"{r['train_seconds']:>9.0f}")
    summary = spread(results)
    for statistic in ("mean", "min", "max", "spread", "off_mean"):
        label = "max |x - mean|" if statistic == "off_mean" else statistic
        lines.append(f"{label:<41}" + "".join(f"{summary[key][statistic]:>20.3f}" for key in FIGURES))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    def numbers(text: str) -> list[int]:
        return [int(n) for n in text.split(",") if n.strip()]

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=numbers, default=[0, 1, 2], help="training seeds (config key seed)")
    parser.add_argument("--data-seeds", type=numbers, default=[0], help="cloudseg synth --seed of each dataset")
    parser.add_argument("--threads", type=numbers, default=[os.cpu_count()], help="OMP_NUM_THREADS of each run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (with --threads 1 on a 2-core machine: 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra training config override, e.g. train.epochs=10 (repeatable)")
    parser.add_argument("--synth-args", type=shlex.split, default=makefile_synth_args(),
                        help="cloudseg synth arguments (default: the Makefile's SYNTH_ARGS; --seed is replaced)")
    parser.add_argument("--out", help="a new folder for the data, runs and logs (default: one under /tmp)")
    parser.add_argument("--json", help="also write every figure here")
    add_device_option(parser, "training and prediction run (train.device, predict --device)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    root = empty_folder(args.out, "cloudseg-demo-spread-")
    print(f"configs/demo.yaml {' '.join(args.set)} on cloudseg synth {' '.join(args.synth_args)} (--seed replaced); "
          f"{machine()}; {args.jobs} run(s) at a time; runs in {root}", flush=True)
    datasets = {seed: make_dataset(root, args.synth_args, seed) for seed in args.data_seeds}
    plan = list(itertools.product(args.data_seeds, args.threads, args.seeds))

    def one(data_seed: int, threads: int, seed: int) -> dict:
        result = demo_run(datasets[data_seed], root / f"d{data_seed}-t{threads}-s{seed}", seed, threads, args.set,
                          args.device)
        print(f"  data {data_seed}, {threads} thread(s), seed {seed}: valid {result['valid_tuned']:.3f}, "
              f"test {result['test']:.3f} ({human_duration(result['train_seconds'])})", flush=True)
        return result

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda planned: one(*planned), plan))
    print(f"\nload at end {os.getloadavg()[0]:.1f}; valid Dice: the best epoch's on the fold (untuned, then under the "
          "rule tuned on it, as make train reports); test Dice: cloudseg predict with no flags, as make predict")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
