"""The training run: epochs of accumulated steps, validation, checkpoints and records.

Data path: train.csv → Dataset → loader → model → loss → accumulated step (engine.py) →
**the run: validation, checkpoint, records** → probabilities at 350×525 → post-process → submission.

Under torchrun, each process trains its share of every window (see EpochSampler) and rank 0
alone writes the run directory: config.yaml, metrics.csv, curves.png, best.pt, last.pt,
oof.npz, train.log, tb/ and (skip mode) skipped.csv.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from cloudseg import distributed
from cloudseg.checkpoint import cuda_rng_state, load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from cloudseg.compiled import resolve_compile
from cloudseg.config import Config, TrainConfig, dump
from cloudseg.data import CloudDataset, EpochSampler, Problem, build_transform, fold_ids, make_loader, readable
from cloudseg.decode import decode_batch, resolve_decode
from cloudseg.engine import StepContext, StepResult, resilient_step, windows
from cloudseg.files import atomic_path
from cloudseg.flops import peak_seconds_per_image
from cloudseg.hardware import (autocast_dtype, needs_grad_scaler, require_deterministic_kernels, require_usable_device,
                               resolve_device, resolve_precision, speed_switches)
from cloudseg.loss import per_image_loss
from cloudseg.memory import probe_cache, resolve_checkpointing, resolve_micro_batch
from cloudseg.metrics import dice, resize_masks, summarize
from cloudseg.model import (CloudNet, build_model, load_weights, pad_stem, prepare_for_training, set_checkpointing,
                            train_mode, unwrapped)
from cloudseg.oof import OOF_FILE, predict_oof, write_oof
from cloudseg.postprocess import RULE_FILE, TOP_K, apply_rule, quantize, write_rule_file
from cloudseg.predict import batch_probabilities
from cloudseg.startclock import StartClock
from cloudseg.stopping import Interrupted, StopRequested, stop_requests, until_stopped
from cloudseg.swa import average_checkpoints, chosen_epochs, epoch_path, recompute_norm_statistics
from cloudseg.syncs import named_sync
from cloudseg.task import LABELS
from cloudseg.tune import RuleSearch, pooled_notes, search_rule
from cloudseg.viz import plot_curves

log = logging.getLogger("cloudseg")
SKIPPED_CSV = "skipped.csv"


# ---------------------------------------------------------------------------------- state


@dataclass
class Progress:
    """How far an epoch has gone: saved in last.pt when a run stops mid-epoch, so that the
    resumed run continues at the next window with the same tallies."""

    VERSION = 1

    windows: int = 0  # windows of this epoch done (stepped, skipped or empty)
    losses: list[float] = field(default_factory=list)  # the loss of each window that stepped
    images: int = 0  # images trained on, all processes together
    skipped_windows: int = 0  # windows with a non-finite loss or gradient
    seconds: float = 0.0  # time spent in this epoch's windows
    skipped_samples: list[Problem] = field(default_factory=list)  # unreadable samples (skip mode)

    def to_dict(self) -> dict:
        """Plain types only (a checkpoint must load with torch.load(weights_only=True))."""
        raw = dataclasses.asdict(self)
        raw["skipped_samples"] = [list(problem) for problem in self.skipped_samples]
        return {"version": self.VERSION, **raw}

    @classmethod
    def from_dict(cls, raw: dict) -> Progress:
        """The inverse of `to_dict`; also reads the unversioned dict of earlier checkpoints."""
        raw = dict(raw)
        version = raw.pop("version", 0)
        if version == 0:
            raw["skipped_windows"] = raw.pop("skipped")
        elif version != cls.VERSION:
            raise ValueError(f"in-epoch progress of version {version}; this cloudseg reads version {cls.VERSION}")
        raw["skipped_samples"] = [Problem(*problem) for problem in raw["skipped_samples"]]
        return cls(**raw)


@dataclass
class Run:
    """The parts of one training run, built once by `start`."""

    config: Config
    dir: Path
    model: CloudNet  # the bare model: validated and saved
    step: StepContext  # step.model is the model the windows run through (DDP on several processes)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: EpochSampler
    train_loader: DataLoader
    valid_loader: DataLoader
    board: SummaryWriter | None  # TensorBoard, rank 0 only
    micro_batch: int  # halved by an out-of-memory retry
    ema: AveragedModel | None = None  # train.ema: the averaged weights, validated and saved as the model
    peak_seconds: float = math.nan  # one image's FLOPs at the GPUs' datasheet peak: images/s × this = MFU
    history: list[dict] = field(default_factory=list)  # one metrics row per finished epoch
    start_clock: StartClock | None = None  # until the first window has stepped: the time to it, by stage


# ---------------------------------------------------------------------------------- the run


def train(config: Config, run_dir: str | Path, resume: bool = False) -> pd.DataFrame:
    """Train `config` into `run_dir` (or continue it from last.pt); returns metrics per epoch.
    Under torchrun the process group stays up for the caller's next run (the next fold of an
    every-fold run): the command ends it (every_fold.train_run)."""
    run, start_epoch, progress = start(config, Path(run_dir), resume)
    with stop_requests() as stop_requested:
        for epoch in range(start_epoch, config.train.epochs):
            progress = progress or Progress()
            stopped = train_epoch(run, epoch, progress, stop_requested)
            rng = every_rank_rng_states(run.step.device)  # as the epoch's windows left them, before validation draws
            if stopped:
                save_and_stop(run, epoch, progress, rng, f"after window {progress.windows}")
            if run.ema is not None:  # the average's own BatchNorm statistics (see `averaged`)
                recompute_norm_statistics(run.ema.module, config, run.step.device, sharded=True)
            try:
                validation = validate(evaluated(run), run.valid_loader, run.step.device, run.step.dtype, config,
                                      progress.skipped_samples, stop_requested=stop_requested)
            except StopRequested:  # the epoch's windows are done: a resume validates it again
                save_and_stop(run, epoch, progress, rng, "while validating")
            end_epoch(run, epoch, progress, validation, rng)
            progress = None
        if distributed.is_main():
            run.board.close()
            if config.train.swa:
                average_into_best(run)
            write_best_oof(run, stop_requested)
    return pd.DataFrame(run.history)


def start(config: Config, run_dir: Path, resume: bool) -> tuple[Run, int, Progress | None]:
    """Build the run (from last.pt when resuming); returns it, the epoch to run and the
    progress within that epoch (None at an epoch's start)."""
    clock = StartClock()
    device = distributed.start(resolve_device(config.train.device))
    seed_everything(config.seed)
    seeded_cuda = cuda_rng_state(device)  # where a resume on another number of GPUs may start from
    train_set, valid_set = datasets(config, device)
    clock.mark("data index")
    config.data.image_size = train_set.image_size  # resolved, so inference needs no image
    config.train.epochs = epochs_for(config.train, len(train_set))  # resolved too: a resume trains as many
    require_usable_device(config.train.device, device, train_set.image_size, len(train_set))
    # before the probes, so that they measure the same algorithms
    speed_switches(device, config.train.deterministic, config.train.speedups.cudnn_search)
    model = training_model(config, train_set.image_size, device, pretrained=not resume, clock=clock)  # resumed: last.pt's weights
    dtype = autocast_dtype(config.train.precision, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    steps = config.train.epochs * steps_per_epoch(config.train, len(train_set))
    scheduler = lr_schedule(optimizer, config.train, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype))
    start_epoch, history, progress, saved = 0, [], None, None
    if resume:
        saved = resumable(load_checkpoint(run_dir / "last.pt"), run_dir / "last.pt", config.train, scaler.is_enabled())
        restore_rng_states(saved["rng"], device, distributed.rank(), distributed.world_size(), seeded_cuda,
                           str(run_dir / "last.pt"))
        start_epoch, history, progress = restore(saved, run_dir / "last.pt", model=model, optimizer=optimizer,
                                                 scheduler=scheduler, scaler=scaler)
        follow_schedule(optimizer, scheduler)
        if distributed.is_main():
            write_config(run_dir, config)  # the overrides of the resume (train.epochs=...) included
    elif distributed.is_main():
        create_run_dir(run_dir, config, train_set.skipped)
    step = StepContext(model, optimizer, scaler, device, dtype, config.train.grad_clip, config.train.dice_weight,
                       resolve_compile(config.train.compile, device), config.train.cls_weight,
                       autotune=config.train.speedups.autotune)
    run = assemble(config, run_dir, step, scheduler, (train_set, valid_set))
    run.history, run.ema = history, averaged(model, config.train.ema)
    run.peak_seconds = peak_seconds_per_image(config.model, train_set.image_size, device, distributed.world_size())
    if resume and run.ema is not None:
        restore_ema(saved, run_dir / "last.pt", model, run.ema)
    clock.mark("set-up")
    run.start_clock = clock
    return run, start_epoch, progress


def training_model(config: Config, image_size, device: torch.device, pretrained: bool = True,
                   clock: StartClock | None = None) -> CloudNet:
    """The model on `device` with the memory switches of `train.*`; `checkpointing` and
    `micro_batch` are resolved into `config` (probed on a GPU where they are auto). Without
    `pretrained`, no encoder weights are downloaded (a resume loads its own, offline too).
    `clock` marks the model's stage and the probes'."""
    model = build_model(config.model, pretrained)
    require_deterministic_kernels(model, image_size, device, config.train.deterministic)  # before any probe's backward
    model = model.to(device)
    if config.model.norm == "frozen" and config.model.encoder_weights is None:
        log.warning("model.norm=frozen with random encoder weights freezes meaningless statistics (0 and 1)")
    prepare_for_training(model, config.train.channels_last, "none")
    pad_stem(model, config.train.speedups.pad_stem)
    if clock:
        clock.mark("model")
    world = distributed.world_size()
    remember = probe_cache() if device.type == "cuda" else None  # the probes run on CUDA only
    config.train.checkpointing = resolve_checkpointing(config, model, image_size, device, world, remember)
    set_checkpointing(model, config.train.checkpointing)
    config.train.micro_batch = resolve_micro_batch(config, model, image_size, device, world, remember)
    if clock:
        clock.mark("probes")
    return model


def averaged(model: CloudNet, decay: float | None) -> AveragedModel | None:
    """train.ema: PyTorch's exponential moving average of the weights. Not of the BatchNorm
    statistics: an average of weights makes other activations than the weights it averages, so
    averaged statistics do not fit it (on the demo's noisy datasets the average scored at the
    all-empty level with them; BENCHMARKS.md). They are measured again over the training images
    before each validation, as SWA does (`recompute_norm_statistics`); in between they follow
    the weights that train (use_buffers=False copies them at each update)."""
    if decay is None:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)


