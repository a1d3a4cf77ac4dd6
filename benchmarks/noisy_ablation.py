"""The first-place recipe on noisy labels, one option at a time: which of the classification
head, its gates, the at-least-one-label rule, SWA, EMA and `predict.zero_black` measure better.

Step 1, `train`: for each noisy-label variant of benchmarks/kaggle_like.py and each seed offset,
generate the data and train `configs/demo.yaml` twice, with and without `model.cls_head`, each
run also tracking an EMA of its weights (train.ema, saved in best.pt beside the training weights)
and keeping every epoch's training weights (train.save_epochs). Neither changes the weights that
train, so one run serves every row: the plain run (its best epoch by out-of-fold tuned Dice, as
training picks best.pt), its EMA (as saved, and with BatchNorm measured again), and the SWA of
its last epochs are all read from it.

Step 2, `evaluate`: for each run and each model (plain, EMA, SWA), the out-of-fold and test
probabilities (head included) are computed once with `predict.zero_black` off and on; each
post-processing option is then tuned on the out-of-fold probabilities by the run's own search
and scored on the test images, beside the all-empty submission and the box oracle.

Usage: python benchmarks/noisy_ablation.py train --out DIR [--variants noisy] [--seed-offsets 0,100]
       [--n-train 64] [--n-test 48] [--epochs 6]
       python benchmarks/noisy_ablation.py evaluate --out DIR [--json FILE] [--models plain,ema,ema-bn,swa]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from cloudseg.data import CloudDataset, decode_masks, make_loader, read_label_csv
from cloudseg.files import atomic_path
from cloudseg.hardware import autocast_dtype
from cloudseg.metrics import dice, evaluate_submission
from cloudseg.oof import predict_oof
from cloudseg.postprocess import apply_rule, quantize
from cloudseg.predict import batch_probabilities, load_model
from cloudseg.swa import EPOCHS_DIR, average_checkpoints, epoch_path, recompute_norm_statistics
from cloudseg.synth import TEST_SOLUTION_CSV
from cloudseg.task import LABELS, SUBMISSION_SHAPE
from cloudseg.tune import search_rule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kaggle_like import BOX_ORACLE_CSV, NOISY_SIZE, VARIANTS, generate  # noqa: E402
from recipes import interleaved_step_seconds  # noqa: E402
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
    # Head-on runs first, on every dataset: they serve every row but the head-off comparison.
    for head, overrides in HEADS.items():
        for name, offset in datasets(args):
            folder = root / f"{name}+{offset}"
            data = folder / "data"
            if not (data / "train.csv").is_file():
                variant = replace(VARIANTS[name], seed=VARIANTS[name].seed + offset)
                generate(variant, data, args.n_train, args.n_test)
            run = folder / head
            if (run / "oof.npz").is_file():
                continue
            if run.exists():  # an interrupted run: start it again
                shutil.rmtree(run)
            started = time.perf_counter()
            cloudseg("train", "-c", str(DEMO_CONFIG), "--out", str(run), f"data.dir={data}",
                     f"train.epochs={args.epochs}", "train.device=cpu", "train.every_fold=false", "train.min_steps=0",
                     *overrides, *TRACKED, log=folder / f"{head}.log")
            print(f"  {folder.name} {head}: {time.perf_counter() - started:.0f} s", flush=True)


# ---------------------------------------------------------------------------------- step 2

# Post-processing options: (gate scores searched, at-least-one-label searched, predict.zero_black,
# bounding boxes searched).
OPTIONS = {
    "top-k gate (today)": (("top_k",), False, False, False),
    "+ head gate": (("top_k", "head"), False, False, False),
    "+ score gate": (("top_k", "score"), False, False, False),
    "+ head and score gates": (("top_k", "head", "score"), False, False, False),
    "+ forced label": (("top_k",), True, False, False),
    "+ score gate + forced label": (("top_k", "score"), True, False, False),
    "+ all gates + forced label": (("top_k", "head", "score"), True, False, False),
    "zero_black": (("top_k",), False, True, False),
    "+ boxes": (("top_k",), False, False, True),
    "+ boxes + forced label": (("top_k",), True, False, True),
}
SWA_EPOCHS = 3  # the last 3 of 6 epochs
TIMED_ROUNDS = 20  # the head's cost is a few percent: more rounds than recipes.py's table takes


class Probs(NamedTuple):
    probs8: np.ndarray  # (N, 4, 350, 525) uint8
    classes8: np.ndarray | None  # (N, 4) uint8: the head's
    truth: np.ndarray  # (N, 4, 350, 525) bool


def test_probs(models: list, config, data: Path, device) -> Probs:
    """The models' combined probabilities of the test images (and their truth), as predict computes them."""
    dataset = CloudDataset(data, "test", image_size=config.data.image_size, decode="cpu")
    dtype = autocast_dtype(config.train.precision, device)
    probs, classes = [], []
    for batch in make_loader(dataset, config.data, config.predict.batch_size, device):
        out = batch_probabilities(models, batch["image"].to(device), dtype, config.predict)
        probs.append(quantize(out.submission.numpy()))
        classes.append(None if out.classes is None else quantize(out.classes.numpy()))
    truth = read_label_csv(data / TEST_SOLUTION_CSV).loc[dataset.image_ids]
    masks = np.stack([np.stack(decode_masks(truth, i, SUBMISSION_SHAPE, data)) for i in truth.index]).astype(bool)
    return Probs(np.concatenate(probs), None if classes[0] is None else np.concatenate(classes), masks)


