"""Loader throughput, data.decode=cpu against gpu; prints two tables.

Samples/s through the training DataLoader (`data.make_loader`, EpochSampler's seeds,
micro-batch 4) over synthetic JPEGs (default 24 at 1400x2100) with the augmentation of
configs/fullres.yaml (flips, shift-scale-rotate, brightness/contrast), for each number of
workers (default 1, 2, 4, 8: those the machine has cores for):

  cpu mode: decode + augment in the workers      JPEG decode, 4 RLE decodes, augmentation,
                                                 copies; with CUDA the batch then goes to the
                                                 GPU as the training step moves it
  gpu mode: the workers' share (bytes, runs, draws)   header check, RLE parse, the draws;
                                                 nothing decoded (runs without a GPU)
  gpu mode: + decode and augment on DEVICE       the same, then `decode.decode_batch` in the
                                                 main process on CUDA, or without a GPU on the
                                                 CPU (the same tensor code, far slower there)

The second table is the main process's CPU time per sample: `time.process_time()` of this
process (all its threads) over a pass, divided by the samples; what feeding the GPU costs
the training process. Each figure is the median of --epochs timed passes after one warm-up
pass (workers started, page cache warm); wall-clock, so other processes on the machine lower
the samples/s. Below the tables: each mode's CPU time per sample in one process with one
thread (what a worker spends), and with CUDA the largest and mean |difference| between the
two modes' images (nvjpeg against OpenCV).

Usage: python benchmarks/loader_speed.py [--height H --width W --n N --workers 1 2 4 --epochs E]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings

import cv2
import torch
import torchvision

from cloudseg.cli import add_device_option
from cloudseg.config import DataConfig, load_config
from cloudseg.data import CloudDataset, EpochSampler, build_transform, collate, make_loader
from cloudseg.decode import decode_batch
from cloudseg.hardware import resolve_device
from cloudseg.synth import synthesize

CPU_ROW, WORKERS_ROW = "cpu mode: decode + augment in the workers", "gpu mode: the workers' share (bytes, runs, draws)"
AUGMENT = load_config("configs/fullres.yaml").augment.model_dump()


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)  # torchvision 0.29 deprecates it
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # more workers than cores: on purpose
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as folder:
        synthesize(folder, n_train=args.n, n_test=1, height=args.height, width=args.width, seed=1)
        rows = {
            CPU_ROW: [measure(folder, "cpu", workers, args, device if cuda else None) for workers in args.workers],
            WORKERS_ROW: [measure(folder, "gpu", workers, args, None) for workers in args.workers],
            f"gpu mode: + decode and augment on {device.type}": [measure(folder, "gpu", workers, args, device)
                                                                 for workers in args.workers],
        }
        difference = image_difference(folder, device) if cuda else None
        cost = {mode: item_ms(folder, mode, args.epochs) for mode in ("cpu", "gpu")}
    print(header(args, cuda))
    print_table("samples/s", {name: [rate for rate, _ in cells] for name, cells in rows.items()}, args.workers)
    print_table("main-process CPU ms/sample", {name: [ms for _, ms in cells] for name, cells in rows.items()},
                args.workers)
    print(f"\nCPU time per sample in one process, one thread: cpu mode {cost['cpu']:.1f} ms, "
          f"gpu mode's worker share {cost['gpu']:.1f} ms ({cost['cpu'] / cost['gpu']:.1f}x less CPU per sample)")
    if difference:
        print(f"\ngpu vs cpu mode: max |image difference| {difference[0]}, mean {difference[1]:.4f} levels")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=1400)
    parser.add_argument("--width", type=int, default=2100)
    parser.add_argument("--n", type=int, default=24, help="synthetic training images")
    parser.add_argument("--workers", type=int, nargs="+", help="DataLoader worker counts (default 1 2 4 8, up to the cores)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3, help="timed passes (after one warm-up pass)")
    add_device_option(parser, "the batches are delivered")
    args = parser.parse_args()
    args.workers = args.workers or [count for count in (1, 2, 4, 8) if count <= (os.cpu_count() or 1)]
    return args


def dataset_for(folder, decode: str) -> CloudDataset:
    dataset = CloudDataset(folder, decode=decode)
    dataset.transform = build_transform(**AUGMENT, image_size=dataset.image_size)
    return dataset


def measure(folder, decode: str, workers: int, args, device) -> tuple[float, float]:
    """(samples/s, main-process CPU ms per sample), medians over the timed passes; with
    `device`, every batch ends decoded on it, as the training step gets it."""
    dataset = dataset_for(folder, decode)
    sampler = EpochSampler(len(dataset), seed=0)
    loader = make_loader(dataset, DataConfig(num_workers=workers, prefetch_factor=2), args.micro_batch,
                         device or torch.device("cpu"), sampler, every_epoch=True)
    seconds, cpu_seconds = [], []
    for epoch in range(args.epochs + 1):  # pass 0 starts the workers and warms the page cache
        sampler.set_epoch(epoch)
        wall, cpu = time.perf_counter(), time.process_time()
        for batch in loader:
            if device is not None:
                deliver(batch, device)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - wall)
        cpu_seconds.append(time.process_time() - cpu)
    return len(dataset) / statistics.median(seconds[1:]), 1e3 * statistics.median(cpu_seconds[1:]) / len(dataset)


def deliver(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and masks on `device`, as engine.accumulate gets them."""
    batch = decode_batch(batch, device)
    return batch["image"].to(device, non_blocking=True), batch["mask"].to(device, non_blocking=True)


