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
prediction and checkpoints all see one model. It keeps no Python number inside the model,
so that with `train.compile` each micro-batch's forward and loss are one graph (compiled.py).
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
from cloudseg.compiled import compile_logged, compiled
from cloudseg.decode import decode_batch
from cloudseg.hardware import autocast
from cloudseg.loss import per_image_loss
from cloudseg.model import forward_with_classes, norm_statistics, restore_norm_statistics
from cloudseg.syncs import named_sync

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
    compile: bool = False  # train.compile: each micro-batch's forward and loss as one torch.compile graph
    cls_weight: float = 0.1  # + cls_weight × the classification head's BCE (a model with model.cls_head)
    autotune: str = "off"  # train.speedups.autotune: inductor's autotuning of the compiled step

    def __post_init__(self):
        self.losses = compiled(micro_batch_losses, self.autotune) if self.compile else micro_batch_losses


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


def micro_batch_losses(model: torch.nn.Module, images: torch.Tensor, masks: torch.Tensor, dtype: torch.dtype | None,
                       dice_weight: float, cls_weight: float = 0.1) -> torch.Tensor:
    """Forward one micro-batch under autocast; its per-image losses (the head's included), in fp32 or wider."""
    with autocast(images.device, dtype):
        logits, class_logits = forward_with_classes(model, images)
    return per_image_loss(logits, masks, dice_weight, class_logits, cls_weight)


def accumulate(ctx: StepContext, micro_batches: list[dict], window_images: int, weight: float = 1.0,
               statistics: WindowStatistics | None = None) -> torch.Tensor:
    """Forward and backward through each micro-batch, its loss weighted by its share of the
    window (`weight` × the sum of its per-image losses / `window_images`); gradients add up in
    the parameters, and `statistics` gathers each micro-batch's BatchNorm statistics. Only the
    last micro-batch all-reduces under DDP. Returns the summed loss."""
    window_loss = torch.zeros((), device=ctx.device)
    for i, batch in enumerate(micro_batches):
        with distributed.gradient_sync(ctx.model, now=i == len(micro_batches) - 1):
            batch = decode_batch(batch, ctx.device)
            images = batch["image"].to(ctx.device, non_blocking=True)
            masks = batch["mask"].to(ctx.device, non_blocking=True)
            # The shape is known only once decoded: in gpu mode the worker sends JPEG bytes.
            with compile_logged(ctx.compile, images.shape, distributed.world_size()):
                losses = ctx.losses(ctx.model, images, masks, ctx.dtype, ctx.dice_weight, ctx.cls_weight)
                if statistics is not None:
                    statistics.add()  # outside the compiled graph
                loss = losses.sum() * weight / window_images
                ctx.scaler.scale(loss).backward()  # fp16: the scale is constant inside the window
        window_loss += loss.detach()
    return window_loss


def train_step(ctx: StepContext, window: list[dict], micro_batch: int | None = None,
               window_images: int | None = None, blank: dict | None = None) -> StepResult:
    """Accumulate one window's gradient, then take one optimizer step (none if the loss or
    gradient is not finite: then the window leaves no trace, its BatchNorm statistics included).

    `micro_batch` re-cuts the window's batches smaller (after an out-of-memory error): the
    weights are per image, so the update does not change. On several processes `ctx.model` is
    DDP, `window` this rank's part and `window_images` the images of all parts; a rank whose
    part is empty feeds `blank` with weight 0, so that it still joins the all-reduce.
    """
    world = distributed.world_size()
    window_images = window_images or sum(len(batch["image"]) for batch in window)
    micro_batches = split(window, micro_batch) or [blank]
    # DDP averages the ranks' gradients: scaling by `world` makes that average the window's sum.
    # The blank batch's BatchNorm statistics are not gathered.
    with window_norm_statistics(ctx.model) as statistics:
        window_loss = accumulate(ctx, micro_batches, window_images, world if window else 0,
                                 statistics if window else None)
    with named_sync("window end", ctx.device):
        result = optimizer_step(ctx, window_loss, world)
    if result.skipped:  # every rank alike: the loss and the gradient norm are all-reduced
        statistics.restore()
    return result