def model_probs(model, config, data: Path, device) -> dict[bool, tuple[Probs, Probs]]:
    """{zero_black: (out-of-fold, test)} probabilities of one model."""
    model.eval()
    result = {}
    for zero_black in (False, True):
        config = config.model_copy(deep=True)
        config.predict.zero_black = zero_black
        _, probs8, truth, classes8 = predict_oof(model, config, device)
        result[zero_black] = (Probs(probs8, classes8, truth), test_probs([model], config, data, device))
    return result


def tuned_test_dice(oof: Probs, test: Probs, config, gate_search, force: bool, box: bool) -> tuple[float, float, dict]:
    """(test Dice, out-of-fold CV Dice, rule) of the rule tuned on `oof` by the run's search."""
    current = {**config.predict.model_dump(), "gate_on": ["top_k"] * len(LABELS), "box": [False] * len(LABELS),
               "gate_search": [k for k in gate_search if k == "top_k" or oof.classes8 is not None],
               "force_label_search": force, "box_search": box}
    rule = search_rule(oof.probs8, oof.truth, current, classes8=oof.classes8)
    masks = apply_rule(test.probs8, rule, test.classes8)
    cv = rule["cv_dice"]["forced" if force else "boxed" if box else "after"]["mean"]
    return float(np.mean(dice(masks, test.truth))), cv, rule


def run_config(run: Path):
    config = load_model(run / "best.pt", torch.device("cpu"))[1]
    config.data.num_workers = 0  # a few dozen images per pass: a worker process costs more than it saves
    return config


def plain_model(run: Path, config, device):
    """The epoch of highest out-of-fold CV under today's rule, as a run without EMA picks best.pt."""
    epochs = saved_epochs(run)
    scores = []
    for epoch in epochs:
        model, _ = load_model(epoch_path(run, epoch), device)
        _, probs8, truth, _ = predict_oof(model, config, device)
        scores.append(search_rule(probs8, truth, {**config.predict.model_dump(), "gate_search": ["top_k"],
                                                  "force_label_search": False,
                                                  "box_search": False})["cv_dice"]["after"]["mean"])
    best = epochs[len(scores) - 1 - scores[::-1].index(max(scores))]
    return load_model(epoch_path(run, best), device)[0]


def ema_model(run: Path, config, device, recompute: bool):
    """The run's best.pt (train.ema: the average), or the same weights with BatchNorm measured
    again over the training images, as SWA does. Since train.ema measures them itself the two
    are the same; runs of older code saved statistics averaged with the weights."""
    model = load_model(run / "best.pt", device)[0]
    if recompute:
        recompute_norm_statistics(model, config, device)
    return model.eval()


def swa_model(run: Path, config, device):
    averaged, _, _ = average_checkpoints([epoch_path(run, e) for e in saved_epochs(run)[-SWA_EPOCHS:]])
    recompute_norm_statistics(averaged, config, device)
    return averaged.eval()


def saved_epochs(run: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("epoch")) for p in (run / EPOCHS_DIR).glob("epoch*.pt"))


MODELS = {"plain": plain_model, "ema": lambda *a: ema_model(*a, recompute=False),
          "ema-bn": lambda *a: ema_model(*a, recompute=True), "swa": swa_model}


def evaluate_run(run: Path, data: Path, device, models=tuple(MODELS)) -> list[dict]:
    """Every (model, option) row of one run: test Dice, out-of-fold CV, the rule's choices; kept
    in RUN/ablation.json, from which a later call takes the rows it already has (a model's
    probabilities are computed only for options it lacks)."""
    cache = run / "ablation.json"
    rows = json.loads(cache.read_text()) if cache.is_file() else []
    config = run_config(run)
    for model_name in models:
        done = {row["option"] for row in rows if row["model"] == model_name}
        missing = [option for option in OPTIONS if option not in done]
        if not missing:
            continue
        probs = model_probs(MODELS[model_name](run, config, device), config, data, device)
        for option in missing:
            gate_search, force, zero_black, box = OPTIONS[option]
            if probs[False][0].classes8 is None and any(k != "top_k" for k in gate_search):
                continue  # a head gate without a head: not an option
            test_dice, cv, rule = tuned_test_dice(*probs[zero_black], config, gate_search, force, box)
            rows.append({"run": run.name, "model": model_name, "option": option, "test_dice": test_dice, "cv": cv,
                         "gate_on": rule["gate_on"], "force_label": rule["force_label"], "box": rule["box"]})
        with atomic_path(cache) as tmp:
            tmp.write_text(json.dumps(rows, indent=1))
    return rows


