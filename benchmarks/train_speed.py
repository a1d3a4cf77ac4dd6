"""Full-resolution training and inference speed and memory, side by side; prints a table.

  a. textbook accumulation loop: fp32, loss / accumulation_steps, no AMP, no channels_last
  b. cloudseg's default training step (precision auto: bf16 from compute capability 8.0, fp16 before; channels_last)
  c. cloudseg with train.checkpointing=full
  d. PyTorch Lightning, Trainer(accumulate_grad_batches=4, precision as cloudseg's auto), same model
  e. data loading alone: CloudDataset (JPEG decode + 4 RLE decodes + flips), per CPU core
  and inference: test-time images/s with 4-flip TTA, projected to Kaggle's 3,698 test images.

Same model (UNet-ResNet34) and the same synthetic batches for a-d. On CUDA the default is
the real size (1400x2100, padded 1408x2112, micro-batch 4, effective batch 16). Without CUDA
the script runs a small size so that it stays testable; its figures mean nothing for GPUs.

Usage: python benchmarks/train_speed.py [--height H --width W --steps N --json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time

import cv2
import torch

from cloudseg.config import load_config
from cloudseg.data import CloudDataset, build_transform
from cloudseg.hardware import autocast_dtype, needs_grad_scaler, resolve_precision
from cloudseg.model import build_model, prepare_for_training
from cloudseg.predict import predict_probs
from cloudseg.synth import synthesize
from cloudseg.engine import StepContext, train_step
from cloudseg.loss import per_image_loss

KAGGLE_TEST_IMAGES = 3698
LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}  # as cloudseg's auto


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config("configs/fullres.yaml", ["model.encoder_weights=null", f"model.encoder={args.encoder}",
                                                  f"train.micro_batch={args.micro_batch}",
                                                  f"train.effective_batch={args.effective_batch}"])
    batches = synthetic_batches(args, device)
    print(header(args, device))
    rows = {
        "a. textbook loop (fp32)": timed(device, lambda: textbook(config, batches, args, device)),
        "b. cloudseg default": timed(device, lambda: cloudseg(config, batches, args, device, "none")),
        "c. cloudseg checkpointing=full": timed(device, lambda: cloudseg(config, batches, args, device, "full")),
        "d. Lightning, same precision": timed(device, lambda: lightning(config, batches, args, device)),
    }
    print_table(rows)
    loader_rate = loading_rate(args)
    print(f"\ne. data loading: {loader_rate:.1f} samples/s per CPU core at {args.loader_size[0]}x{args.loader_size[1]}")
    inference_rate = timed(device, lambda: inference(config, batches, args, device))
    if inference_rate:
        projected = KAGGLE_TEST_IMAGES / inference_rate[0]
        print(f"inference, 4-flip TTA: {inference_rate[0]:.2f} images/s, peak {inference_rate[1]:.2f} GiB; "
              f"{KAGGLE_TEST_IMAGES} test images in {projected / 60:.1f} min (model time only)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": device_name(device), "torch": torch.__version__, "args": vars(args),
                       "rows": rows, "loader_samples_per_s_per_core": loader_rate,
                       "inference": inference_rate}, file, indent=1)


def parse_args():
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=1400 if cuda else 128)
    parser.add_argument("--width", type=int, default=2100 if cuda else 192)
    parser.add_argument("--encoder", default="resnet34")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--effective-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6 if cuda else 2, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2 if cuda else 1, help="untimed optimizer steps first")
    parser.add_argument("--loader-images", type=int, default=8)
    parser.add_argument("--loader-size", type=int, nargs=2, default=(1400, 2100), metavar=("H", "W"),
                        help="image size of the loading benchmark (a CPU measure: full resolution by default)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser.parse_args()


def synthetic_batches(args, device) -> list[dict]:
    """Enough random micro-batches for warmup + timed steps, already on the device."""
    g = torch.Generator().manual_seed(0)
    count = (args.warmup + args.steps) * args.effective_batch // args.micro_batch
    shape = (args.micro_batch, 3, args.height, args.width)
    return [{"image": torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device),
             "mask": (torch.rand(args.micro_batch, 4, args.height, args.width, generator=g) < 0.3).to(torch.uint8).to(device)}
            for _ in range(count)]


def timed(device, run):
    """(images/s, peak GiB) of `run`, which returns (images, seconds) of its timed part."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        images, seconds = run()
    except ImportError as error:
        print(f"  skipped: {error}")
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return images / seconds, peak


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def textbook(config, batches, args, device):
    """The loop of the well-known gradient-accumulation tutorials."""
    model = build_model(config.model, pretrained=False).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    accumulation = args.effective_batch // args.micro_batch
    start = None
    for i, batch in enumerate(batches):
        if i == args.warmup * accumulation:
            synchronize(device)
            start = time.perf_counter()
        loss = per_image_loss(model(batch["image"]), batch["mask"]).mean() / accumulation
        loss.backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    synchronize(device)
    return args.steps * args.effective_batch, time.perf_counter() - start


