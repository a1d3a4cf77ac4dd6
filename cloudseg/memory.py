"""How much GPU memory a training step takes, how much recomputation it needs, and the largest
micro-batch that fits.

Data path: the planner beside the accumulated step: it runs the engine's own forward and
backward (engine.accumulate) to choose `train.checkpointing: auto` and `train.micro_batch: auto`
before the run starts, and prints `cloudseg memory`.

On CUDA, peaks are measured on real training steps (the allocator's peak, cuDNN's workspaces
included). Without a GPU they are estimated by running the same step on fake tensors
(PyTorch's FakeTensorMode: shapes, dtypes and strides, no data) under the GPU's autocast dtype,
and adding up the bytes of every tensor alive at each moment, gradients and the backward's
transients included. What that cannot see is what the GPU adds around the tensors: cuDNN's
workspaces and the allocator's rounding, which the safety margin covers.

Neither sees memory outside PyTorch's caching allocator, which a per-process cap does not bound
either: the kernels and handles of cuDNN and cuBLAS, and with `data.decode: gpu` (auto on CUDA)
nvJPEG's own buffers. `outside_allocator` adds an assumed figure for it to every plan.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cloudseg import distributed
from cloudseg.config import Config, apply_overrides, from_dict
from cloudseg.data import padded_shape
from cloudseg.decode import resolve_decode
from cloudseg.engine import StepContext, accumulate, resilient_step
from cloudseg.files import atomic_path, cache_folder
from cloudseg.hardware import autocast_dtype, needs_grad_scaler, resolve_precision, without_cudnn_search
from cloudseg.model import (CHECKPOINTING_MODES, CloudNet, build_model, norm_statistics, prepare_for_training,
                            restore_norm_statistics, set_checkpointing)
from cloudseg.task import IMAGE_SHAPE, LABELS

log = logging.getLogger("cloudseg")

CARDS_GB = (6, 8, 11, 16, 24, 40, 80)
SAFETY_MARGIN = 0.10  # keep 10% of the card free for fragmentation, workspaces and the CUDA context
# Memory outside PyTorch's allocator during a training step: ASSUMED, NOT MEASURED (no GPU has run
# this accounting yet; docs/memory-and-gpus.md says how to measure it and why these figures).
LIBRARY_BYTES = 256 * 2**20  # cuDNN's and cuBLAS's handles and the kernels they load at first use
NVJPEG_STATE_BYTES = 128 * 2**20  # data.decode gpu: nvJPEG's handle, decoder state, bitstream buffers
NVJPEG_BYTES_PER_PIXEL = 3  # and per image of the micro-batch, one H×W×3 buffer of its own
PLANNED_MICRO_BATCH = 4  # what checkpointing auto plans for when train.micro_batch is auto too
# Where `cloudseg train` remembers its probes' peaks (`probed_peak`): this file, or with the variable
# empty none; unset, ~/.cache/cloudseg/probes.json (beside inductor's cache, cli.keep_compiled_graphs).
PROBE_CACHE = "CLOUDSEG_PROBE_CACHE"


@dataclass
class StepMemory:
    """Bytes of one training step: a fixed part plus a part per image of the micro-batch."""

    weights: float
    gradients: float
    optimizer: float
    activations_per_image: float
    other: float = 0.0  # fixed bytes beyond weights, gradients and AdamW (weight casts, workspaces)
    outside: float = 0.0  # fixed bytes outside PyTorch's allocator (assumed, see `outside_allocator`)
    outside_per_image: float = 0.0  # and per image of the micro-batch

    @property
    def fixed(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.other + self.outside

    @property
    def per_image(self) -> float:
        return self.activations_per_image + self.outside_per_image

    def peak(self, micro_batch: int) -> float:
        return self.fixed + micro_batch * self.per_image

    def largest_micro_batch(self, capacity_bytes: float, margin: float = SAFETY_MARGIN) -> int:
        """Largest micro-batch whose peak stays under capacity minus the margin (0 = none fits)."""
        room = (1 - margin) * capacity_bytes - self.fixed
        return max(0, int(room // self.per_image))

    @classmethod
    def from_peaks(cls, one: float, two: float, weights: int) -> StepMemory:
        """From the peaks of steps at micro-batches 1 and 2 (both with AdamW's state)."""
        per_image = two - one
        return cls(weights, weights, 2 * weights, per_image, other=one - per_image - 4 * weights)


def outside_allocator(config: Config, image_size, micro_batch: int) -> float:
    """Bytes a CUDA training step at `micro_batch` holds outside PyTorch's allocator, which no
    probe measures: the libraries' (LIBRARY_BYTES), and where images decode on the GPU
    (`data.decode`), nvJPEG's state and a buffer per image of `image_size`. Assumed figures."""
    if resolve_decode(config.data.decode, "cuda") != "gpu":
        return LIBRARY_BYTES
    height, width = image_size
    return LIBRARY_BYTES + NVJPEG_STATE_BYTES + micro_batch * NVJPEG_BYTES_PER_PIXEL * height * width


def with_outside(steps: dict[str, StepMemory], config: Config, image_size) -> dict[str, StepMemory]:
    """`steps` (allocator bytes, measured or estimated) with the assumed bytes outside it."""
    fixed = outside_allocator(config, image_size, 0)
    per_image = outside_allocator(config, image_size, 1) - fixed
    return {mode: replace(step, outside=fixed, outside_per_image=per_image) for mode, step in steps.items()}


def largest_fitting(candidates, peak_of, capacity_bytes: float, margin: float = SAFETY_MARGIN) -> int:
    """The largest candidate micro-batch whose peak fits; `peak_of(n)` (the bytes n needs, outside
    the allocator included) may raise OOM."""
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


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def probe_step(model: CloudNet, micro_batch: int, image_size, device, dtype) -> None:
    """One forward and backward of the engine on a random batch (no optimizer step), leaving the
    model as it found it: gradients cleared, BatchNorm statistics restored; and the random
    generators too (the CPU's, the GPU's), which a resume on another number of GPUs compares with
    the seeded ones. Any device."""
    step = StepContext(model, None, torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype)), device, dtype)
    saved_statistics = norm_statistics(model)
    with random_states_kept(device):
        batch = {"image": torch.randint(0, 256, (micro_batch, 3, *image_size), dtype=torch.uint8, device=device),
                 "mask": torch.randint(0, 2, (micro_batch, len(LABELS), *image_size), dtype=torch.uint8, device=device)}
        try:
            accumulate(step, [batch], micro_batch)
        finally:
            model.zero_grad(set_to_none=True)
            restore_norm_statistics(model, saved_statistics)