def optimizer_step(ctx: StepContext, window_loss: torch.Tensor, world: int) -> StepResult:
    """Unscale (fp16), clip, and step once, unless the loss or gradient is not finite; the
    gradients are cleared either way. Reads the loss and the gradient norm: a host sync."""
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
    """Around a window's forward passes: each BatchNorm layer in training mode keeps only the
    statistics of the micro-batch it last saw (momentum 1), which `WindowStatistics.add` sums
    after each forward, outside the model; on exit each layer takes one momentum step from
    its old running statistics toward their mean over all processes (one all-reduce). On an
    error the old statistics come back untouched. Yields the WindowStatistics."""
    statistics = WindowStatistics(model)
    for layer in statistics.layers:
        layer.momentum = 1.0  # a constant: `momentum=None` would put a Python float of a tensor in every layer
    try:
        yield statistics
    except BaseException:
        statistics.restore()
        raise
    statistics.step()


class WindowStatistics:
    """The BatchNorm statistics of one window: each layer's running statistics before it, and
    the sums over the window's micro-batches of the statistics each one normalized with."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
        self.before = [(m.momentum, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
                       for m in self.layers]
        size = sum(2 * len(m.running_mean) for m in self.layers)
        device = self.layers[0].running_mean.device if self.layers else None
        self.sums = torch.zeros(size + 1, dtype=torch.float64, device=device)  # means, variances, micro-batches

    def add(self) -> None:
        """After a micro-batch's forward: add each layer's running mean and (unbiased) variance,
        which momentum 1 made that micro-batch's own. Assumes each layer ran once in that forward
        (as in every network model.py builds). Tensor operations only: nothing waits for the GPU."""
        if self.layers:
            self.sums[:-1] += torch.cat([s for m in self.layers for s in (m.running_mean, m.running_var)])
            self.sums[-1] += 1

    def restore(self) -> None:
        """Every layer as before the window."""
        with torch.no_grad():
            for layer, (momentum, mean, var, count) in zip(self.layers, self.before):
                layer.momentum = momentum
                layer.running_mean.copy_(mean), layer.running_var.copy_(var), layer.num_batches_tracked.copy_(count)

    @torch.no_grad()
    def step(self) -> None:
        """Running statistics ← (1 - momentum) × old + momentum × (this window's mean over every
        process's micro-batches); num_batches_tracked counts windows, and momentum None (a
        cumulative average) weighs window k by 1 / k. In float64; no host sync."""
        if not self.layers:
            return
        sums = distributed.summed(self.sums)
        micro_batches, offset = sums[-1], 0
        learned = micro_batches > 0  # else no process had an image: nothing to learn from
        for layer, (momentum, mean, var, count) in zip(self.layers, self.before):
            size = len(mean)
            window = sums[offset : offset + 2 * size] / micro_batches
            offset += 2 * size
            factor = momentum if momentum is not None else 1 / (count.double() + 1)
            old = torch.cat([mean, var]).double()
            new = torch.where(learned, (1 - factor) * old + factor * window, old)
            layer.momentum = momentum
            layer.running_mean.copy_(new[:size]), layer.running_var.copy_(new[size:])
            layer.num_batches_tracked.copy_(count + learned.long())


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
        # Past the except block the error is gone, and with its traceback the failed attempt's
        # tensors (activations, decoded images), so that the cache can give their memory back.
        ctx.optimizer.zero_grad(set_to_none=True)
        restore_norm_statistics(ctx.model, saved_statistics)  # undo the failed attempt's BatchNorm updates
        return_cached_memory(ctx.device)
        micro_batch //= 2
        log.warning("CUDA out of memory: micro-batch now %d, accumulation %d; redoing the window",
                    micro_batch, math.ceil(sum(len(batch["image"]) for batch in window) / micro_batch))


def return_cached_memory(device: torch.device) -> None:
    """The caching allocator's free blocks back to the GPU (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
