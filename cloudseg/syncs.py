"""The host syncs of the training window (and of `cloudseg segment`), each one meant, named and counted.

Data path: beside the accumulated step (engine.py) and the GPU decode (decode.py) that feeds it.

A host sync (`.item()`, `float()` or `.tolist()` of a CUDA tensor, a blocking copy, a stream's
`synchronize`) makes the CPU wait for every kernel queued so far. In the training window that
stops the CPU from running ahead of the GPU: the GPU then idles while the CPU prepares the next
micro-batch. So a steady-state window (decode, augmentation replay, forward, backward, step)
makes only the syncs listed in `NAMED`, each inside `named_sync`, which counts it and, on a GPU,
lets it through `torch.cuda.set_sync_debug_mode`: with the mode at "error" (tests/test_gpu.py)
any other sync in the window raises. docs/memory-and-gpus.md lists them. `segment rows` waits on
an event instead: for the work queued before it alone, which that mode does not check.
"""

from __future__ import annotations

import collections
import contextlib

import torch

NAMED = {
    "decode stream": "before each GPU JPEG decode, the decoder's own stream is drained: nvJPEG writes its outputs "
                     "without waiting for work queued before it (docs/memory-and-gpus.md); that stream holds no "
                     "training work, so the wait is short",
    "window end": "once per window, the loss and the gradient norm are read for the finite check and the log "
                  "(with fp16, GradScaler's overflow check and scale too)",
    "ema": "once per optimizer step with train.ema: torch's AveragedModel reads its update count",
    "ranks agree": "with several processes only, twice per window: how many images all ranks have, and whether "
                   "any was asked to stop (an all-reduced number read on the host)",
    "segment rows": "cloudseg segment on a GPU, once per row of windows: the finished rows' uint8 output bands and "
                    "counts copied to the host for writing (the writer waits on an event behind the copies)",
}
counts: collections.Counter[str] = collections.Counter()  # named syncs made in this process, by name


@contextlib.contextmanager
def named_sync(name: str, device: torch.device, checked: bool = True):
    """Around a host sync the code means to make (one of `NAMED`): counted, and on a CUDA device
    exempt from `torch.cuda.set_sync_debug_mode` for its duration where that mode `checked` it (a
    stream's synchronize, a blocking copy, a value read). An event's synchronize, which waits for
    the work queued before the event alone, is not checked: the mode, process-wide, stays on then,
    for the other threads' syncs."""
    if name not in NAMED:
        raise KeyError(f"{name!r} is not a named sync ({', '.join(NAMED)})")
    counts[name] += 1
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" and checked else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
