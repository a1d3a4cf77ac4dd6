"""The accumulation engine: one optimizer step from one window of micro-batches, equal to the
step a single big batch would give.

Data path: train.csv → Dataset → loader → model → loss → **accumulated step** → checkpoint →
probabilities at 350×525 → post-process → submission.

An optimizer step consumes one *window* of `effective_batch` images, fed as micro-batches.
Each micro-batch's loss is the sum of its per-image losses over the number of images in the
whole window, so the accumulated gradient is exactly the gradient of the window's mean loss,
also for the short last window of an epoch (which never borrows images from the next epoch).

BatchNorm running statistics move once per window, as for one big batch: each layer's
running mean and variance take one momentum step toward the mean of the window's
micro-batch statistics, pooled over every process. This does not depend on how the
micro-batches are dealt to processes, so every rank holds the same statistics after every
window, equal (up to rounding) to what one process holds: validation, out-of-fold
prediction and checkpoints all see one model.
The training run (train.py) and the memory planner (memory.py) both step through here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from cloudseg import distributed
from cloudseg.decode import decode_batch
from cloudseg.hardware import autocast
from cloudseg.loss import per_image_loss
from cloudseg.model import norm_statistics, norm_statistics_kept, restore_norm_statistics

log = logging.getLogger("cloudseg")


@dataclass
class StepContext:
    """What a training step needs, in one place."""

    model: torch.nn.Module  # DistributedDataParallel on several processes
    optimizer: torch.optim.Optimizer | None  # None: gradients only (the memory planner's probe)
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    device: torch.device
    dtype: torch.dtype | None = None  # autocast dtype; None = plain fp32
    grad_clip: float | None = None  # max global gradient norm; None = no clipping
    dice_weight: float = 1.0  # loss = BCE + dice_weight × soft Dice


class StepResult(NamedTuple):
    loss: float
    grad_norm: float
    skipped: bool  # a non-finite loss or gradient: no update was made


def windows(loader, accumulation_steps: int, count: int | None = None):
    """Group an epoch's micro-batches into optimizer windows; the last one may be short.

    With `count`, exactly that many windows, empty ones after the loader runs out: on several
    processes every rank must take part in every window, even with nothing of its own.
    """
    batches = iter(loader)
    for _ in itertools.count() if count is None else range(count):
        window = list(itertools.islice(batches, accumulation_steps))
        if not window and count is None:
            return
        yield window


def split(window: list[dict], micro_batch: int | None) -> list[dict]:
    """The window's batches cut into micro-batches of at most `micro_batch` images, in order."""
    if micro_batch is None:
        return window
    return [{key: value[start : start + micro_batch] for key, value in batch.items()}
            for batch in window for start in range(0, len(batch["image"]), micro_batch)]


def accumulate(ctx: StepContext, micro_batches: list[dict], window_images: int, weight: float = 1.0) -> torch.Tensor:
    """Forward and backward through each micro-batch, its loss weighted by its share of the
    window (`weight` × the sum of its per-image losses / `window_images`); gradients add up in
    the parameters. Only the last micro-batch all-reduces under DDP. Returns the summed loss."""
    window_loss = torch.zeros((), device=ctx.device)
    for i, batch in enumerate(micro_batches):
        with distributed.gradient_sync(ctx.model, now=i == len(micro_batches) - 1):
            batch = decode_batch(batch, ctx.device)
            images = batch["image"].to(ctx.device, non_blocking=True)
            masks = batch["mask"].to(ctx.device, non_blocking=True)
            with autocast(ctx.device, ctx.dtype):
                logits = ctx.model(images)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # loss in >= fp32
            loss = per_image_loss(logits, masks, ctx.dice_weight).sum() * weight / window_images
            ctx.scaler.scale(loss).backward()  # fp16: the scale is constant inside the window
        window_loss += loss.detach()
    return window_loss