def cloudseg(config, batches, args, device, checkpointing):
    model = build_model(config.model, pretrained=False).to(device).train()
    prepare_for_training(model, config.train.channels_last, checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    dtype = autocast_dtype(config.train.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype))
    accumulation = args.effective_batch // args.micro_batch
    windows = [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]
    start = None
    for i, window in enumerate(windows):
        if i == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        train_step(StepContext(model, optimizer, scaler, device, dtype, config.train.grad_clip, config.train.dice_weight), window)
    synchronize(device)
    return args.steps * args.effective_batch, time.perf_counter() - start


def lightning(config, batches, args, device):
    import pytorch_lightning as pl  # optional: pip install pytorch-lightning

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(config.model, pretrained=False)

        def training_step(self, batch, index):
            return per_image_loss(self.model(batch["image"]), batch["mask"]).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=config.train.lr)

    class Clock(pl.Callback):
        start = None

        def on_train_batch_start(self, trainer, module, batch, index):
            if index == args.warmup * accumulation:
                synchronize(device)
                Clock.start = time.perf_counter()

    accumulation = args.effective_batch // args.micro_batch
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision=LIGHTNING_PRECISION[resolve_precision(config.train.precision, device)],
                         accumulate_grad_batches=accumulation, max_steps=args.warmup + args.steps,
                         gradient_clip_val=config.train.grad_clip, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    synchronize(device)
    return args.steps * args.effective_batch, time.perf_counter() - Clock.start


def inference(config, batches, args, device):
    model = build_model(config.model, pretrained=False).to(device).eval()  # as predict.load_model builds it
    dtype = autocast_dtype(config.train.precision, device)
    predict_probs(model, batches[0]["image"], dtype, tta="d4-lite")
    synchronize(device)
    start, images = time.perf_counter(), 0
    for batch in batches[: max(2, args.steps)]:
        predict_probs(model, batch["image"], dtype, tta="d4-lite")
        images += len(batch["image"])
    synchronize(device)
    return images, time.perf_counter() - start


def loading_rate(args) -> float:
    """Samples/s of one process with one thread: JPEG decode, 4 RLE decodes, flips, to tensors."""
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as folder:
        synthesize(folder, n_train=args.loader_images, n_test=1, height=args.loader_size[0], width=args.loader_size[1], seed=1)
        dataset = CloudDataset(folder, transform=build_transform(hflip=0.5, vflip=0.5))
        for index in range(len(dataset)):
            dataset[index, index]  # warm the page cache
        rates = []
        for repeat in range(5):
            start = time.perf_counter()
            for index in range(len(dataset)):
                dataset[index, index + repeat]
            rates.append(len(dataset) / (time.perf_counter() - start))
    rates.sort()
    return rates[len(rates) // 2]


def print_table(rows) -> None:
    base = rows["a. textbook loop (fp32)"][0]
    print(f"\n| run | images/s | peak GiB | vs (a) |\n| --- | ---: | ---: | ---: |")
    for name, result in rows.items():
        if result is None:
            print(f"| {name} | skipped | | |")
        else:
            print(f"| {name} | {result[0]:.2f} | {result[1]:.2f} | {result[0] / base:.2f}x |")


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def header(args, device) -> str:
    return (f"{device_name(device)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: UNet-{args.encoder} "
            f"at {args.height}x{args.width}, micro-batch {args.micro_batch}, effective batch {args.effective_batch}, "
            f"{args.steps} timed steps after {args.warmup} warmup")


if __name__ == "__main__":
    main()
