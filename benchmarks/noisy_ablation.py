"""The first-place recipe on noisy labels, one option at a time: which of the classification
head, its gates, the at-least-one-label rule, SWA, EMA and `predict.zero_black` measure better.

Step 1, `train`: for each noisy-label variant of benchmarks/kaggle_like.py and each seed offset,
generate the data and train `configs/demo.yaml` twice, with and without `model.cls_head`, each
run also tracking an EMA of its weights (train.ema, saved in best.pt beside the training weights)
and keeping every epoch's training weights (train.save_epochs). Neither changes the weights that
train, so one run serves every row: the plain run (its best epoch by out-of-fold tuned Dice, as
training picks best.pt), its EMA, and the SWA of its last epochs are all read from it.

Step 2, `evaluate`: for each run and each model (plain, EMA, SWA), the out-of-fold and test
probabilities (head included) are computed once with `predict.zero_black` off and on; each
post-processing option is then tuned on the out-of-fold probabilities by the run's own search
and scored on the test images, beside the all-empty submission and the box oracle.

Usage: python benchmarks/noisy_ablation.py train --out DIR [--variants noisy] [--seed-offsets 0,100]
       [--n-train 64] [--n-test 48] [--epochs 6]
       python benchmarks/noisy_ablation.py evaluate --out DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kaggle_like import VARIANTS, generate  # noqa: E402
from robustness import DEMO_CONFIG, GROUPS, cloudseg, machine  # noqa: E402

HEADS = {"head": ["model.cls_head=true"], "nohead": ["model.cls_head=false"]}
TRACKED = ["train.ema=0.9", "train.save_epochs=true"]  # EMA decay for ~80 optimizer steps, as in recipes.py


def datasets(args) -> list[tuple[str, int]]:
    return [(name, offset) for offset in args.seed_offsets for name in args.variants]


def train_all(args) -> None:
    """Generate each dataset and train its runs, skipping runs already finished (oof.npz written)."""
    root = Path(args.out)
    print(f"noisy-label ablation: {args.n_train} train / {args.n_test} test images, {args.epochs} epochs; "
          f"{machine()}; in {root}", flush=True)
    for name, offset in datasets(args):
        folder = root / f"{name}+{offset}"
        data = folder / "data"
        if not (data / "train.csv").is_file():
            variant = replace(VARIANTS[name], seed=VARIANTS[name].seed + offset)
            generate(variant, data, args.n_train, args.n_test)
        for head, overrides in HEADS.items():
            run = folder / head
            if (run / "oof.npz").is_file():
                continue
            started = time.perf_counter()
            cloudseg("train", "-c", str(DEMO_CONFIG), "--out", str(run), f"data.dir={data}",
                     f"train.epochs={args.epochs}", "train.device=cpu", *overrides, *TRACKED,
                     log=folder / f"{head}.log")
            print(f"  {folder.name} {head}: {time.perf_counter() - started:.0f} s", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("train", "evaluate"))
    parser.add_argument("--out", required=True, help="folder of the datasets and runs (train fills it)")
    parser.add_argument("--variants", default="noisy", help="noisy (the default) or comma-separated variant names")
    parser.add_argument("--seed-offsets", default="0,100", help="comma-separated: each draws a fresh dataset")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--json", help="evaluate: also write every figure here")
    args = parser.parse_args(argv)
    args.variants = GROUPS.get(args.variants) or [v.strip() for v in args.variants.split(",") if v.strip()]
    args.seed_offsets = [int(v) for v in args.seed_offsets.split(",") if v.strip()]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.step == "train":
        train_all(args)
    else:
        evaluate_all(args)


if __name__ == "__main__":
    main()