def random_states_kept(device: torch.device):
    """A context whose random draws leave the CPU's generator, and `device`'s where it is a GPU, as
    they were when it began (`torch.random.fork_rng`)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


# ---------------------------------------------------------------------------------- CUDA: measured


def peak_bytes(device: torch.device, run) -> int:
    """The CUDA allocator's peak while `run()` runs (the one place that reads it for a probe)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    finally:
        torch.cuda.empty_cache()


def measured_peak(model: CloudNet, config: Config, micro_batch: int, image_size, device) -> float:
    """Peak CUDA bytes of a training step at `micro_batch`, plus the AdamW state a step adds.

    One step, measured, with cuDNN's heuristics picking its algorithms (hardware.without_cudnn_search,
    which keeps them apart from training's): cuDNN's benchmark mode would time every algorithm for
    each new shape (about 10 s a probe at full resolution on an H100, 2026-11-26), shapes that
    training may never use (the probes of 2 and 1 after 4 did not fit). Training's own search then
    takes workspaces only where they can be had: cuDNN skips an algorithm whose workspace the
    allocator refuses, so that search never runs a step out of memory."""
    dtype = autocast_dtype(config.train.precision, device)
    with without_cudnn_search():
        peak = peak_bytes(device, lambda: probe_step(model, micro_batch, image_size, device, dtype))
    return peak + 2 * parameter_bytes(model)  # AdamW's exp_avg and exp_avg_sq, allocated at the first step


def probe_cache() -> Path | None:
    """The file of remembered probes (PROBE_CACHE), or None where the user set it empty."""
    named = os.environ.get(PROBE_CACHE)
    if named is not None:
        return Path(named) if named else None
    return cache_folder() / "probes.json"