def references(data: Path) -> dict[str, float]:
    """The all-empty submission's and the box oracle's test Dice."""
    truth = data / TEST_SOLUTION_CSV
    empty = float(read_label_csv(truth).eq("").to_numpy().mean())
    return {"all-empty": empty, "box oracle": evaluate_submission(data / BOX_ORACLE_CSV, truth)["dice"]}


def evaluate_all(args) -> None:
    """Step 2 over every finished run; prints the ablation table (and writes --json)."""
    torch.set_num_threads(1)
    device, root, results = torch.device("cpu"), Path(args.out), []
    for name, offset in datasets(args):
        folder = root / f"{name}+{offset}"
        for head in HEADS:
            if (folder / head / "oof.npz").is_file():  # a finished run
                refs = references(folder / "data")
                for row in evaluate_run(folder / head, folder / "data", device, args.models):
                    results.append({"dataset": folder.name, **refs, **row})
                print(f"  evaluated {folder.name} {head}", flush=True)
    print(f"\n{machine()}\n" + table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.no_timing:
        return
    steps = interleaved_step_seconds(["fpn", "fpn-head"], NOISY_SIZE, rounds=TIMED_ROUNDS)
    print(f"\none optimizer step of configs/demo.yaml at {NOISY_SIZE[0]}x{NOISY_SIZE[1]} on this CPU (best of "
          f"{TIMED_ROUNDS} interleaved rounds): without head {steps['fpn'][0]:.3f} s, with head {steps['fpn-head'][0]:.3f} s "
          f"({steps['fpn-head'][0] / steps['fpn'][0] - 1:+.1%})")


BASELINE = ("plain", "top-k gate (today)")  # within each run: today's recipe


def table(results: list[dict]) -> str:
    """One line per (run kind, model, option): mean test Dice, mean share of the margin captured,
    its mean change against the same runs' plain model under today's rule and on how many datasets
    it is higher, and the worst margin over all-empty with its dataset. Then the head's training
    alone: head runs against head-off runs on the datasets that have both."""
    frame = pd.DataFrame(results)
    frame["margin"] = frame["test_dice"] - frame["all-empty"]
    frame["captured"] = frame["margin"] / (frame["box oracle"] - frame["all-empty"])
    base = frame[(frame["model"] == BASELINE[0]) & (frame["option"] == BASELINE[1])]
    base = base.set_index(["run", "dataset"])["test_dice"]
    frame["change"] = frame["test_dice"] - base.reindex(pd.MultiIndex.from_frame(frame[["run", "dataset"]])).to_numpy()
    lines = [f"{'run':<7}{'model':<7}{'option':<30}{'datasets':>9}{'test Dice':>10}{'captured':>9}{'change':>9}"
             f"{'higher':>7}{'worst margin':>13}  worst dataset"]
    for (run, model, option), group in frame.groupby(["run", "model", "option"], sort=False):
        worst = group.loc[group["margin"].idxmin()]
        higher = int((group["change"] > 1e-9).sum())
        lines.append(f"{run:<7}{model:<7}{option:<30}{len(group):>9}{group['test_dice'].mean():>10.4f}"
                     f"{group['captured'].mean():>8.0%} {group['change'].mean():>+9.4f}{higher:>4}/{len(group):<2}"
                     f"{worst['margin']:>+13.4f}  {worst['dataset']}")
    per_dataset = frame.groupby("dataset")[["all-empty", "box oracle"]].first()
    lines.append(f"all-empty {per_dataset['all-empty'].mean():.4f}, box oracle {per_dataset['box oracle'].mean():.4f} "
                 f"(means over {len(per_dataset)} datasets)")
    paired = base.unstack("run").dropna()
    if {"head", "nohead"} <= set(paired.columns):
        change = paired["head"] - paired["nohead"]
        lines.append(f"training with the head (today's rule, plain model): {change.mean():+.4f} on {len(change)} "
                     f"datasets with both runs, higher on {int((change > 0).sum())}")
    return "\n".join(lines)


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
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"evaluate: comma-separated, of {', '.join(MODELS)} (rows kept of others are shown too)")
    parser.add_argument("--no-timing", action="store_true", help="evaluate: skip the step time with and without head")
    args = parser.parse_args(argv)
    args.variants = GROUPS.get(args.variants) or [v.strip() for v in args.variants.split(",") if v.strip()]
    args.seed_offsets = [int(v) for v in args.seed_offsets.split(",") if v.strip()]
    args.models = [v.strip() for v in args.models.split(",") if v.strip()]
    if unknown := set(args.models) - set(MODELS):
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; choose among {', '.join(MODELS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.step == "train":
        train_all(args)
    else:
        evaluate_all(args)


if __name__ == "__main__":
    main()
