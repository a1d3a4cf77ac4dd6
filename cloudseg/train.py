"""Training at native resolution with gradient accumulation that equals the big batch.

An optimizer step consumes one *window* of `effective_batch` images, fed as micro-batches of
`micro_batch` images. Each micro-batch's loss is the sum of its per-image losses over the
number of images in the whole window, so the accumulated gradient is exactly the gradient of
the window's mean loss, also for the short last window of an epoch (which never borrows
images from the next epoch).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import resource
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from cloudseg import distributed
from cloudseg.checkpoint import load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from cloudseg.config import Config, dump
from cloudseg.data import CloudDataset, EpochSampler, Problem, build_transform, collate, fold_ids, readable
from cloudseg.files import atomic_path
from cloudseg.metrics import dice, resize_masks, resize_probs, summarize
from cloudseg.memory import resolve_micro_batch
from cloudseg.oof import OOF_FILE, predict_oof, write_oof
from cloudseg.hardware import autocast, autocast_dtype, resolve_device
from cloudseg.model import (build_model, norm_statistics, norm_statistics_kept, prepare_for_training,
                            restore_norm_statistics, train_mode)
from cloudseg.postprocess import postprocess
from cloudseg.predict import predict_probs
from cloudseg.task import LABELS
from cloudseg.viz import plot_curves

log = logging.getLogger("cloudseg")
SKIPPED_CSV = "skipped.csv"


# ---------------------------------------------------------------------------------- loss


def per_image_loss(logits: torch.Tensor, masks: torch.Tensor, dice_weight: float = 1.0) -> torch.Tensor:
    """BCE + soft Dice loss for each image (shape N), so that losses add up across micro-batches.

    The soft Dice is per image and per class, then averaged: smp's DiceLoss pools the batch,
    and a mean of micro-batch pooled Dice losses is not the pooled Dice of the window.
    """
    target = masks.float()
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none").mean((1, 2, 3))
    probs = logits.sigmoid()
    overlap, total = (probs * target).sum((2, 3)), (probs + target).sum((2, 3))
    soft_dice = 1 - (2 * overlap + 1) / (total + 1)
    return bce + dice_weight * soft_dice.mean(1)


# ---------------------------------------------------------------------------------- one step


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


class Step(NamedTuple):
    loss: float
    grad_norm: float
    skipped: bool  # a non-finite loss or gradient: no update was made


def train_step(model, window, optimizer, scaler, device, dtype, grad_clip, dice_weight,
               micro_batch: int | None = None, window_images: int | None = None, blank: dict | None = None) -> Step:
    """Accumulate one window's gradient, then take one optimizer step (none if the loss or
    gradient is not finite).

    `micro_batch` re-cuts the window's batches smaller (after an out-of-memory error): the
    weights are per image, so the update does not change. On several processes `model` is
    DDP, `window` this rank's part and `window_images` the images of all parts; a rank whose
    part is empty feeds `blank` with weight 0, so that it still joins the all-reduce.
    """
    world = distributed.world_size()
    window_images = window_images or sum(len(batch["image"]) for batch in window)
    micro_batches = split(window, micro_batch) or [blank]
    window_loss = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with distributed.gradient_sync(model, now=last), norm_statistics_kept(model) if not window else contextlib.nullcontext():
            images = batch["image"].to(device, non_blocking=True)
            masks = batch["mask"].to(device, non_blocking=True)
            with autocast(device, dtype):
                logits = model(images)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # loss in >= fp32
            # This micro-batch's share of the window mean: sum of its per-image losses / window size
            # (times the number of processes, as DDP averages their gradients).
            loss = per_image_loss(logits, masks, dice_weight).sum() * (world if window else 0) / window_images
            scaler.scale(loss).backward()  # fp16: the scale is constant inside the window
        window_loss += loss.detach()
    scaler.unscale_(optimizer)  # once per window, so clipping sees the true gradient
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item()
    loss = distributed.total(window_loss.item(), device) / world
    if scaler.is_enabled():  # fp16: the scaler skips the step itself when the gradient overflowed
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
    else:
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return Step(loss, grad_norm, skipped)


def resilient_step(model, window, optimizer, scaler, device, dtype, train_config, micro_batch: int,
                   window_images: int | None = None, blank: dict | None = None):
    """`train_step` that survives CUDA out-of-memory: halve the micro-batch (doubling the
    accumulation) and redo the interrupted window from its start, so the update is the one
    it would have been. Returns (the Step, micro-batch now in use).

    Not on several processes: a redo there would put the ranks' all-reduces out of step.
    """
    saved_statistics = norm_statistics(model)
    while True:
        try:
            step = train_step(model, window, optimizer, scaler, device, dtype, train_config.grad_clip,
                              train_config.dice_weight, micro_batch, window_images, blank)
            return step, micro_batch
        except torch.cuda.OutOfMemoryError:
            if micro_batch == 1 or distributed.world_size() > 1:
                raise
            optimizer.zero_grad(set_to_none=True)
            restore_norm_statistics(model, saved_statistics)  # undo the failed attempt's BatchNorm updates
            if device.type == "cuda":
                torch.cuda.empty_cache()
            micro_batch //= 2
            log.warning("CUDA out of memory: micro-batch now %d, accumulation %d; redoing the window",
                        micro_batch, train_config.effective_batch // micro_batch)


def lr_schedule(optimizer, train_config, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
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
def validate(model, loader, device, dtype, config: Config, skipped: list[Problem] | None = None) -> dict[str, float]:
    """Validation loss at native size and Kaggle Dice (mean and per class) at 350×525;
    unreadable samples (skip mode) go into `skipped`. On several processes each validates
    its shard and the per-image results are gathered, so every rank returns the same."""
    model.eval()
    losses, pair_dice = [], []
    for batch in readable(loader, [] if skipped is None else skipped):
        images, masks = batch["image"].to(device), batch["mask"].to(device)
        probs = predict_probs(model, images, dtype, config.predict.tta, config.predict.zero_black)
        losses += per_image_loss(torch.logit(probs, eps=1e-6), masks, config.train.dice_weight).tolist()
        small = resize_probs(probs).cpu().numpy()
        pred = postprocess(small, config.predict.threshold, config.predict.min_area, config.predict.gate)
        pair_dice.append(dice(pred, resize_masks(masks).cpu().numpy()))
    losses, pair_dice = distributed.gathered(losses), distributed.gathered(pair_dice)
    summary = summarize(np.concatenate(pair_dice))
    return {"valid_loss": float(np.mean(losses)), "dice": summary["dice"],
            **{f"dice_{label}": summary[label] for label in LABELS}}


# ---------------------------------------------------------------------------------- the run


def train(config: Config, run_dir: str | Path, resume: bool = False) -> pd.DataFrame:
    """Train `config` into `run_dir` (or continue it from last.pt); returns metrics per epoch.

    Under torchrun, each process trains its share of every window (see EpochSampler) and
    rank 0 alone writes the run directory.
    """
    run_dir = Path(run_dir)
    device = distributed.start(resolve_device(config.train.device))
    main_rank = distributed.is_main()
    dtype = autocast_dtype(config.train.precision, device)
    seed_everything(config.seed)
    train_set, valid_set = datasets(config)
    config.data.image_size = train_set.image_size  # resolved, so inference needs no image
    model = build_model(config.model).to(device)
    prepare_for_training(model, config.train.channels_last, config.train.checkpointing)
    if config.model.norm == "frozen" and config.model.encoder_weights is None:
        log.warning("model.norm=frozen with random encoder weights freezes meaningless statistics (0 and 1)")
    config.train.micro_batch = resolve_micro_batch(config, model, train_set.image_size, device, distributed.world_size())
    accumulation = config.train.accumulation_for(distributed.world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    steps_per_epoch = math.ceil(len(train_set) / config.train.effective_batch)
    scheduler = lr_schedule(optimizer, config.train, config.train.epochs * steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    start_epoch, history, progress = 0, [], None
    if resume:
        start_epoch, history, progress = restore(run_dir / "last.pt", model=model, optimizer=optimizer,
                                                 scheduler=scheduler, scaler=scaler)
    elif main_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(run_dir / "config.yaml") as tmp:
            tmp.write_text(dump(config))
        report_skipped(train_set.skipped, None, run_dir, "bad rows of train.csv")
    board = SummaryWriter(run_dir / "tb") if main_rank else None  # `make tensorboard` shows it
    sampler = EpochSampler(len(train_set), config.seed, config.train.effective_batch, config.train.micro_batch,
                           distributed.rank(), distributed.world_size())
    train_loader = loader(train_set, config, device, sampler=sampler)
    valid_loader = loader(valid_set, config, device, sampler=distributed.shard(len(valid_set)))
    log.info("training %d images, validating %d (fold %d) at %dx%d on %s, %s; %d process(es) x %d micro-batches "
             "of %d per step", len(train_set), len(valid_set), config.data.fold, *train_set.image_size, device,
             dtype or "fp32", distributed.world_size(), accumulation, config.train.micro_batch)
    trained, micro_batch = distributed.wrap(model, device), config.train.micro_batch
    with stop_requests() as stop_requested:
        for epoch in range(start_epoch, config.train.epochs):
            progress = progress or {"windows": 0, "losses": [], "images": 0, "skipped": 0, "seconds": 0.0,
                                    "skipped_samples": []}
            sampler.set_epoch(epoch, start=progress["windows"] * config.train.effective_batch)
            micro_batch, stopped = train_epoch(trained, train_loader, optimizer, scheduler, scaler, device, dtype,
                                               config, accumulation, micro_batch, epoch, progress, stop_requested)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
                     "step": scheduler.last_epoch, "rng": rng_states(), "config": config.model_dump(mode="json"),
                     "metrics": history, "progress": progress}
            if stopped:
                progress["skipped_samples"] = every_rank_skipped(progress["skipped_samples"])
                if main_rank:
                    save_checkpoint(run_dir / "last.pt", state)
                raise Interrupted(f"stopped after window {progress['windows']} of epoch {epoch + 1}; "
                                  f"continue with: cloudseg train --resume {run_dir}")
            validation = validate(model, valid_loader, device, dtype, config, progress["skipped_samples"])
            progress["skipped_samples"] = every_rank_skipped(progress["skipped_samples"])
            history.append(epoch_row(epoch, scheduler, progress, validation, device))
            if main_rank:
                report_skipped(progress["skipped_samples"], epoch + 1, run_dir, f"unreadable samples in epoch {epoch + 1}")
                save_epoch(run_dir, {**state, "epoch": epoch + 1, "metrics": history, "progress": None}, board)
            progress = None
    if main_rank:
        board.close()
        write_best_oof(model, config, device, run_dir)
    distributed.stop()
    return pd.DataFrame(history)


def every_rank_skipped(problems: list[Problem]) -> list[Problem]:
    """The samples any process skipped, each once (after a resume every rank holds the saved list)."""
    return list(dict.fromkeys(distributed.gathered(problems)))


def restore(path: Path, **parts) -> tuple[int, list[dict], dict | None]:
    """Load each part's state and the RNG states from a checkpoint; returns (epoch to run,
    metrics so far, progress within that epoch or None)."""
    state = load_checkpoint(path)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    restore_rng_states(state["rng"])
    progress = state.get("progress")
    log.info("resuming %s at epoch %d, window %d (step %d)", path.parent, state["epoch"] + 1,
             progress["windows"] if progress else 0, state["step"])
    return state["epoch"], state["metrics"], progress


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM after saving a resumable checkpoint."""


