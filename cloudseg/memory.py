"""How much GPU memory a training step takes, and the largest micro-batch that fits.

Data path: the planner beside the accumulated step: it probes the engine's own forward and
backward (engine.accumulate) to choose `train.micro_batch: auto` before the run starts.

On CUDA, peaks are measured on real training steps. On CPU they are estimated: weights,
gradients and AdamW state from the parameter count, plus the activations saved for backward,
counted by autograd hooks during one forward pass (at half size per side for large images,
scaled by area; floating-point tensors scaled from fp32 to the autocast dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cloudseg import distributed
from cloudseg.config import Config, apply_overrides, from_dict
from cloudseg.data import padded_shape
from cloudseg.engine import StepContext, accumulate, resilient_step
from cloudseg.hardware import autocast_dtype, needs_grad_scaler, resolve_precision
from cloudseg.model import (CloudNet, build_model, checkpoint_blocks, norm_statistics,
                            prepare_for_training, restore_norm_statistics)
from cloudseg.task import IMAGE_SHAPE, LABELS

log = logging.getLogger("cloudseg")

CARDS_GB = (6, 8, 11, 16, 24, 40, 80)
SAFETY_MARGIN = 0.10  # keep 10% of the card free for fragmentation and the CUDA context
CHECKPOINTING_MODES = ("none", "encoder", "full")
PROBE_AREA = 704 * 1056  # CPU estimates run at most this many pixels, then scale by area


@dataclass
class StepMemory:
    """Bytes of one training step: a fixed part plus a part per image of the micro-batch."""

    weights: float
    gradients: float
    optimizer: float
    activations_per_image: float
    other: float = 0.0  # measured only: CUDA context, cuDNN workspaces, allocator slack

    @property
    def fixed(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.other

    def peak(self, micro_batch: int) -> float:
        return self.fixed + micro_batch * self.activations_per_image

    def largest_micro_batch(self, capacity_bytes: float, margin: float = SAFETY_MARGIN) -> int:
        """Largest micro-batch whose peak stays under capacity minus the margin (0 = none fits)."""
        room = (1 - margin) * capacity_bytes - self.fixed
        return max(0, int(room // self.activations_per_image))


def largest_fitting(candidates, peak_of, capacity_bytes: float, margin: float = SAFETY_MARGIN) -> int:
    """The largest candidate micro-batch whose measured peak fits; `peak_of(n)` may raise OOM."""
    for micro_batch in sorted(candidates, reverse=True):
        try:
            peak = peak_of(micro_batch)
        except torch.cuda.OutOfMemoryError:
            log.info("micro-batch %d: out of memory", micro_batch)
            continue
        log.info("micro-batch %d: peak %.2f GiB of %.2f GiB", micro_batch, peak / 2**30, capacity_bytes / 2**30)
        if peak <= (1 - margin) * capacity_bytes:
            return micro_batch
    raise RuntimeError(f"not even a micro-batch of {min(candidates)} fits in {capacity_bytes / 2**30:.1f} GiB; "
                       "try train.checkpointing=full or train.precision=bf16")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------- CUDA


def measured_peak(model: CloudNet, config: Config, micro_batch: int, image_size, device) -> float:
    """Peak CUDA bytes of one forward/backward at `micro_batch`, plus the AdamW state a step adds.

    Leaves the model as it found it (gradients cleared, norm statistics restored).
    """
    dtype = autocast_dtype(config.train.precision, device)
    step = StepContext(model, None, torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype)), device, dtype)
    saved_statistics = norm_statistics(model)
    batch = {"image": torch.randint(0, 256, (micro_batch, 3, *image_size), dtype=torch.uint8, device=device),
             "mask": torch.randint(0, 2, (micro_batch, len(LABELS), *image_size), dtype=torch.uint8, device=device)}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        accumulate(step, [batch], micro_batch)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    finally:
        model.zero_grad(set_to_none=True)
        restore_norm_statistics(model, saved_statistics)
        del batch
        torch.cuda.empty_cache()
    return peak + 2 * parameter_bytes(model)  # AdamW's exp_avg and exp_avg_sq, allocated at the first step


def resolve_micro_batch(config: Config, model: CloudNet, image_size, device, world: int = 1) -> int:
    """`train.micro_batch`, probing the largest that fits when it is `auto` (`world`: processes
    that share each window). Every process probes its own GPU, and all take the smallest
    answer: the sampler cuts windows by it, so the processes must agree."""
    micro_batch = config.train.micro_batch
    if micro_batch != "auto":
        return micro_batch
    if config.train.effective_batch % world:
        raise ValueError(f"train.effective_batch ({config.train.effective_batch}) must be a multiple of "
                         f"the number of processes ({world})")
    candidates = divisors(config.train.effective_batch // world)
    if device.type != "cuda":
        chosen = max(d for d in candidates if d <= 4)
        log.info("train.micro_batch=auto on %s: nothing to probe, using %d", device, chosen)
        return chosen
    buckets = parameter_bytes(model) if world > 1 else 0  # DDP's gradient buckets: one more copy of the gradients
    chosen = largest_fitting(candidates, lambda n: measured_peak(model, config, n, image_size, device) + buckets,
                             available_bytes(device))
    agreed = distributed.smallest(chosen, device)
    if agreed != chosen:
        log.info("train.micro_batch=auto: %d fits this GPU, %d fits every process's", chosen, agreed)
    log.info("train.micro_batch=auto: %d (accumulation %d)", agreed, config.train.effective_batch // world // agreed)
    return agreed


def available_bytes(device: torch.device) -> int:
    """What this process can hold on its GPU: the free memory (other processes on the same GPU
    count) plus what its own allocator has reserved already, within its memory fraction cap
    (`cloudseg memory --limit-gb`; torch < 2.5 cannot tell the cap)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    return min(free + torch.cuda.memory_reserved(device), int(fraction * total))