def restore_ema(state: dict, path: Path, model: CloudNet, ema: AveragedModel) -> None:
    """With train.ema, a checkpoint's "model" is the average: the weights that train are under
    "training_model", and the number of averaged steps under "ema_updates". `state` is the
    checkpoint loaded from `path` (named in errors)."""
    if "training_model" not in state:
        raise ValueError(f"{path}: saved without train.ema, cannot resume with it (or set train.ema=null)")
    ema.module.load_state_dict(state["model"])
    model.load_state_dict(state["training_model"])
    ema.n_averaged.fill_(state["ema_updates"])


def assemble(config: Config, run_dir: Path, step: StepContext, scheduler, sets) -> Run:
    """The run around a built model: its samplers, loaders, TensorBoard writer, and the model
    wrapped for several processes."""
    train_set, valid_set = sets
    device, world = step.device, distributed.world_size()
    board = SummaryWriter(run_dir / "tb") if distributed.is_main() else None  # `make tensorboard` shows it
    sampler = EpochSampler(len(train_set), config.seed, config.train.effective_batch, config.train.micro_batch,
                           distributed.rank(), world)
    micro_batch = config.train.micro_batch
    train_loader = make_loader(train_set, config.data, micro_batch, device, sampler, every_epoch=True)
    valid_loader = make_loader(valid_set, config.data, micro_batch, device, distributed.shard(len(valid_set)),
                               every_epoch=True)
    log.info("training %d images, validating %d (fold %d) at %dx%d on %s, %s; %d process(es) x %d micro-batches "
             "of %d per step", len(train_set), len(valid_set), config.data.fold, *train_set.image_size, device,
             resolve_precision(config.train.precision, device), world, config.train.accumulation_for(world), micro_batch)
    model = step.model
    step = dataclasses.replace(step, model=distributed.wrap(model, device))
    return Run(config, run_dir, model, step, scheduler, sampler, train_loader, valid_loader, board, micro_batch)