def item_ms(folder, decode: str, passes: int) -> float:
    """Median CPU ms per item of `dataset[index, seed]` in this process with one thread: what
    a worker spends per sample, without the DataLoader's transfers. CPU time, not wall-clock,
    so other processes competing for the cores barely change it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    dataset = dataset_for(folder, decode)
    seconds = []
    for seed in range(passes + 1):  # pass 0 warms the page cache
        start = time.process_time()
        for index in range(len(dataset)):
            dataset[index, seed]
        seconds.append((time.process_time() - start) / len(dataset))
    torch.set_num_threads(threads)
    return 1e3 * statistics.median(seconds[1:])


def image_difference(folder, device) -> tuple[int, float]:
    """(max, mean) |difference| between cpu-mode images and gpu-mode images decoded and
    augmented on `device`, item by item from the same seeds."""
    modes = [dataset_for(folder, mode) for mode in ("cpu", "gpu")]
    worst, total = 0, 0.0
    for index in range(len(modes[0])):
        cpu = collate([modes[0][index, index]])["image"].to(device)
        gpu = decode_batch(collate([modes[1][index, index]]), device)["image"]
        difference = (cpu.int() - gpu.int()).abs()
        worst, total = max(worst, difference.max().item()), total + difference.float().mean().item()
    return worst, total / len(modes[0])


def header(args, cuda: bool) -> str:
    machine = torch.cuda.get_device_name() + ", " if cuda else ""  # the current GPU: the one --device cuda takes
    steps = ", ".join(f"{name} {p}" for name, p in AUGMENT.items() if p)
    return (f"{machine}CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch "
            f"{torch.__version__}, torchvision {torchvision.__version__}, {time.strftime('%Y-%m-%d')}: "
            f"{args.n} synthetic {args.height}x{args.width} JPEGs, micro-batch {args.micro_batch}, "
            f"augment {steps}, median of {args.epochs} passes")


def print_table(what: str, rows: dict, workers: list[int]) -> None:
    print(f"\n| {what} | " + " | ".join(f"{count} worker{'s' * (count != 1)}" for count in workers) + " |")
    print("| --- |" + " ---: |" * len(workers))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{value:.1f}" for value in values) + " |")


if __name__ == "__main__":
    main()
