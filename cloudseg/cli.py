"""The `cloudseg` command line."""

from __future__ import annotations

import argparse
import sys

from cloudseg.task import IMAGE_SHAPE, LABELS

USER_ERRORS = (ValueError, FileNotFoundError, KeyError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except USER_ERRORS as error:
        if args.debug:
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"cloudseg: error: {message}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloudseg", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)

    synth = commands.add_parser("synth", help="write a synthetic dataset in the Kaggle layout")
    synth.add_argument("--out", required=True, help="folder to write")
    synth.add_argument("--n-train", type=int, default=64)
    synth.add_argument("--n-test", type=int, default=16)
    synth.add_argument("--height", type=int, default=IMAGE_SHAPE[0])
    synth.add_argument("--width", type=int, default=IMAGE_SHAPE[1])
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(run=run_synth)

    evaluate = commands.add_parser("evaluate", help="score a Kaggle-format submission against a truth file")
    evaluate.add_argument("--submission", required=True)
    evaluate.add_argument("--truth", required=True)
    evaluate.set_defaults(run=run_evaluate)

    folds = commands.add_parser("folds", help="make (once) and show the multilabel-stratified folds")
    folds.add_argument("--data-dir", required=True)
    folds.add_argument("--n-folds", type=int, default=5)
    folds.add_argument("--seed", type=int, default=42)
    folds.set_defaults(run=run_folds)
    return parser


def run_synth(args) -> None:
    from cloudseg.synth import synthesize

    synthesize(args.out, args.n_train, args.n_test, args.height, args.width, args.seed)
    print(f"wrote {args.n_train} train and {args.n_test} test images ({args.height}x{args.width}) to {args.out}")


def run_evaluate(args) -> None:
    from cloudseg.metrics import evaluate_submission

    summary = evaluate_submission(args.submission, args.truth)
    print(f"mean Dice {summary['dice']:.4f}")
    for label in LABELS:
        print(f"  {label:<7} {summary[label]:.4f}")


def run_folds(args) -> None:
    from cloudseg.data import load_folds, read_train_csv
    from cloudseg.task import FOLDS_CSV

    folds = load_folds(args.data_dir, args.n_folds, args.seed)
    present = read_train_csv(args.data_dir).ne("").groupby(folds).mean()
    present.insert(0, "images", folds.value_counts().sort_index())
    print(f"{args.data_dir}/{FOLDS_CSV}: share of images with each label, per fold")
    print(present.round(3).to_string())