def create_run_dir(run_dir: Path, config: Config, skipped_rows: list[Problem]) -> None:
    """A new run directory with its resolved config.yaml (and skipped.csv for bad train.csv rows)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, config)
    report_skipped(skipped_rows, None, run_dir, "bad rows of train.csv")


def write_config(run_dir: Path, config: Config) -> None:
    with atomic_path(run_dir / "config.yaml") as tmp:
        tmp.write_text(dump(config))


def train_epoch(run: Run, epoch: int, progress: Progress, stop_requested) -> bool:
    """Windows of the training folds, one optimizer and scheduler step each, from where
    `progress` says until the epoch ends or a stop is asked for (on any process); tallies go
    into `progress`. Returns whether a stop was asked for.

    A window with a non-finite loss or gradient makes no step, is logged and counted;
    `train.max_skipped_windows` of them in a row stop the run.
    """
    config, device, world = run.config, run.step.device, distributed.world_size()
    reset_peak_memory(device)
    run.sampler.set_epoch(epoch, start=progress.windows * config.train.effective_batch)
    train_mode(run.step.model, config.model.norm)
    desc = f"epoch {epoch + 1}/{config.train.epochs}"
    count = steps_per_epoch(config.train, len(run.train_loader.dataset) - run.sampler.start)  # the steps left
    blank = blank_batch(config.data.image_size) if world > 1 else None
    started, in_a_row = time.perf_counter(), 0
    bar = tqdm(windows(run.train_loader, config.train.accumulation_for(world), count), desc=desc, unit="step",
               total=count, disable=None if distributed.is_main() else True)
    for window in bar:
        window = list(readable(window, progress.skipped_samples))
        images = int(distributed.total(sum(len(batch["image"]) for batch in window), device))
        progress.windows += 1
        if images:  # else every sample was unreadable (skip mode): nothing to learn from
            result, run.micro_batch = resilient_step(run.step, window, run.micro_batch, images, blank)
            first_step_taken(run, result)
            progress.images += images
            in_a_row = count_skip(result, in_a_row, progress, desc, config.train.max_skipped_windows)
            if not result.skipped:
                run.scheduler.step()
                if run.ema is not None:  # once per optimizer step, however many micro-batches it took
                    with named_sync("ema", device):
                        run.ema.update_parameters(run.model)
                progress.losses.append(result.loss)
                bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{run.scheduler.get_last_lr()[0]:.2e}")
        if distributed.total(stop_requested(), device):
            progress.seconds += time.perf_counter() - started
            return True
    progress.seconds += time.perf_counter() - started
    return False


def first_step_taken(run: Run, result: StepResult) -> None:
    """After a window (its loss read: the GPU is done with it) whose `result` is a step: the first
    time, log how long the run took to get there, by stage (startclock.py)."""
    if run.start_clock is not None and not result.skipped:
        run.start_clock.mark("first window (loading + compile + step)")  # compile: where train.compile compiles
        log.info(run.start_clock.line())
        run.start_clock = None


def blank_batch(image_size) -> dict:
    """One black image without labels: what a process with nothing in a window feeds, with
    weight 0, so that it still joins the window's all-reduce (see engine.train_step)."""
    return {"image": torch.zeros(1, 3, *image_size, dtype=torch.uint8),
            "mask": torch.zeros(1, len(LABELS), *image_size, dtype=torch.uint8)}