# ---------------------------------------------------------------------------------- CPU estimate


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def estimate(config: Config, image_size=IMAGE_SHAPE) -> dict[str, StepMemory]:
    """Estimated step memory for each checkpointing mode, from one fp32 forward pass on the CPU."""
    model = build_model(config.model, pretrained=False).train()
    full = padded_shape(image_size)
    probe = full
    while probe[0] * probe[1] > PROBE_AREA:
        probe = padded_shape((probe[0] // 2, probe[1] // 2))
    area_scale = (full[0] * full[1]) / (probe[0] * probe[1])
    # auto is bf16 or fp16 on a GPU (hardware.precision_for_capability): both store activations in 2 bytes
    float_scale = 1.0 if config.train.precision == "fp32" else 0.5
    counts = _saved_bytes(model, probe, float_scale)
    weights = parameter_bytes(model)
    result = {}
    for mode in CHECKPOINTING_MODES:
        blocks = checkpoint_blocks(model, mode)
        kept = counts["total"] - sum(counts["inside"].get(id(b), 0) for b in blocks)
        kept += sum(counts["inputs"].get(id(b), 0) for b in blocks)
        recompute_peak = max((counts["inside"].get(id(b), 0) for b in blocks), default=0)
        result[mode] = StepMemory(weights, weights, 2 * weights, (kept + recompute_peak) * area_scale)
    return result


def _saved_bytes(model: CloudNet, shape, float_scale: float) -> dict:
    """Bytes saved for backward by one image: in total, inside each block, and of each block's inputs."""
    blocks = checkpoint_blocks(model, "full")
    counts = {"total": 0.0, "inside": {}, "inputs": {}}
    stack, seen = [], set()

    def size(t: torch.Tensor) -> float:
        return t.numel() * t.element_size() * (float_scale if t.is_floating_point() else 1.0)

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            counts["total"] += size(t)
            for block in stack:
                counts["inside"][id(block)] = counts["inside"].get(id(block), 0) + size(t)
        return t

    def enter(block, args):
        counts["inputs"][id(block)] = sum(size(a) for a in args if isinstance(a, torch.Tensor))
        stack.append(block)

    def leave(*_) -> None:  # a forward hook that returned something would replace the output
        stack.pop()

    handles = [b.register_forward_pre_hook(enter) for b in blocks]
    handles += [b.register_forward_hook(leave) for b in blocks]
    image = torch.randint(0, 256, (1, 3, *shape), dtype=torch.uint8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(image)
    for handle in handles:
        handle.remove()
    return counts


# ---------------------------------------------------------------------------------- under a cap


def capped(config: Config, limit_gb: float, micro_batch: int, device) -> str:
    """`cloudseg memory --limit-gb`: this process capped at `limit_gb` GB (a card of that size, on
    any larger GPU), real training steps at `micro_batch` for fp16 (pre-Ampere cards) and bf16
    and each checkpointing mode, with the out-of-memory retry and `micro_batch: auto` for real."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * 1e9 / total), device)
    image_size = tuple(config.data.image_size or IMAGE_SHAPE)
    lines = [f"{config.model.encoder} at {image_size[0]}x{image_size[1]}, capped at {limit_gb:g} GB of "
             f"{total / 1e9:.1f} GB: two real training steps at micro-batch {micro_batch}", "",
             f"{'precision':<10}{'checkpointing':<14}{'peak GiB':>9}{'trained at':>11}{'auto':>6}  fits"]
    for precision in ("fp16", "bf16"):
        for mode in CHECKPOINTING_MODES:
            trial = from_dict(apply_overrides(config.model_dump(mode="json"), [
                f"train.precision={precision}", f"train.checkpointing={mode}", "train.micro_batch=auto"]))
            peak, used, auto = capped_steps(trial, micro_batch, image_size, device)
            lines.append(f"{precision:<10}{mode:<14}{'-' if peak is None else f'{peak / 2**30:.2f}':>9}"
                         f"{used or '-':>11}{auto or '-':>6}  {'yes' if used == micro_batch else 'no'}")
    return "\n".join(lines + ["", "trained at: the micro-batch after the out-of-memory retry (- = not even 1); "
                               "auto: what train.micro_batch=auto picks under the cap"])


def capped_steps(config: Config, micro_batch: int, image_size, device) -> tuple[float | None, int, int]:
    """(peak bytes of two training steps, the micro-batch they ran at after any out-of-memory
    retry, what micro_batch auto picks), under the current cap; zeros where nothing fits."""
    model = build_model(config.model, pretrained=False).to(device).train()
    prepare_for_training(model, config.train.channels_last, config.train.checkpointing)
    dtype = autocast_dtype(config.train.precision, device)
    step = StepContext(model, torch.optim.AdamW(model.parameters()),
                       torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype)), device, dtype)
    window = [{"image": torch.randint(0, 256, (micro_batch, 3, *image_size), dtype=torch.uint8),
               "mask": torch.randint(0, 2, (micro_batch, len(LABELS), *image_size), dtype=torch.uint8)}]
    try:
        auto = resolve_micro_batch(config, model, image_size, device)
    except RuntimeError:  # not even a micro-batch of 1 fits
        auto = 0
    torch.cuda.reset_peak_memory_stats(device)
    try:
        _, used = resilient_step(step, window, micro_batch)
        resilient_step(step, window, used)  # the second step holds AdamW's state too
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        peak, used = None, 0
    del model, step
    torch.cuda.empty_cache()
    return peak, used, auto


# ---------------------------------------------------------------------------------- report


def measure(config: Config, image_size, device) -> dict[str, StepMemory]:
    """Step memory for each checkpointing mode from real CUDA steps at micro-batches 1 and 2."""
    result = {}
    for mode in CHECKPOINTING_MODES:
        model = build_model(config.model, pretrained=False).to(device).train()
        prepare_for_training(model, config.train.channels_last, mode)
        weights = parameter_bytes(model)
        one = measured_peak(model, config, 1, image_size, device)
        try:
            per_image = measured_peak(model, config, 2, image_size, device) - one
        except torch.cuda.OutOfMemoryError:
            per_image = one - 4 * weights  # only one image fits: all but the fixed part is per image
        result[mode] = StepMemory(weights, weights, 2 * weights, per_image, other=one - per_image - 4 * weights)
        del model
        torch.cuda.empty_cache()
    return result


def report(config: Config, micro_batch: int, device) -> str:
    """The breakdown at `micro_batch` and the largest micro-batch per card, as printed by `cloudseg memory`."""
    image_size = tuple(config.data.image_size or IMAGE_SHAPE)
    if device.type == "cuda":
        precision = resolve_precision(config.train.precision, device)
    else:
        precision = "auto (bf16 from compute capability 8.0, fp16 before)" if config.train.precision == "auto" \
            else config.train.precision
    if device.type == "cuda":
        steps, how = measure(config, image_size, device), f"measured on {torch.cuda.get_device_name(device)}"
    else:
        steps, how = estimate(config, image_size), "estimated on CPU (saved tensors counted by autograd hooks)"
    height, width = padded_shape(image_size)
    lines = [f"{config.model.arch}-{config.model.encoder} at {image_size[0]}x{image_size[1]} (padded {height}x{width}), "
             f"{precision}, channels_last={config.train.channels_last}: {how}", "",
             f"breakdown at micro-batch {micro_batch} (GiB)",
             f"{'checkpointing':<14}{'weights':>9}{'grads':>9}{'AdamW':>9}{'other':>9}{'activ.':>9}{'total':>9}"]
    gib = 2**30
    for mode, step in steps.items():
        lines.append(f"{mode:<14}{step.weights / gib:>9.2f}{step.gradients / gib:>9.2f}{step.optimizer / gib:>9.2f}"
                     f"{step.other / gib:>9.2f}"
                     f"{micro_batch * step.activations_per_image / gib:>9.2f}{step.peak(micro_batch) / gib:>9.2f}")
    lines += ["", f"largest micro-batch that fits, keeping {SAFETY_MARGIN:.0%} free (0 = none)",
              f"{'checkpointing':<14}" + "".join(f"{f'{gb} GB':>7}" for gb in CARDS_GB)]
    for mode, step in steps.items():
        lines.append(f"{mode:<14}" + "".join(f"{step.largest_micro_batch(gb * 1e9):>7}" for gb in CARDS_GB))
    return "\n".join(lines)