def probe_key(model: CloudNet, config: Config, micro_batch: int, image_size, device) -> str:
    """What a probe's peak depends on: the GPU, PyTorch, cuDNN and smp, the code of the step
    (STEP_CODE), the precision and deterministic mode, the shape, and the model as built (its
    modules, checkpointing's wrappers and the memory format of its weights)."""
    card = torch.cuda.get_device_properties(device)
    wrapped = [name for name, module in model.named_modules() if "forward" in vars(module)]
    channels_last = next(model.parameters()).dim() == 4 and next(model.parameters()).is_contiguous(
        memory_format=torch.channels_last)
    built = hashlib.sha256(f"{model!r} {wrapped} {channels_last} {step_code()}".encode()).hexdigest()[:16]
    software = (f"torch {torch.__version__} cudnn {torch.backends.cudnn.version()} "
                f"smp {importlib.metadata.version('segmentation-models-pytorch')}")
    return (f"{card.name} {card.total_memory} | {software} | {autocast_dtype(config.train.precision, device)} "
            f"deterministic {config.train.deterministic} | {micro_batch}x{image_size[0]}x{image_size[1]} | {built}")


STEP_CODE = ("engine.py", "model.py", "loss.py", "memory.py")  # cloudseg's files whose change may move a peak


def step_code() -> str:
    """A digest of STEP_CODE's files: a remembered probe of other code is not this code's."""
    folder = Path(__file__).parent
    return hashlib.sha256(b"".join((folder / name).read_bytes() for name in STEP_CODE)).hexdigest()[:16]


def probed_peak(model: CloudNet, config: Config, micro_batch: int, image_size, device, remember: Path | None) -> float:
    """`measured_peak`, or where the file `remember` holds a probe of the same `probe_key` (this
    GPU, software, precision, shape and model), its peak, with no step run; a new measurement is
    added to that file. An out-of-memory probe is not remembered: what fits depends on the cap."""
    if remember is None:
        return measured_peak(model, config, micro_batch, image_size, device)
    key, known = probe_key(model, config, micro_batch, image_size, device), remembered_probes(remember)
    if key in known:
        log.info("probe of micro-batch %d: %.2f GiB, remembered in %s (%s= empty: probe anew)", micro_batch,
                 known[key] / 2**30, remember, PROBE_CACHE)
        return known[key]
    peak = measured_peak(model, config, micro_batch, image_size, device)
    try:
        with atomic_path(remember) as tmp:
            tmp.write_text(json.dumps({**remembered_probes(remember), key: peak}, indent=1))
    except OSError as error:  # a read-only home: the run goes on, probing again next time
        log.warning("could not remember the probe in %s: %s", remember, error)
    return peak


def remembered_probes(path: Path) -> dict[str, float]:
    """The remembered peaks; none where the file is missing or not what `probed_peak` writes."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def available_bytes(device: torch.device) -> int:
    """What this process can hold on its GPU: the free memory (other processes on the same GPU
    count) plus what its own allocator has reserved already, within its memory fraction cap
    (`cloudseg memory --limit-gb`; torch < 2.5 cannot tell the cap)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    return min(free + torch.cuda.memory_reserved(device), int(fraction * total))


