"""Weight averaging (SWA): the mean of several epochs' weights, its BatchNorm statistics
recomputed over the training images, as one checkpoint (pudae, 1st place: SWA of 5 checkpoints).

Data path: checkpoints → **their average** → probabilities at 350×525 → post-process → submission.

The running statistics of an average of weights are not the average of the statistics: each
BatchNorm layer's input changes with the weights before it. So the parameters are averaged
(`torch.optim.swa_utils.AveragedModel`) and the statistics measured again
(`torch.optim.swa_utils.update_bn`): one pass over the training folds, without augmentation,
in micro-batches as training saw them, each layer's statistics the equal-weight mean over the
micro-batches. `cloudseg swa` and `train.swa` run it in one process over every training image;
`train.ema` runs it before each validation with the micro-batches shared among the processes,
whose per-layer means are then pooled, weighted by their micro-batches: the mean over the same
micro-batches as one process would take. With `model.norm: frozen` the encoder's statistics
are kept (they are the pretrained ones, frozen on purpose).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import AveragedModel, update_bn

from cloudseg import distributed
from cloudseg.checkpoint import load_checkpoint, save_checkpoint
from cloudseg.config import Config, from_dict
from cloudseg.data import CloudDataset, Problem, fold_ids, make_loader, readable
from cloudseg.model import CloudNet, build_model, load_weights, norm_statistics, restore_norm_statistics

log = logging.getLogger("cloudseg")

EPOCHS_DIR = "epochs"  # RUN/epochs/epochN.pt: each epoch's training weights (train.swa, train.save_epochs)


def epoch_path(run_dir: Path, epoch: int) -> Path:
    """Where a run keeps the weights of epoch `epoch` (counted from 1)."""
    return Path(run_dir) / EPOCHS_DIR / f"epoch{epoch}.pt"


def chosen_epochs(history: list[dict], k: int, source: str) -> list[int]:
    """The epochs (from 1) that train.swa averages: the last `k`, or (`source` best) the `k` of
    highest validation dice_tuned; an error when fewer than `k` epochs were run."""
    if k > len(history):
        raise ValueError(f"train.swa={k} asks for {k} epochs' weights and the run has {len(history)}; "
                         f"set train.swa to at most {len(history)}")
    epochs = [row["epoch"] for row in history]
    if source == "best":
        epochs = sorted(epochs, key=lambda e: history[epochs.index(e)].get("dice_tuned", history[epochs.index(e)]["dice"]))
    return sorted(epochs[-k:])


def average_checkpoints(paths: list[str | Path]) -> tuple[CloudNet, Config, dict]:
    """The mean of the checkpoints' weights (their BatchNorm statistics NOT yet recomputed: see
    `recompute_norm_statistics`), the first one's config, and its state. Checkpoints of
    different networks are an error naming the file."""
    if not paths:
        raise ValueError("give at least one checkpoint to average")
    first = load_checkpoint(paths[0])
    config = from_dict(first["config"], source=f"{paths[0]} (saved config)")
    model = build_model(config.model, pretrained=False)
    average = AveragedModel(model)
    for path in paths:
        state = first if path == paths[0] else load_checkpoint(path)
        if state["config"]["model"] != first["config"]["model"]:
            raise ValueError(f"{path}: its model section differs from {paths[0]}'s; only weights of one network "
                             "can be averaged")
        load_weights(model, state["model"], path)
        average.update_parameters(model)
    return average.module, config, first


@torch.no_grad()
def recompute_norm_statistics(model: CloudNet, config: Config, device: torch.device, sharded: bool = False) -> int:
    """Each BatchNorm layer's running statistics measured again over the training folds of
    `config` (no augmentation, micro-batches of train.micro_batch); returns the images seen
    (in a sharded call, this process's).
    `sharded`: every process of a distributed run calls it, each on its share of the images.
    Unreadable images (data.on_bad_sample=skip) are left out, with a warning, and not counted."""
    frozen = model.unet.encoder if config.model.norm == "frozen" else None
    kept = norm_statistics(frozen) if frozen is not None else {}
    train_ids, _ = fold_ids(config.data, config.seed)
    dataset = CloudDataset(config.data.dir, "train", train_ids, None, config.data.image_size,
                           config.data.on_bad_sample, decode="cpu")
    micro_batch = config.train.micro_batch if isinstance(config.train.micro_batch, int) else 1
    shard = distributed.shard_batches(len(dataset), micro_batch) if sharded else None
    loader = make_loader(dataset, config.data, micro_batch, device, shard)
    model.to(device)
    norms = [module for module in model.modules() if isinstance(module, _BatchNorm)]
    skipped: list[Problem] = []
    if norms:
        update_bn((batch["image"] for batch in readable(loader, skipped)), model, device)
        if sharded:
            pool_ranks(norms)
    if frozen is not None:
        restore_norm_statistics(frozen, kept)
    if skipped:
        log.warning("BatchNorm statistics measured without %d unreadable training image(s): %s", len(skipped),
                    ", ".join(problem.image_id for problem in skipped))
    return (len(dataset) if shard is None else len(shard)) - len(skipped)


def pool_ranks(norms: list[_BatchNorm]) -> None:
    """Each layer's statistics as the mean over every process's micro-batches: `update_bn` left
    each process the mean over its own, and their count in num_batches_tracked. Every layer's
    count and count-weighted sums travel in one flat vector: one all-reduce for the whole model."""
    parts = []
    for norm in norms:
        count = norm.num_batches_tracked.to(norm.running_mean.dtype).reshape(1)
        parts += [count, norm.running_mean * count, norm.running_var * count]
    if not parts:
        return
    sums = distributed.summed(torch.cat(parts)).split([part.numel() for part in parts])
    for i, norm in enumerate(norms):
        total, mean_sum, var_sum = sums[3 * i:3 * i + 3]
        norm.running_mean.copy_(mean_sum / total)
        norm.running_var.copy_(var_sum / total)
        norm.num_batches_tracked.copy_(total.squeeze())


def swa(paths: list[str | Path], out: str | Path, device: torch.device = torch.device("cpu")) -> Path:
    """`cloudseg swa`: average the checkpoints, recompute BatchNorm over the first one's training
    folds, and write a checkpoint (the first one's state, its model replaced) to `out`; nothing
    is written on an error."""
    model, config, state = average_checkpoints(paths)
    images = recompute_norm_statistics(model, config, device)
    state = {key: value for key, value in state.items() if key != "training_model"}
    state.update(model=model.cpu().state_dict(), swa={"checkpoints": [str(p) for p in paths], "bn_images": images})
    save_checkpoint(out, state)
    log.info("averaged %d checkpoint(s), BatchNorm over %d training images: wrote %s", len(paths), images, out)
    return Path(out)