@contextlib.contextmanager
def stop_requests():
    """Within: SIGINT and SIGTERM ask the loop to stop after the current window (a second
    SIGINT stops at once). Yields a function that says whether a stop was asked for."""
    requested = []

    def ask_to_stop(signum, frame):
        if requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not requested:  # under torchrun the launcher passes the signal on too: say it once
            log.warning("%s: finishing the current window, then saving a resumable checkpoint",
                        signal.Signals(signum).name)
        requested.append(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield lambda: False
        return
    previous = {s: signal.signal(s, ask_to_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(requested)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def train_epoch(model, train_loader, optimizer, scheduler, scaler, device, dtype, config: Config,
                accumulation: int, micro_batch: int, epoch: int, progress: dict, stop_requested) -> tuple[int, bool]:
    """Windows of the training folds, one optimizer and scheduler step each, until the epoch
    ends or a stop is asked for (on any process); tallies go into `progress`. Returns the
    micro-batch in use and whether a stop was asked for.

    A window with a non-finite loss or gradient makes no step, is logged and counted;
    `train.max_skipped_windows` of them in a row stop the run.
    """
    train_mode(model, config.model.norm)
    desc = f"epoch {epoch + 1}/{config.train.epochs}"
    count = math.ceil((len(train_loader.dataset) - train_loader.sampler.start) / config.train.effective_batch)
    blank = None if distributed.world_size() == 1 else {  # see train_step
        "image": torch.zeros(1, 3, *config.data.image_size, dtype=torch.uint8),
        "mask": torch.zeros(1, 4, *config.data.image_size, dtype=torch.uint8)}
    started, in_a_row, stopped = time.perf_counter(), 0, False
    bar = tqdm(windows(train_loader, accumulation, count), desc=desc, unit="step", total=count,
               disable=None if distributed.is_main() else True)
    for window in bar:
        window = list(readable(window, progress["skipped_samples"]))
        images = int(distributed.total(sum(len(batch["image"]) for batch in window), device))
        progress["windows"] += 1
        if images:  # else every sample was unreadable (skip mode): nothing to learn from
            step, micro_batch = resilient_step(model, window, optimizer, scaler, device, dtype, config.train,
                                               micro_batch, images, blank)
            progress["images"] += images
            in_a_row = count_skip(step, in_a_row, progress, desc, config.train.max_skipped_windows)
            if not step.skipped:
                scheduler.step()
                progress["losses"].append(step.loss)
                bar.set_postfix(loss=f"{step.loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        if distributed.total(stop_requested(), device):
            stopped = True
            break
    progress["seconds"] += time.perf_counter() - started
    return micro_batch, stopped


def count_skip(step: Step, in_a_row: int, progress: dict, desc: str, limit: int) -> int:
    """Count a window that made no step (non-finite loss or gradient); returns the run of
    such windows, and stops the run when it reaches `limit`."""
    if not step.skipped:
        return 0
    progress["skipped"], in_a_row = progress["skipped"] + 1, in_a_row + 1
    log.warning("%s, window %d: loss %s, gradient norm %s: not finite, window skipped (%d in a row)",
                desc, progress["windows"], step.loss, step.grad_norm, in_a_row)
    if in_a_row >= limit:
        raise RuntimeError(f"{in_a_row} windows in a row had a non-finite loss or gradient ({desc}); "
                           "lower train.lr, set train.grad_clip, or use train.precision=bf16 or fp32")
    return in_a_row


def epoch_row(epoch: int, scheduler, progress: dict, validation: dict, device) -> dict:
    """The metrics.csv row of a finished epoch."""
    losses = progress["losses"]
    return {"epoch": epoch + 1, "step": scheduler.last_epoch, "lr": scheduler.get_last_lr()[0],
            "train_loss": float(np.mean(losses)) if losses else math.nan, **validation,
            "images_per_s": progress["images"] / max(progress["seconds"], 1e-9),
            "peak_memory_mb": peak_memory_mb(device), "skipped_windows": progress["skipped"],
            "skipped_samples": len(progress["skipped_samples"])}


def save_epoch(run_dir: Path, state: dict, board: SummaryWriter) -> None:
    """A finished epoch: its metrics, last.pt, and best.pt when its Dice is the best so far."""
    history = state["metrics"]
    record(history, run_dir, board)
    save_checkpoint(run_dir / "last.pt", state)
    if history[-1]["dice"] >= max(row["dice"] for row in history):
        save_checkpoint(run_dir / "best.pt", state)


def record(history: list[dict], run_dir: Path, board: SummaryWriter) -> None:
    """The newest epoch into the log, metrics.csv, curves.png and TensorBoard."""
    row = history[-1]
    log.info("epoch %d: " + ", ".join(f"{k} %.4g" for k in list(row)[2:]), row["epoch"], *list(row.values())[2:])
    write_metrics(history, run_dir / "metrics.csv")
    for key, value in list(row.items())[2:]:
        board.add_scalar(key, value, row["epoch"])
    board.flush()


def write_best_oof(model, config: Config, device, run_dir: Path) -> None:
    """The held-out fold's probabilities from best.pt, for `cloudseg tune` (oof.npz)."""
    model.load_state_dict(load_checkpoint(run_dir / "best.pt")["model"])
    write_oof(run_dir / OOF_FILE, *predict_oof(model, config, device))
    log.info("wrote %s", run_dir / OOF_FILE)


def datasets(config: Config) -> tuple[CloudDataset, CloudDataset]:
    """Training folds (augmented) and the held-out fold of `config.data`."""
    policy = config.data.on_bad_sample
    train_ids, valid_ids = fold_ids(config.data, config.seed)
    train_set = CloudDataset(config.data.dir, "train", train_ids, None, config.data.image_size, policy)
    train_set.transform = build_transform(**config.augment.model_dump(), image_size=train_set.image_size)
    valid_set = CloudDataset(config.data.dir, "train", valid_ids, None, train_set.image_size, policy)
    return train_set, valid_set


def loader(dataset, config: Config, device, sampler=None) -> DataLoader:
    workers = config.data.num_workers
    return DataLoader(dataset, batch_size=config.train.micro_batch, sampler=sampler, num_workers=workers,
                      collate_fn=collate,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=config.data.prefetch_factor if workers else None)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated on a GPU; on CPU, the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


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


def write_metrics(history: list[dict], path: Path) -> None:
    """metrics.csv, and its picture curves.png beside it."""
    with atomic_path(path) as tmp:
        pd.DataFrame(history).to_csv(tmp, index=False)
    with atomic_path(path.parent / "curves.png") as tmp:
        plot_curves(pd.DataFrame(history), tmp)