def planned_micro_batch(config: Config, world: int) -> int:
    """The micro-batch that `checkpointing: auto` must fit: the configured one, or with
    `micro_batch: auto` the largest divisor of the per-process window up to 4."""
    if config.train.micro_batch != "auto":
        return config.train.micro_batch
    return max(d for d in divisors(config.train.effective_batch // world) if d <= PLANNED_MICRO_BATCH)


def resolve_checkpointing(config: Config, model: CloudNet, image_size, device, world: int = 1,
                          remember: Path | None = None) -> str:
    """`train.checkpointing`; for `auto`, the least recomputation (none, then encoder, then full)
    under which the planned micro-batch fits this GPU, by real probe steps, agreed across
    processes (the most any of them needs). Where even `full` does not fit, `full`, and
    `train.micro_batch` becomes auto so that it shrinks. On the CPU, auto means none.
    Leaves `model` in whichever mode it probed last: set the returned mode on it. `remember`: the
    file of remembered probes (`probed_peak`), or None to measure every one."""
    if config.train.checkpointing != "auto":
        return config.train.checkpointing
    if device.type != "cuda":
        log.info("train.checkpointing=auto on %s: none (nothing to probe)", device)
        return "none"
    micro_batch = planned_micro_batch(config, world)
    outside = outside_allocator(config, image_size, micro_batch)
    capacity = (1 - SAFETY_MARGIN) * available_bytes(device) - outside
    buckets = parameter_bytes(model) if world > 1 else 0  # DDP's gradient buckets
    peaks = {}
    for mode in CHECKPOINTING_MODES:
        set_checkpointing(model, mode)
        try:
            peaks[mode] = probed_peak(model, config, micro_batch, image_size, device, remember) + buckets
        except torch.cuda.OutOfMemoryError:
            peaks[mode] = None
        if peaks[mode] is not None and peaks[mode] <= capacity:
            break
    fits = peaks[mode] is not None and peaks[mode] <= capacity
    agreed = CHECKPOINTING_MODES[distributed.largest(CHECKPOINTING_MODES.index(mode), device)]
    probed = ", ".join(f"{m} {'out of memory' if p is None else f'{p / 2**30:.2f} GiB'}" for m, p in peaks.items())
    log.info("train.checkpointing=auto: %s (micro-batch %d: %s; %.2f GiB usable, %.2f GiB more assumed outside "
             "PyTorch's allocator%s)", agreed, micro_batch, probed, capacity / 2**30, outside / 2**30,
             "" if agreed == mode else f"; {mode} fits this GPU, {agreed} every process's")
    if distributed.largest(int(not fits), device):  # on every rank, or their micro-batch probes would not pair up
        log.warning("even train.checkpointing=full does not fit micro-batch %d: train.micro_batch shrinks (auto)",
                    micro_batch)
        config.train.micro_batch = "auto"
    return agreed


def resolve_micro_batch(config: Config, model: CloudNet, image_size, device, world: int = 1,
                        remember: Path | None = None) -> int:
    """`train.micro_batch`, probing the largest that fits when it is `auto` (`world`: processes
    that share each window; `remember` as for `resolve_checkpointing`). Every process probes its
    own GPU, and all take the smallest answer: the sampler cuts windows by it, so the processes
    must agree."""
    micro_batch = config.train.micro_batch
    if micro_batch != "auto":
        return micro_batch
    if config.train.effective_batch % world:
        raise ValueError(f"train.effective_batch ({config.train.effective_batch}) must be a multiple of "
                         f"the number of processes ({world})")
    candidates = divisors(config.train.effective_batch // world)
    if device.type != "cuda":
        chosen = max(d for d in candidates if d <= PLANNED_MICRO_BATCH)
        log.info("train.micro_batch=auto on %s: nothing to probe, using %d", device, chosen)
        return chosen
    buckets = parameter_bytes(model) if world > 1 else 0  # DDP's gradient buckets: one more copy of the gradients
    chosen = largest_fitting(candidates, lambda n: probed_peak(model, config, n, image_size, device, remember) + buckets
                             + outside_allocator(config, image_size, n), available_bytes(device))
    agreed = distributed.smallest(chosen, device)
    if agreed != chosen:
        log.info("train.micro_batch=auto: %d fits this GPU, %d fits every process's", chosen, agreed)
    log.info("train.micro_batch=auto: %d (accumulation %d)", agreed, config.train.effective_batch // world // agreed)
    return agreed


def measure(config: Config, image_size, device) -> dict[str, StepMemory]:
    """Step memory for each checkpointing mode from real CUDA steps at micro-batches 1 and 2."""
    result = {}
    for mode in CHECKPOINTING_MODES:
        model = build_model(config.model, pretrained=False).to(device).train()
        prepare_for_training(model, config.train.channels_last, mode)
        weights = parameter_bytes(model)
        one = measured_peak(model, config, 1, image_size, device)
        try:
            result[mode] = StepMemory.from_peaks(one, measured_peak(model, config, 2, image_size, device), weights)
        except torch.cuda.OutOfMemoryError:  # only one image fits: all but the fixed part is per image
            result[mode] = StepMemory(weights, weights, 2 * weights, one - 4 * weights)
        del model
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------- CPU: estimated


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage that the ops inside it create, while that storage
    lives (views share their storage's count), and keeps the highest total (a training step's
    peak, when run on fake tensors), the highest once the model's backward has begun (its first
    convolution backward) and the largest storage."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.largest, self._sizes = 0, 0, 0, {}
        self.backward_peak = None  # the peak from the model's first convolution backward on (None before)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default and self.backward_peak is None:
            self.backward_peak = self.live
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, self._sizes[key])
        if self.backward_peak is not None:
            self.backward_peak = max(self.backward_peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key) -> None:
        self.live -= self._sizes.pop(key)


# A GPU's step holds more than the tensors that the fake step counts: cuDNN's workspaces while the
# model's backward runs its convolutions, and the allocator's rounding. Against six peaks of one
# H100 (torch 2.11, UNet-ResNet34 at 1408x2112, bf16, micro-batch 4; 2026-11-23 and -25, two ways
# of cutting the checkpointed blocks), the count alone ran 9 to 15% low where the peak lies in that
# backward (`full`), and within 2% where it lies at the loss. One buffer the size of the step's
# largest tensor (32 channels at full resolution, 0.18 GiB per image), held during the model's
# backward, brings all six within -3% and +7% of the measured: that is GPU_TRANSIENT, the rule below.
def estimated_peak(model: CloudNet, micro_batch: int, image_size, dtype: torch.dtype | None) -> float:
    """Peak bytes of a training step of `model` at `micro_batch` in `dtype` on a GPU, estimated on
    the CPU: the step's tensors counted (`counted_step`) and GPU_TRANSIENT. Includes the weights and
    AdamW's state. `model` (built on the CPU) is turned into fake tensors: use it for nothing else."""
    weights = parameter_bytes(model)
    counted = counted_step(model, micro_batch, image_size, dtype)
    in_backward = (counted.backward_peak or 0) + counted.largest  # GPU_TRANSIENT, above
    return max(counted.peak, in_backward) + 3 * weights  # the weights, and AdamW's two states once it has stepped


def counted_step(model: CloudNet, micro_batch: int, image_size, dtype: torch.dtype | None) -> LiveBytes:
    """The bytes of one forward and backward of the engine (`probe_step`), run on fake tensors:
    `model`'s weights and buffers become fake ones."""
    fake = FakeTensorMode()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(fake.from_tensor(param), param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, fake.from_tensor(buffer))
    with fake, LiveBytes() as counted:
        probe_step(model, micro_batch, image_size, torch.device("cpu"), dtype)
    return counted


def estimate(config: Config, image_size=IMAGE_SHAPE) -> dict[str, StepMemory]:
    """Estimated step memory for each checkpointing mode (see `estimated_peak`). Precision auto
    means bf16 or fp16 on a GPU: both keep activations in 2 bytes, estimated as bf16 (the CPU's
    autocast dtype)."""
    dtype = None if config.train.precision == "fp32" else torch.bfloat16

    def peak(mode: str, micro_batch: int) -> float:
        model = prepare_for_training(build_model(config.model, pretrained=False).train(), config.train.channels_last,
                                     mode)
        return estimated_peak(model, micro_batch, image_size, dtype)

    weights = parameter_bytes(build_model(config.model, pretrained=False))
    return {mode: StepMemory.from_peaks(peak(mode, 1), peak(mode, 2), weights) for mode in CHECKPOINTING_MODES}


# ---------------------------------------------------------------------------------- under a cap


def cap_process(device: torch.device, limit_gb: float) -> float:
    """Cap this process at `limit_gb` GB of its GPU (a card of that size); returns the GPU's total bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * 1e9 / total), device)
    return total


def capped(config: Config, limit_gb: float, micro_batch: int, device) -> str:
    """`cloudseg memory --limit-gb`: this process capped at `limit_gb` GB (a card of that size, on
    any larger GPU), real training steps at `micro_batch` for fp16 (pre-Ampere cards) and bf16
    and each checkpointing mode, with the out-of-memory retry, `micro_batch: auto` and
    `checkpointing: auto` for real."""
    total = cap_process(device, limit_gb)
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
        lines.append(f"{precision:<10}{'auto':<14}{'':>9}{'':>11}{'':>6}  -> "
                     f"{auto_under_cap(config, precision, micro_batch, image_size, device)}")
    return "\n".join(lines + ["", "trained at: the micro-batch after the out-of-memory retry (- = not even 1); "
                               "auto: what train.micro_batch=auto picks under the cap; "
                               f"checkpointing auto: the mode it picks for micro-batch {micro_batch} under the cap"])


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
    used = [micro_batch]

    def two_steps():
        _, used[0] = resilient_step(step, window, micro_batch)
        resilient_step(step, window, used[0])  # the second step holds AdamW's state too

    try:
        peak = peak_bytes(device, two_steps)
    except torch.cuda.OutOfMemoryError:
        peak, used[0] = None, 0
    del model, step
    torch.cuda.empty_cache()
    return peak, used[0], auto


def auto_under_cap(config: Config, precision: str, micro_batch: int, image_size, device) -> str:
    """What `train.checkpointing: auto` picks for `micro_batch` under the current cap."""
    trial = from_dict(apply_overrides(config.model_dump(mode="json"), [
        f"train.precision={precision}", "train.checkpointing=auto", f"train.micro_batch={micro_batch}"]))
    model = build_model(trial.model, pretrained=False).to(device).train()
    prepare_for_training(model, trial.train.channels_last, "none")
    mode = resolve_checkpointing(trial, model, image_size, device)
    del model
    return mode if trial.train.micro_batch == micro_batch else f"{mode}, micro-batch shrinks"


# ---------------------------------------------------------------------------------- report


def auto_choice(steps: dict[str, StepMemory], micro_batch: int, capacity_bytes: float) -> str:
    """What `checkpointing: auto` picks on a card: the first mode that fits `micro_batch`
    (`full/N`: even full needs a smaller micro-batch N; `-`: nothing fits)."""
    for mode, step in steps.items():
        if step.largest_micro_batch(capacity_bytes) >= micro_batch:
            return mode
    fitting = steps["full"].largest_micro_batch(capacity_bytes)
    return f"full/{fitting}" if fitting else "-"


def report(config: Config, micro_batch: int, device) -> str:
    """The breakdown at `micro_batch`, the largest micro-batch per card and what checkpointing
    auto picks there, as printed by `cloudseg memory`."""
    image_size = tuple(config.data.image_size or IMAGE_SHAPE)
    if device.type == "cuda":
        precision = resolve_precision(config.train.precision, device)
        steps, how = measure(config, image_size, device), f"measured on {torch.cuda.get_device_name(device)}"
    else:
        precision = "auto (bf16 from compute capability 8.0, fp16 before)" if config.train.precision == "auto" \
            else config.train.precision
        steps, how = estimate(config, image_size), "estimated on CPU (the step run on fake tensors)"
    steps = with_outside(steps, config, image_size)
    height, width = padded_shape(image_size)
    gib = 2**30
    lines = [f"{config.model.arch}-{config.model.encoder} at {image_size[0]}x{image_size[1]} (padded {height}x{width}), "
             f"{precision}, channels_last={config.train.channels_last}: {how}", "",
             f"breakdown at micro-batch {micro_batch} (GiB)",
             f"{'checkpointing':<14}{'weights':>9}{'grads':>9}{'AdamW':>9}{'other':>9}{'activ.':>9}{'outside':>9}"
             f"{'total':>9}"]
    for mode, step in steps.items():
        outside = step.outside + micro_batch * step.outside_per_image
        lines.append(f"{mode:<14}{step.weights / gib:>9.2f}{step.gradients / gib:>9.2f}{step.optimizer / gib:>9.2f}"
                     f"{step.other / gib:>9.2f}{micro_batch * step.activations_per_image / gib:>9.2f}"
                     f"{outside / gib:>9.2f}{step.peak(micro_batch) / gib:>9.2f}")
    lines += ["(outside: outside PyTorch's allocator, assumed: cuDNN's and cuBLAS's kernels, and nvJPEG's buffers "
              "where data.decode is gpu; docs/memory-and-gpus.md)",
              "", f"largest micro-batch that fits, keeping {SAFETY_MARGIN:.0%} free (0 = none)"]
    rows = {"checkpointing": [f"{gb} GB" for gb in CARDS_GB]}
    rows.update({mode: [str(step.largest_micro_batch(gb * 1e9)) for gb in CARDS_GB] for mode, step in steps.items()})
    rows["auto picks"] = [auto_choice(steps, micro_batch, gb * 1e9) for gb in CARDS_GB]
    width = max(9, 1 + max(len(cell) for cells in rows.values() for cell in cells))  # full/12101 and the like
    lines += [f"{name:<14}" + "".join(f"{cell:>{width}}" for cell in cells) for name, cells in rows.items()]
    lines.append(f"(auto picks: what train.checkpointing=auto chooses for micro-batch {micro_batch}; "
                 "full/N: even full needs micro-batch N)")
    return "\n".join(lines)