def train_step(ctx: StepContext, window: list[dict], micro_batch: int | None = None,
               window_images: int | None = None, blank: dict | None = None) -> StepResult:
    """Accumulate one window's gradient, then take one optimizer step (none if the loss or
    gradient is not finite).

    `micro_batch` re-cuts the window's batches smaller (after an out-of-memory error): the
    weights are per image, so the update does not change. On several processes `ctx.model` is
    DDP, `window` this rank's part and `window_images` the images of all parts; a rank whose
    part is empty feeds `blank` with weight 0, so that it still joins the all-reduce.
    """
    world = distributed.world_size()
    window_images = window_images or sum(len(batch["image"]) for batch in window)
    # DDP averages the ranks' gradients: scaling by `world` makes that average the window's sum.
    with window_norm_statistics(ctx.model), norm_statistics_kept(ctx.model) if not window else contextlib.nullcontext():
        window_loss = accumulate(ctx, split(window, micro_batch) or [blank], window_images, world if window else 0)
    ctx.scaler.unscale_(ctx.optimizer)  # once per window, so clipping sees the true gradient
    grad_norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.grad_clip or math.inf).item()
    loss = distributed.total(window_loss.item(), ctx.device) / world
    if ctx.scaler.is_enabled():  # fp16: the scaler skips the step itself when the gradient overflowed
        scale = ctx.scaler.get_scale()
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
        skipped = ctx.scaler.get_scale() < scale
    else:
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, skipped)


@contextlib.contextmanager
def window_norm_statistics(model: torch.nn.Module):
    """Around a window's forward passes: each BatchNorm layer in training mode averages the
    statistics of its micro-batches (momentum None is PyTorch's cumulative average), and on
    exit takes one momentum step from its old running statistics toward that average over
    all processes (one all-reduce). On an error the old statistics come back untouched."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    before = [(m.momentum, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
              for m in layers]
    for layer in layers:
        layer.momentum = None
        layer.num_batches_tracked.zero_()
    try:
        yield
    except BaseException:
        for layer, (_, mean, var, count) in zip(layers, before):
            layer.running_mean.copy_(mean), layer.running_var.copy_(var), layer.num_batches_tracked.copy_(count)
        raise
    else:
        if layers:
            _step_running_statistics(layers, before)
    finally:
        for layer, (momentum, *_) in zip(layers, before):
            layer.momentum = momentum


@torch.no_grad()
def _step_running_statistics(layers: list[_BatchNorm], before: list[tuple]) -> None:
    """Running statistics ← (1 - momentum) × old + momentum × (this window's mean over every
    process's micro-batches); num_batches_tracked counts windows. Sums travel in float64."""
    sums = torch.cat([torch.cat([m.running_mean * m.num_batches_tracked, m.running_var * m.num_batches_tracked,
                                 m.num_batches_tracked.view(1)]).double() for m in layers])
    sums = distributed.summed(sums)
    offset = 0
    for layer, (momentum, mean, var, count) in zip(layers, before):
        size = len(mean)
        window_mean, window_var = sums[offset : offset + size], sums[offset + size : offset + 2 * size]
        micro_batches = sums[offset + 2 * size]
        offset += 2 * size + 1
        if micro_batches == 0:  # no process had an image for this layer: nothing to learn from
            layer.running_mean.copy_(mean), layer.running_var.copy_(var), layer.num_batches_tracked.copy_(count)
            continue
        factor = momentum if momentum is not None else 1 / (int(count) + 1)
        layer.running_mean.copy_((1 - factor) * mean.double() + factor * window_mean / micro_batches)
        layer.running_var.copy_((1 - factor) * var.double() + factor * window_var / micro_batches)
        layer.num_batches_tracked.copy_(count + 1)


def resilient_step(ctx: StepContext, window: list[dict], micro_batch: int, window_images: int | None = None,
                   blank: dict | None = None) -> tuple[StepResult, int]:
    """`train_step` that survives CUDA out-of-memory: halve the micro-batch (doubling the
    accumulation) and redo the interrupted window from its start, so the update is the one
    it would have been. Returns (the step's result, micro-batch now in use).

    Not on several processes: a redo there would put the ranks' all-reduces out of step.
    """
    saved_statistics = norm_statistics(ctx.model)
    while True:
        try:
            return train_step(ctx, window, micro_batch, window_images, blank), micro_batch
        except torch.cuda.OutOfMemoryError:
            if micro_batch == 1 or distributed.world_size() > 1:
                raise
            ctx.optimizer.zero_grad(set_to_none=True)
            restore_norm_statistics(ctx.model, saved_statistics)  # undo the failed attempt's BatchNorm updates
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            micro_batch //= 2
            log.warning("CUDA out of memory: micro-batch now %d, accumulation %d; redoing the window",
                        micro_batch, math.ceil(sum(len(batch["image"]) for batch in window) / micro_batch))
