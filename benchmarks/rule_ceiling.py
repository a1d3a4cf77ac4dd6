"""Where the noisy-label score is lost: the rule's tuning, or the model's probabilities?

For each run of an earlier `benchmarks/robustness.py --out DIR` study, on its test images (an
every-fold run's folds predicting together, as `cloudseg predict` runs them):

- **run's rule**: the test Dice under the run's own postprocess.json (what `cloudseg predict` does);
- **rule tuned on test**: under the rule the run's search finds on the test images themselves
  (no guard for small folds): the most any rule of this form gets from these probabilities;
- **perfect presence**: the run's masks, emptied where the truth is empty (a perfect gate).

Each as the share of the margin captured, (Dice − all-empty) / (box oracle − all-empty), on the
noisy-label variants (which have a box oracle). A large gap between the first two says the rule
is tuned on too few images (the demo's 13 out-of-fold images); between the last two, that the
model's presence signal is the limit.

Usage: python benchmarks/rule_ceiling.py DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from cloudseg.checkpoint import fold_checkpoints
from cloudseg.metrics import dice
from cloudseg.postprocess import apply_rule, read_rule_file
from cloudseg.predict import load_model
from cloudseg.tune import search_rule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kaggle_like import BOX_ORACLE_CSV  # noqa: E402
from noisy_ablation import references, test_probs  # noqa: E402


def shares(folder: Path, device: torch.device) -> tuple[float, float, float]:
    """(run's rule, rule tuned on test, perfect presence) as shares of the margin, for one variant."""
    run = folder / "run/best.pt"
    loaded = [load_model(path, device) for path in fold_checkpoints(run) or [run]]  # an every-fold run: its folds
    config = loaded[0][1]
    config.data.num_workers = 0
    probs = test_probs([model for model, _ in loaded], config, folder / "data", device)
    refs = references(folder / "data")
    room = refs["box oracle"] - refs["all-empty"]
    own_rule = read_rule_file(folder / "run/postprocess.json")
    own = np.asarray(dice(apply_rule(probs.probs8, own_rule, probs.classes8), probs.truth))
    on_test = search_rule(probs.probs8, probs.truth, config.predict, classes8=probs.classes8, prior_images=0)
    best = np.asarray(dice(apply_rule(probs.probs8, on_test, probs.classes8), probs.truth))
    present = probs.truth.any(axis=(-2, -1))
    perfect = np.where(present, own, 1.0)  # a present class keeps the run's mask; an absent one is empty
    return tuple(float((d.mean() - refs["all-empty"]) / room) for d in (own, best, perfect))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="+", help="--out folders of robustness.py studies of noisy variants")
    args = parser.parse_args(argv)
    if missing := [study for study in args.studies if not Path(study).is_dir()]:
        parser.error(f"no such study folder: {', '.join(missing)}")
    torch.set_num_threads(1)
    rows = []
    print(f"{'study':<28}{'variant':<24}" + "".join(f"{column:>11}" for column in ("run's rule", "on test", "presence")))
    for study in map(Path, args.studies):
        for folder in sorted(p for p in study.iterdir() if (p / "run/best.pt").is_file() and (p / "data").is_dir()):
            if not (folder / "data" / BOX_ORACLE_CSV).is_file():
                continue  # exact labels: no box oracle, no share
            rows.append(shares(folder, torch.device("cpu")))
            print(f"{study.name:<28}{folder.name:<24}" + "".join(f"{v:>10.0%} " for v in rows[-1]), flush=True)
    if not rows:
        raise SystemExit("no run of a noisy-label variant found under " + ", ".join(args.studies))
    print(f"{'mean':<52}" + "".join(f"{v:>10.0%} " for v in np.mean(rows, axis=0)))


if __name__ == "__main__":
    main()
