"""Loader-bound training throughput, data.decode=cpu vs gpu; prints a table.

Samples/s through a DataLoader over synthetic JPEGs (default 24 at 1400x2100), micro-batch
4, flips p=0.5 each, for each number of workers:

  cpu decode (OpenCV in workers)       what training does today: JPEG decode, 4 RLE decodes, flips
  gpu mode, workers only (bytes + masks)  the workers' share in gpu mode: header check, 4 RLE
                                       decodes, mask flips; images left encoded (runs without a GPU)
  gpu decode (nvjpeg)                  the same plus `decode_batch` on the GPU in the main process
                                       (CUDA only; else "unmeasured: no CUDA")

With CUDA, the cpu and gpu rows also move images and masks to the GPU, as the training
step does, and the largest and mean |difference| between their images is printed. Each
figure is the median of --epochs timed passes after one warm-up pass (workers started,
page cache warm): wall-clock, so other processes on the machine lower them. Below the table:
each mode's CPU time per sample in one process (what a worker spends; contention-proof).

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
from torch.utils.data import DataLoader

from cloudseg.data import CloudDataset, EpochSampler, build_transform, collate
from cloudseg.decode import decode_batch
from cloudseg.synth import synthesize

CPU_ROW, WORKERS_ROW, GPU_ROW = ("cpu decode (OpenCV in workers)", "gpu mode, workers only (bytes + masks)",
                                 "gpu decode (nvjpeg)")


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)  # torchvision 0.29 deprecates it
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # more workers than cores: on purpose
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    with tempfile.TemporaryDirectory() as folder:
        synthesize(folder, n_train=args.n, n_test=1, height=args.height, width=args.width, seed=1)
        rows = {
            CPU_ROW: [samples_per_s(folder, "cpu", workers, args, cuda) for workers in args.workers],
            WORKERS_ROW: [samples_per_s(folder, "gpu", workers, args, None) for workers in args.workers],
            GPU_ROW: [samples_per_s(folder, "gpu", workers, args, cuda) for workers in args.workers] if cuda else None,
        }
        difference = image_difference(folder, cuda) if cuda else None
        cost = {mode: item_ms(folder, mode, args.epochs) for mode in ("cpu", "gpu")}
    print(header(args, cuda))
    print_table(rows, args.workers)
    print(f"\nCPU time per sample in one process, one thread: cpu mode {cost['cpu']:.1f} ms, "
          f"gpu mode's worker share {cost['gpu']:.1f} ms ({cost['cpu'] / cost['gpu']:.1f}x less CPU per sample)")
    if difference:
        print(f"\ngpu vs cpu decode: max |image difference| {difference[0]}, mean {difference[1]:.4f} levels")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=1400)
    parser.add_argument("--width", type=int, default=2100)
    parser.add_argument("--n", type=int, default=24, help="synthetic training images")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="DataLoader worker counts")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3, help="timed passes (after one warm-up pass)")
    return parser.parse_args()


def samples_per_s(folder, decode: str, workers: int, args, device) -> float:
    """Median samples/s over the timed passes; with `device`, batches end decoded on it."""
    dataset = CloudDataset(folder, transform=build_transform(hflip=0.5, vflip=0.5), decode=decode)
    sampler = EpochSampler(len(dataset), seed=0)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=workers,
                        collate_fn=collate, pin_memory=device is not None, persistent_workers=workers > 0,
                        prefetch_factor=2 if workers else None)
    seconds = []
    for epoch in range(args.epochs + 1):  # pass 0 starts the workers and warms the page cache
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for batch in loader:
            if device is not None:
                deliver(batch, device)
        if device is not None:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return len(dataset) / statistics.median(seconds[1:])


def item_ms(folder, decode: str, passes: int) -> float:
    """Median CPU ms per item of `dataset[index, seed]` in this process with one thread: what
    a worker spends per sample, without the DataLoader's transfers. CPU time, not wall-clock,
    so other processes competing for the cores barely change it."""
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    dataset = CloudDataset(folder, transform=build_transform(hflip=0.5, vflip=0.5), decode=decode)
    seconds = []
    for seed in range(passes + 1):  # pass 0 warms the page cache
        start = time.process_time()
        for index in range(len(dataset)):
            dataset[index, seed]
        seconds.append((time.process_time() - start) / len(dataset))
    return 1e3 * statistics.median(seconds[1:])


def deliver(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and masks on `device`, as the training step gets them."""
    batch = decode_batch(batch, device)
    return batch["image"].to(device, non_blocking=True), batch["mask"].to(device, non_blocking=True)


def image_difference(folder, device) -> tuple[int, float]:
    """(max, mean) |difference| between cpu-mode images and gpu-mode images decoded on `device`."""
    modes = [CloudDataset(folder, transform=build_transform(0.5, 0.5), decode=mode) for mode in ("cpu", "gpu")]
    worst, total = 0, 0.0
    for index in range(len(modes[0])):
        cpu = collate([modes[0][index, index]])["image"].to(device)
        gpu = decode_batch(collate([modes[1][index, index]]), device)["image"]
        difference = (cpu.int() - gpu.int()).abs()
        worst, total = max(worst, difference.max().item()), total + difference.float().mean().item()
    return worst, total / len(modes[0])


def header(args, cuda) -> str:
    machine = torch.cuda.get_device_name(cuda) + ", " if cuda else ""
    return (f"{machine}CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch "
            f"{torch.__version__}, torchvision {torchvision.__version__}, {time.strftime('%Y-%m-%d')}: "
            f"{args.n} synthetic {args.height}x{args.width} JPEGs, micro-batch {args.micro_batch}, "
            f"median of {args.epochs} passes")


def print_table(rows: dict, workers: list[int]) -> None:
    print("\n| samples/s | " + " | ".join(f"{count} worker{'s' * (count != 1)}" for count in workers) + " |")
    print("| --- |" + " ---: |" * len(workers))
    for name, rates in rows.items():
        cells = ["unmeasured: no CUDA"] * len(workers) if rates is None else [f"{rate:.1f}" for rate in rates]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
