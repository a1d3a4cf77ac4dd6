"""Training on several processes started by torchrun (one per GPU, or gloo on CPU): the
all-reduces and shards under the accumulated step and validation of the data path.

On a single process every function here is a no-op or an identity, so the training loop
reads the same either way. torchrun sets RANK, LOCAL_RANK and WORLD_SIZE.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cloudseg.syncs import named_sync


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0 writes the run directory; the others only compute."""
    return rank() == 0


def start(device: torch.device, share_gpus: bool = False) -> torch.device:
    """Join the process group; returns this rank's device. Training: one process per GPU (the
    LOCAL_RANK-th), NCCL on CUDA, gloo on the CPU. With `share_gpus` (segment, whose only
    collectives are a few Python objects at the end) a machine's processes take its GPUs in turn,
    several to a GPU where there are more processes than GPUs, and gather through gloo: NCCL
    refuses two processes on one GPU."""
    if world_size() == 1:
        return device
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count() if share_gpus else local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" and not share_gpus else "gloo")
    return device


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model that training runs forward through: DDP across processes, else the model."""
    if world_size() == 1:
        return model
    # No buffer broadcast: DDP would copy rank 0's BatchNorm statistics over the others' in the
    # middle of a window; engine.window_norm_statistics makes them agree at its end instead.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False)


def gradient_sync(model: torch.nn.Module, now: bool):
    """DDP all-reduces gradients during a backward unless told not to: only the window's
    last micro-batch syncs, so a window costs one all-reduce however long it is."""
    if isinstance(model, DistributedDataParallel) and not now:
        return model.no_sync()
    return contextlib.nullcontext()


def total(value: float, device: torch.device) -> float:
    """The sum of `value` over all processes."""
    if world_size() == 1:
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    with named_sync("ranks agree", device):
        return tensor.item()


def smallest(value: int, device: torch.device) -> int:
    """The smallest of every process's `value`."""
    return _reduced(value, device, "MIN")


def largest(value: int, device: torch.device) -> int:
    """The largest of every process's `value`."""
    return _reduced(value, device, "MAX")


def _reduced(value: int, device: torch.device, op: str) -> int:
    if world_size() == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    with named_sync("ranks agree", device):
        return int(tensor.item())


def summed(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed element-wise over all processes (the tensor itself on one process)."""
    if world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def gathered(items: list) -> list:
    """Every process's `items`, concatenated in rank order (the same list on every rank)."""
    if world_size() == 1:
        return list(items)
    parts = [None] * world_size()
    dist.all_gather_object(parts, list(items))
    return [item for part in parts for item in part]


def shard(size: int) -> list[int]:
    """This process's indices of a `size`-item evaluation set (every world_size-th one)."""
    return list(range(rank(), size, world_size()))


def shard_batches(size: int, batch_size: int) -> list[int]:
    """This process's indices of a `size`-item set read in batches of `batch_size`: every
    world_size-th whole batch of the one-process order, so the processes see its batches."""
    starts = range(rank() * batch_size, size, world_size() * batch_size)
    return [index for start in starts for index in range(start, min(start + batch_size, size))]


def launch(argv: list[str]) -> int:
    """torchrun with `argv` (`make train NPROC=N`). A process that fails has printed its own
    error (cloudseg's one line); torchrun's traceback after it is replaced by one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        print(f"torchrun: {len(error.failures)} process(es) failed, first rank {rank} with exit code "
              f"{failure.exitcode}: its error is above", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
