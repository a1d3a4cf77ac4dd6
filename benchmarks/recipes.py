"""Model options of the top solutions against the UNet baseline, on the synthetic demo: Dice and
time per epoch, in one table.

For each option: `cloudseg train -c configs/demo.yaml OPTION` on one `cloudseg synth` dataset
(64 train images at 192×288 by default, fold 0 validates), then `cloudseg predict` with no
flags (the run's own tuned rule), scored on the held-out test images. Time per epoch twice:
the run's own (metrics.csv: moved by whatever else the machine runs, on --device) and an
interleaved timing of every option's training step in this one process on the CPU, which a load
moves alike for all.

Usage: python benchmarks/recipes.py [--epochs 6] [--n-train 64] [--n-test 32] [--size 192 288]
       [--options unet,ema,fpn,unetplusplus] [--out DIR] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from cloudseg.cli import add_device_option
from cloudseg.config import load_config
from cloudseg.data import fold_ids
from cloudseg.engine import micro_batch_losses
from cloudseg.metrics import evaluate_submission
from cloudseg.model import build_model, prepare_for_training
from cloudseg.synth import TEST_SOLUTION_CSV, synthesize
from cloudseg.train import averaged

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import DEMO_CONFIG, cloudseg, empty_folder, machine  # noqa: E402

# name: config overrides. Each names its arch and widths (configs/demo.yaml is an FPN since
# this comparison was first made): FPN's decoder has two widths (pyramid, segmentation head),
# the UNets' one per stage. The EMA decay suits a run of ~80 optimizer steps (0.99 would still
# hold half the random start).
UNET_WIDTHS = "model.decoder_channels=[128,64,32,16,8]"
OPTIONS = {
    "unet": ["model.arch=unet", UNET_WIDTHS],
    "ema": ["model.arch=unet", UNET_WIDTHS, "train.ema=0.9"],
    "fpn": ["model.arch=fpn", "model.decoder_channels=[128,64]"],
    "fpn-head": ["model.arch=fpn", "model.decoder_channels=[128,64]", "model.cls_head=true"],
    "unetplusplus": ["model.arch=unetplusplus", UNET_WIDTHS],
}
TIMED_ROUNDS = 6  # interleaved training steps per option, after one untimed warm-up round


def run_option(name: str, data: Path, root: Path, epochs: int, device: str) -> dict:
    """Train one option on `device`, predict the test images with its own rule, score; return the figures."""
    run, log = root / name, root / f"{name}.log"
    cloudseg("train", "-c", str(DEMO_CONFIG), "--out", str(run), f"data.dir={data}", f"train.epochs={epochs}",
             f"train.device={device}", "train.every_fold=false", "train.min_steps=0", *OPTIONS[name],
             log=log)  # one fold per option, --epochs exactly
    cloudseg("predict", "--checkpoint", str(run / "best.pt"), "--out", str(root / f"{name}.csv"), "--device", device,
             log=log)
    metrics = pd.read_csv(run / "metrics.csv")
    best = metrics.loc[metrics["dice_tuned"].idxmax()]
    config = load_config(run / "config.yaml")
    train_images = len(fold_ids(config.data, config.seed)[0])
    return {"option": name, "best_epoch": int(best["epoch"]), "valid_dice_tuned": float(best["dice_tuned"]),
            "test_dice": evaluate_submission(root / f"{name}.csv", data / TEST_SOLUTION_CSV)["dice"],
            "run_s_per_epoch": float((train_images / metrics["images_per_s"]).median()), "train_images": train_images}


def interleaved_step_seconds(names: list[str], size: tuple[int, int],
                             rounds: int = TIMED_ROUNDS) -> dict[str, tuple[float, int]]:
    """(best seconds of one optimizer step of the demo config, parameter count) per option: the
    options take turns, so a load on the machine slows them alike. An EMA update is part of the
    step where the option has one, and the classification head's loss where it has a head."""
    torch.manual_seed(0)
    steps = {}
    for name in names:
        config = load_config(DEMO_CONFIG, OPTIONS[name])
        model = prepare_for_training(build_model(config.model, pretrained=False).train(), config.train.channels_last,
                                     "none")
        ema = averaged(model, config.train.ema)
        steps[name] = (model, ema, config.train.micro_batch, config.train.accumulation_for(1))
    images = {name: torch.randint(0, 256, (micro, 3, *size), dtype=torch.uint8) for name, (_, _, micro, _) in steps.items()}
    masks = {name: (torch.rand(len(batch), 4, *size) < 0.3).to(torch.uint8) for name, batch in images.items()}
    times = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name, (model, ema, _, accumulation) in steps.items():
            start = time.perf_counter()
            for _ in range(accumulation):  # the head's loss too, where the option has one
                micro_batch_losses(model, images[name], masks[name], None, 1.0).mean().backward()
            model.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update_parameters(model)
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: (min(t), sum(p.numel() for p in steps[name][0].parameters())) for name, t in times.items()}


def table(results: list[dict], steps: dict, effective_batch: int) -> str:
    lines = [f"{'option':<14}{'parameters':>11}{'best epoch':>11}{'valid Dice':>11}{'test Dice':>10}"
             f"{'s/epoch (run)':>14}{'s/epoch (interleaved)':>22}"]
    for r in results:
        seconds, parameters = steps[r["option"]]
        per_epoch = seconds * r["train_images"] / effective_batch
        lines.append(f"{r['option']:<14}{parameters / 1e6:>10.2f}M{r['best_epoch']:>11}{r['valid_dice_tuned']:>11.3f}"
                     f"{r['test_dice']:>10.3f}{r['run_s_per_epoch']:>14.1f}{per_epoch:>22.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", default="unet,ema,fpn,unetplusplus",
                        help=f"comma-separated, from {', '.join(OPTIONS)}")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=32)
    parser.add_argument("--size", type=int, nargs=2, default=(192, 288), metavar=("H", "W"))
    parser.add_argument("--out", help="a new folder for the data, runs and logs (default: one under /tmp)")
    add_device_option(parser, "training and prediction run (train.device, predict --device)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.options.split(",") if name.strip()]
    if unknown := [name for name in names if name not in OPTIONS]:
        parser.error(f"unknown option(s) {', '.join(unknown)}; expected some of {', '.join(OPTIONS)}")
    root = empty_folder(args.out, "cloudseg-recipes-")
    print(f"{args.epochs} epochs of configs/demo.yaml on cloudseg synth ({args.n_train} train, {args.n_test} test, "
          f"{args.size[0]}x{args.size[1]}); {machine()}; runs in {root}", flush=True)
    data = synthesize(root / "data", n_train=args.n_train, n_test=args.n_test, height=args.size[0],
                      width=args.size[1], seed=0)
    results = []
    for name in names:
        results.append(run_option(name, data, root, args.epochs, args.device))
        print(f"  {name}: test Dice {results[-1]['test_dice']:.3f}", flush=True)
    steps = interleaved_step_seconds(names, tuple(args.size))
    print(f"\nload at end {os.getloadavg()[0]:.1f}; valid Dice: best epoch's dice_tuned on the fold's images; "
          "test Dice: cloudseg predict with no flags")
    print(table(results, steps, load_config(DEMO_CONFIG).train.effective_batch))


if __name__ == "__main__":
    main()