def count_skip(result: StepResult, in_a_row: int, progress: Progress, desc: str, limit: int) -> int:
    """Count a window that made no step (non-finite loss or gradient); returns the run of
    such windows, and stops the run when it reaches `limit`."""
    if not result.skipped:
        return 0
    progress.skipped_windows, in_a_row = progress.skipped_windows + 1, in_a_row + 1
    log.warning("%s, window %d: loss %s, gradient norm %s: not finite, window skipped (%d in a row)",
                desc, progress.windows, result.loss, result.grad_norm, in_a_row)
    if in_a_row >= limit:
        raise RuntimeError(f"{in_a_row} windows in a row had a non-finite loss or gradient ({desc}); "
                           "lower train.lr, set train.grad_clip, or use train.precision=bf16 or fp32")
    return in_a_row


def lr_schedule(optimizer, train_config: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine to zero or constant; stepped once per optimizer step."""
    warmup = train_config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if train_config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------- validation


@torch.no_grad()
def validate(model, loader, device, dtype, config: Config, skipped: list[Problem] | None = None, *,
             stop_requested=None) -> dict[str, float]:
    """Validation loss at native size and Kaggle Dice at 350×525: mean and per class under the
    config's rule, and `dice_tuned` under the rule tuned on these very images (the search of
    `cloudseg tune`, which the run's end applies to best.pt's out-of-fold probabilities: this is
    what the submission will score, and it chooses best.pt). Unreadable samples (skip mode) go
    into `skipped`. On several processes each validates
    its shard and the per-image results are gathered, so every rank returns the same.
    `stop_requested` is asked before every batch (StopRequested), on all processes together."""
    model.eval()
    losses, pair_dice, search = [], [], RuleSearch(config.predict, head=unwrapped(model).has_head)
    rule = {**config.predict.model_dump(), "top_k": TOP_K}
    asked = None if stop_requested is None else lambda: distributed.total(stop_requested(), device)
    largest_shard = math.ceil(len(loader.dataset) / distributed.world_size())
    batches = until_stopped(loader, asked, count=math.ceil(largest_shard / loader.batch_size))
    for batch in readable(batches, [] if skipped is None else skipped):
        batch = decode_batch(batch, device)
        images, masks = batch["image"].to(device), batch["mask"].to(device)
        probs = batch_probabilities([model], images, dtype, config.predict)
        losses += per_image_loss(torch.logit(probs.native, eps=1e-6), masks, config.train.dice_weight).tolist()
        probs8, truth = quantize(probs.submission.cpu().numpy()), resize_masks(masks).cpu().numpy()
        classes8 = None if probs.classes is None else quantize(probs.classes.cpu().numpy())
        pair_dice.append(dice(apply_rule(probs8, rule, classes8), truth))
        search.add(probs8, truth, classes8)
    losses, pair_dice, (search, *others) = (distributed.gathered(x) for x in (losses, pair_dice, [search]))
    search.merge(others)
    summary = summarize(np.concatenate(pair_dice))
    return {"valid_loss": float(np.mean(losses)), "dice": summary["dice"],
            **{f"dice_{label}": summary[label] for label in LABELS},
            "dice_tuned": search.result()["cv_dice"]["after"]["mean"]}


# ---------------------------------------------------------------------------------- checkpoints


def checkpoint_state(run: Run, epoch: int, progress: Progress | None, rng: dict) -> dict:
    """The one dict a checkpoint holds (see checkpoint.py); `progress` only mid-epoch. "model"
    is what predict loads: the averaged weights with train.ema (see restore_ema)."""
    state = {"model": evaluated(run).state_dict(), "optimizer": run.step.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(), "scaler": run.step.scaler.state_dict(), "epoch": epoch,
             "step": run.scheduler.last_epoch, "rng": rng, "config": run.config.model_dump(mode="json"),
             "metrics": run.history, "progress": progress.to_dict() if progress else None}
    if run.ema is not None:
        state.update(training_model=run.model.state_dict(), ema_updates=int(run.ema.n_averaged))
    return state


def evaluated(run: Run) -> CloudNet:
    """The model that validation, best.pt and out-of-fold prediction see: the average with train.ema."""
    return run.model if run.ema is None else run.ema.module


RESUME_KEYS = ("optimizer", "scheduler", "scaler", "rng", "metrics")  # beside checkpoint.REQUIRED_KEYS


def resumable(state: dict, path: Path, train_config, scaled: bool) -> dict:
    """`state` (last.pt's) if a run can go on from it under `train_config` (train.*) with fp16's
    loss scaling or not (`scaled`), else one line naming `path`: an epochs/epochN.pt (train.swa's)
    holds no optimizer or random states; fewer epochs than done would rewrite config.yaml for a run
    that trains nothing; and train.precision=auto on another GPU may take fp16 where the run took
    bf16 or the reverse (a disabled scaler saves an empty state, so the scale tells)."""
    missing = [key for key in RESUME_KEYS if key not in state]
    if missing:
        raise ValueError(f"{path}: not a checkpoint a run can go on from (no {', '.join(missing)}): "
                         "resume from the run's own last.pt")
    if state["epoch"] > train_config.epochs:
        raise ValueError(f"{path}: the run has done {state['epoch']} epochs; train.epochs={train_config.epochs} "
                         "asks for fewer")
    if bool(state["scaler"]) != scaled:
        trained, now = ("fp16", "bf16 or fp32") if state["scaler"] else ("bf16 or fp32", "fp16")
        raise ValueError(f"{path}: the run trained in {trained} and train.precision={train_config.precision} is {now} "
                         f"here: resume with train.precision={trained.replace(' or ', ' or train.precision=')}")
    return state


def follow_schedule(optimizer, scheduler) -> None:
    """Each group's learning rate as this run's schedule gives it at the step reached. The
    optimizer's saved rate is the old schedule's: with train.epochs changed on a resume, the first
    step would take it (0 at a cosine's end). Unchanged, it is the same float, so a resume stays exact."""
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)


def restore(state: dict, path: Path, **parts) -> tuple[int, list[dict], Progress | None]:
    """Load each part's state from a checkpoint (`state`, loaded from `path`); returns (epoch to
    run, metrics so far, progress within that epoch or None)."""
    for name, part in parts.items():
        part.load_state_dict(state[name])
    progress = Progress.from_dict(state["progress"]) if state.get("progress") else None
    log.info("resuming %s at epoch %d, window %d (step %d)", path.parent, state["epoch"] + 1,
             progress.windows if progress else 0, state["step"])
    return state["epoch"], state["metrics"], progress


def save_and_stop(run: Run, epoch: int, progress: Progress, rng: dict, when: str) -> None:
    """A stop was asked for mid-epoch: save a resumable last.pt, then raise Interrupted."""
    progress.skipped_samples = every_rank_skipped(progress.skipped_samples)
    if distributed.is_main():
        save_checkpoint(run.dir / "last.pt", checkpoint_state(run, epoch, progress, rng))
    raise Interrupted(f"stopped {when} of epoch {epoch + 1}; continue with: cloudseg train --resume {run.dir}")


def end_epoch(run: Run, epoch: int, progress: Progress, validation: dict, rng: dict) -> None:
    """A finished epoch: its metrics row, its skipped samples, best.pt when its Dice is the best so
    far, then last.pt. last.pt comes last: a resume takes the epoch as done once last.pt says so,
    so a process that dies before it redoes the epoch (exactly) and writes everything again, where
    best.pt written after last.pt could be lost for good."""
    progress.skipped_samples = every_rank_skipped(progress.skipped_samples)
    run.history.append(epoch_row(epoch, run.scheduler, progress, validation, run.step.device, run.peak_seconds))
    if not distributed.is_main():
        return
    report_skipped(progress.skipped_samples, epoch + 1, run.dir, f"unreadable samples in epoch {epoch + 1}")
    record(run.history, run.dir, run.board)
    state = checkpoint_state(run, epoch + 1, None, rng)
    if best_epoch(run.history) == len(run.history) - 1:
        save_checkpoint(run.dir / "best.pt", state)
    if run.config.train.swa or run.config.train.save_epochs:  # the weights that train, not the EMA's
        epoch_path(run.dir, epoch + 1).parent.mkdir(exist_ok=True)
        save_checkpoint(epoch_path(run.dir, epoch + 1), {**{k: state[k] for k in ("config", "epoch", "step")},
                                                         "model": run.model.state_dict(), "metrics": run.history})
    save_checkpoint(run.dir / "last.pt", state)


def best_epoch(history: list[dict]) -> int:
    """Index of the epoch best.pt holds: the highest validation Dice under the tuned rule (the
    last of equals; runs from before dice_tuned existed: the config's rule)."""
    scores = [row.get("dice_tuned", row["dice"]) for row in history]
    return len(scores) - 1 - scores[::-1].index(max(scores))


def average_into_best(run: Run) -> None:
    """train.swa: best.pt's model becomes the average of the chosen epochs' weights (swa.py),
    BatchNorm recomputed over the training folds; out-of-fold prediction and the tuned rule
    then come from it."""
    config = run.config.train
    epochs = chosen_epochs(run.history, config.swa, config.swa_from)
    paths = [epoch_path(run.dir, epoch) for epoch in epochs]
    if missing := [str(path) for path in paths if not path.is_file()]:
        raise ValueError(f"train.swa={config.swa} needs the weights of epochs {epochs}; missing: {', '.join(missing)}")
    model, _, _ = average_checkpoints(paths)
    images = recompute_norm_statistics(model, run.config, run.step.device)
    state = load_checkpoint(run.dir / "best.pt")
    state.update(model=model.state_dict(), swa={"epochs": epochs, "bn_images": images})
    save_checkpoint(run.dir / "best.pt", state)
    log.info("train.swa: best.pt holds the average of epochs %s, BatchNorm over %d training images", epochs, images)


def write_best_oof(run: Run, stop_requested=None) -> None:
    """The held-out fold's probabilities from best.pt, for `cloudseg tune` (oof.npz). A stop
    asked for here leaves the finished run to `--resume`, which writes only this."""
    load_weights(run.model, load_checkpoint(run.dir / "best.pt")["model"], run.dir / "best.pt")
    try:
        ids, probs8, truth, classes8 = predict_oof(run.model, run.config, run.step.device,
                                                   stop_requested=stop_requested)
    except StopRequested:
        raise Interrupted(f"stopped while writing {OOF_FILE} (training is done); "
                          f"continue with: cloudseg train --resume {run.dir}") from None
    write_oof(run.dir / OOF_FILE, ids, probs8, truth, classes8)
    log.info("wrote %s", run.dir / OOF_FILE)
    tune_run(run.dir, probs8, truth, run.config, classes8)


def tune_run(run_dir: Path, probs8: np.ndarray, truth: np.ndarray, config: Config,
             classes8: np.ndarray | None = None) -> None:
    """Every run tunes its own post-processing on its out-of-fold probabilities (the search of
    `cloudseg tune`, guarded against a small fold) into RUN/postprocess.json, which
    `cloudseg predict` applies by default."""
    result = search_rule(probs8, truth, config.predict, classes8=classes8)
    write_rule_file(result, run_dir / RULE_FILE)
    before, after = result["cv_dice"]["before"], result["cv_dice"]["after"]
    log.info("tuned the post-processing on %d out-of-fold images: CV Dice %.4f -> %.4f (%s); wrote %s",
             result["images"], before["mean"], after["mean"],
             ", ".join(f"{label} {before[label]:.3f} -> {after[label]:.3f}" for label in LABELS), run_dir / RULE_FILE)
    for note in pooled_notes(result):
        log.info("  %s", note)


# ---------------------------------------------------------------------------------- records


def epoch_row(epoch: int, scheduler, progress: Progress, validation: dict, device, peak_seconds: float) -> dict:
    """The metrics.csv row of a finished epoch; mfu is NaN on a CPU or a GPU flops.py does not know."""
    losses, images_per_s = progress.losses, progress.images / max(progress.seconds, 1e-9)
    return {"epoch": epoch + 1, "step": scheduler.last_epoch, "lr": scheduler.get_last_lr()[0],
            "train_loss": float(np.mean(losses)) if losses else math.nan, **validation,
            "images_per_s": images_per_s, "mfu": images_per_s * peak_seconds,
            **peak_memory_mb(device), "skipped_windows": progress.skipped_windows,
            "skipped_samples": len(progress.skipped_samples)}


def record(history: list[dict], run_dir: Path, board: SummaryWriter) -> None:
    """The newest epoch into the log, metrics.csv, curves.png and TensorBoard."""
    row = history[-1]
    log.info("epoch %d: " + ", ".join(f"{k} %.4g" for k in list(row)[2:]), row["epoch"], *list(row.values())[2:])
    write_metrics(history, run_dir / "metrics.csv")
    for key, value in list(row.items())[2:]:
        board.add_scalar(key, value, row["epoch"])
    board.flush()


def write_metrics(history: list[dict], path: Path) -> None:
    """metrics.csv, and its picture curves.png beside it."""
    with atomic_path(path) as tmp:
        pd.DataFrame(history).to_csv(tmp, index=False)
    with atomic_path(path.parent / "curves.png") as tmp:
        plot_curves(pd.DataFrame(history), tmp)


def every_rank_skipped(problems: list[Problem]) -> list[Problem]:
    """The samples any process skipped, each once (after a resume every rank holds the saved list)."""
    return list(dict.fromkeys(distributed.gathered(problems)))


def report_skipped(problems: list[Problem], epoch: int | None, run_dir: Path, what: str) -> None:
    """Warn about samples left out (skip mode) and append them to RUN/skipped.csv
    (epoch empty for bad train.csv rows, which no epoch sees)."""
    if not problems:
        return
    log.warning("%s: %d left out (%s):\n  %s", what, len(problems), run_dir / SKIPPED_CSV,
                "\n  ".join(problem.message for problem in problems))
    path = run_dir / SKIPPED_CSV
    rows = pd.DataFrame([("" if epoch is None else epoch, p.image_id, p.message) for p in problems],
                        columns=["epoch", "image_id", "problem"])
    if path.is_file():
        rows = pd.concat([pd.read_csv(path, dtype=str, keep_default_na=False), rows.astype(str)])
    with atomic_path(path) as tmp:
        rows.to_csv(tmp, index=False)


# ---------------------------------------------------------------------------------- helpers


def epochs_for(train_config, images: int) -> int:
    """train.epochs, or more where its passes over `images` would make fewer than train.min_steps
    optimizer steps (said in one log line). 64 images in the demo config's 8 epochs were 104 steps,
    and its models had learned nothing by the 4th (docs/cross-validation.md, enough steps)."""
    per_epoch = steps_per_epoch(train_config, images)
    needed = math.ceil(train_config.min_steps / per_epoch)
    if needed <= train_config.epochs:
        return train_config.epochs
    log.info("train.min_steps=%d: %d training images make %d optimizer step(s) an epoch, so train.epochs=%d would "
             "be %d steps; training %d epochs (%d steps; train.min_steps=0 keeps train.epochs)",
             train_config.min_steps, images, per_epoch, train_config.epochs, train_config.epochs * per_epoch,
             needed, needed * per_epoch)
    return needed


def steps_per_epoch(train_config, images: int) -> int:
    """Optimizer steps (windows) in an epoch over `images`: the last window may hold fewer images."""
    return math.ceil(images / train_config.effective_batch)


def datasets(config: Config, device: torch.device) -> tuple[CloudDataset, CloudDataset]:
    """Training folds (augmented) and the held-out fold of `config.data`, decoded where
    `data.decode` says for a run on `device`."""
    policy, decode = config.data.on_bad_sample, resolve_decode(config.data.decode, device)
    train_ids, valid_ids = fold_ids(config.data, config.seed)
    train_set = CloudDataset(config.data.dir, "train", train_ids, None, config.data.image_size, policy, decode=decode)
    train_set.transform = build_transform(**config.augment.model_dump(), image_size=train_set.image_size)
    valid_set = CloudDataset(config.data.dir, "train", valid_ids, None, train_set.image_size, policy, decode=decode)
    return train_set, valid_set


def every_rank_rng_states(device: torch.device) -> dict:
    """This process's random states, with each process's CUDA state of its own GPU (rank order):
    every process calls it at the same point."""
    cuda = cuda_rng_state(device)
    return rng_states(None if cuda is None else distributed.gathered([cuda]))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reset_peak_memory(device: torch.device) -> None:
    """At an epoch's start (after the probes of training_model): the peaks of metrics.csv are this
    epoch's, its training windows and its validation. The CPU's peak cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """The epoch's peaks for metrics.csv. On a GPU, PyTorch's allocator: `peak_allocated_mb`
    (tensors) and `peak_reserved_mb` (what the allocator held from the GPU, cached blocks
    included: the one that runs out). Neither counts memory outside the allocator (the CUDA
    context, cuDNN's and nvJPEG's own buffers). On the CPU, `peak_allocated_mb` is NaN (no
    allocator statistics) and `peak_reserved_mb` the process's peak resident memory since it
    started (the operating system keeps no per-epoch peak)."""
    if device.type == "cuda":
        return {"peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    resident_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB
    return {"peak_allocated_mb": math.nan, "peak_reserved_mb": resident_mb}
