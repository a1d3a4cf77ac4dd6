"""Inference: probabilities at 350×525 from one or several models, and the Kaggle submission.

Data path: train.csv → Dataset → loader → model → loss → accumulated step → checkpoint →
**probabilities at 350×525** → post-process → **submission**. Validation, out-of-fold and test
prediction all take their probabilities from `batch_probabilities`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from cloudseg import rle
from cloudseg.checkpoint import fingerprint, fold_checkpoints, load_checkpoint
from cloudseg.compiled import compile_logged, compiled, resolve_compile
from cloudseg.config import FIXED_BY_CHECKPOINT, Config, PredictConfig, apply_overrides, first_change, from_dict
from cloudseg.data import CloudDataset, make_loader, sample_rows, test_image_ids
from cloudseg.decode import decode_batch, resolve_decode
from cloudseg.files import atomic_path
from cloudseg.metrics import resize_probs
from cloudseg.hardware import autocast, autocast_dtype, resolve_device, speed_switches
from cloudseg.model import CloudNet, forward_with_classes, loaded_model, prepare_for_training
from cloudseg.postprocess import (HEAD_GATES, RULE_DEFAULTS, RULE_FILE, RULE_KEYS, TOP_K, apply_rule, is_cv_fold,
                                  quantize, read_rule_file)
from cloudseg.task import ID_COLUMN, LABELS, RLE_COLUMN, SAMPLE_SUBMISSION_CSV, SUBMISSION_SHAPE, image_label

log = logging.getLogger("cloudseg")


# Test-time augmentation: the flips (dims of an N×C×H×W batch) whose predictions are averaged.
TTA_FLIPS = {
    "none": [()],
    "hflip": [(), (-1,)],
    "hvflip": [(), (-1,), (-2,)],
    "d4-lite": [(), (-1,), (-2,), (-2, -1)],
}


BLACK_LEVEL = 10  # a pixel whose channels are all at most this is no-data (JPEG leaves a little noise)


@torch.no_grad()
def predict_probs(model: CloudNet, images: torch.Tensor, dtype: torch.dtype | None = None,
                  tta: str = "none", zero_black: bool = False, with_classes: bool = False):
    """Sigmoid probabilities (N×4×H×W, float32) at the images' own size, averaged over the
    `tta` flips (each prediction flipped back first), and zero on black no-data pixels when
    `zero_black`. A model's float32 logits become the probabilities, in place (`sigmoid_of_own`).
    Pad and crop live in the model. Validation, OOF and test use this alone.
    `with_classes`: (probabilities, the classification head's probabilities N×4 averaged over
    the same flips, or None for a model without a head)."""
    flips, probs, classes = TTA_FLIPS[tta], None, None
    for dims in flips:
        with autocast(images.device, dtype):
            logits, class_logits = forward_with_classes(model, images.flip(dims) if dims else images)
        probs = summed(probs, sigmoid_of_own(logits).flip(dims) if dims else sigmoid_of_own(logits))
        classes = None if class_logits is None else summed(classes, class_logits.float().sigmoid())
    if len(flips) > 1:
        probs.div_(len(flips))
        classes = None if classes is None else classes.div_(len(flips))
    if zero_black:
        probs.masked_fill_(no_data(images), 0.0)
    return (probs, classes) if with_classes else probs


def sigmoid_of_own(logits: torch.Tensor) -> torch.Tensor:
    """float32 sigmoid of a model's fresh logits, taken in place over them (or over their float32
    copy): on a CPU a new tensor's pages cost more than the sigmoid itself (four 1400×2100 windows'
    zero logits and their sigmoid: 150 ms, in place 87; 2 cores). Logits whose elements may share
    memory (an expanded or unfolded view) get a new tensor."""
    logits = logits.float()
    return logits.sigmoid() if may_overlap(logits) else logits.sigmoid_()


def may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of `tensor` may lie at one address: False only where each stride,
    smallest first, passes the reach of the dimensions inside it (a contiguous tensor, a crop of
    one, a permutation)."""
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def summed(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """total + term, in place into the total, which the caller owns; the term itself first (the
    sums and the single prediction, as before, bit for bit, one pass over the data fewer each)."""
    return term if total is None else total.add_(term)


class Probabilities(NamedTuple):
    native: torch.Tensor  # N×4×H×W at the images' own size (the validation loss is computed here)
    submission: torch.Tensor  # N×4×350×525: what is post-processed, scored and encoded
    classes: torch.Tensor | None = None  # N×4: the classification heads' probabilities; None unless every model has one


@torch.no_grad()
def batch_probabilities(models: list[CloudNet], images: torch.Tensor, dtype: torch.dtype | None,
                        predict: PredictConfig) -> Probabilities:
    """The models' combined probabilities for a batch (`ensemble_probs` by `predict.ensemble`;
    each model's with `predict.tta` and, when `predict.zero_black`, zero on no-data pixels), the
    same resized to submission size, and their heads' combined probabilities (when each has a
    head). Models combine at the images' own size, then the result is resized."""
    native, classes = ensemble_probs(models, images, dtype, predict.tta, predict.zero_black, combine=predict.ensemble)
    return Probabilities(native, resize_probs(native), classes)


# predict.ensemble=logits: each model's probability is clamped to [EPS, 1 - EPS] before its logit,
# so that one saturated model (a logit of ±9.2 at most) cannot outvote the others alone.
ENSEMBLE_EPS = 1e-4


def ensemble_probs(models: list[CloudNet], images: torch.Tensor, dtype: torch.dtype | None, tta: str = "none",
                   zero_black: bool = False, *, combine: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The models' `predict_probs` at the images' own size combined, and their heads'
    probabilities combined alike (None unless every model has a head). `combine` (predict.ensemble):
    "logits", the sigmoid of their mean logit, or "probabilities", their mean. One model's are
    its own either way."""
    if len(models) == 1:
        return predict_probs(models[0], images, dtype, tta, zero_black, with_classes=True)
    to_sum = (lambda p: p.logit_(eps=ENSEMBLE_EPS)) if combine == "logits" else (lambda p: p)  # fresh tensors: in place
    total, heads, every_head = None, None, True
    for model in models:
        model_probs, model_classes = predict_probs(model, images, dtype, tta, zero_black, with_classes=True)
        total = summed(total, to_sum(model_probs))
        every_head = every_head and model_classes is not None
        heads = summed(heads, to_sum(model_classes)) if every_head else None
    total, heads = total.div_(len(models)), None if heads is None else heads.div_(len(models))
    if combine == "logits":
        total, heads = total.sigmoid_(), None if heads is None else heads.sigmoid_()
    return total, heads


def no_data(images: torch.Tensor) -> torch.Tensor:
    """N×1×H×W: True where every channel of the uint8 image is at most BLACK_LEVEL."""
    return images.amax(dim=1, keepdim=True) <= BLACK_LEVEL  # as (images <= BLACK_LEVEL).all(1), 8x faster


def load_model(path: str | Path, device: torch.device) -> tuple[CloudNet, Config]:
    """A model rebuilt from a checkpoint alone (no config file, no weight download), holding the
    checkpoint's `fingerprint` (what segment records of the model that made a map)."""
    state = load_checkpoint(path)
    config = from_dict(state["config"], source=f"{path} (saved config)")
    model = loaded_model(config.model, state["model"], path)
    prepare_for_training(model, config.train.channels_last, checkpointing="none")  # the memory format it trained in
    model.fingerprint = fingerprint(state)
    return model.to(device).eval(), config


def padded(images: torch.Tensor, size: int) -> torch.Tensor:
    """`images` with black images appended up to `size`, so that a compiled model sees one batch
    shape (the short last batch would compile a second graph)."""
    if len(images) == size:
        return images
    return torch.cat([images, images.new_zeros((size - len(images), *images.shape[1:]))])


def predict(checkpoints: list[str], data_dir: str | None, out: str, overrides: list[str] = (),
            postprocess_file: str | None = None, device: str = "auto") -> Path:
    """Combine the checkpoints' probabilities (predict.ensemble) at 350×525, post-process by the tuned rule (see
    `tuned_rule`), write a checked submission. `overrides` (predict.threshold=...) come last;
    `device`: auto (a GPU when PyTorch sees one), cpu or cuda."""
    if Path(out).is_dir():  # told now, not after the whole prediction
        raise ValueError(f"{out}: --out is a folder, not a file; name the submission's CSV (submission.csv)")
    ensemble = load_ensemble(checkpoints, postprocess_file, overrides, device)
    config, device = ensemble.config, ensemble.device
    data_dir = data_dir or config.data.dir
    dataset = CloudDataset(data_dir, split="test", image_size=config.data.image_size,
                           decode=resolve_decode(config.data.decode, device))
    rows, rule = [], {**config.predict.model_dump(), "top_k": ensemble.top_k}
    for batch in tqdm(make_loader(dataset, config.data, config.predict.batch_size, device), desc="predict",
                      unit="batch", disable=None):
        images = decode_batch(batch, device)["image"].to(device, non_blocking=True)
        native, classes = ensemble_native(ensemble, images)
        classes8 = None if classes is None else quantize(classes.cpu().numpy())
        masks = apply_rule(resize_probs(native).cpu().numpy(), rule, classes8)
        for image_id, image_masks in zip(batch["image_id"], masks):
            rows += [(image_label(image_id, label), rle.encode(m)) for label, m in zip(LABELS, image_masks)]
    path = write_submission(rows, Path(data_dir) / SAMPLE_SUBMISSION_CSV, out)
    log.info("wrote %s (%d rows) from %d checkpoint(s)", path, len(rows), len(ensemble.forwards))
    return path


class Ensemble(NamedTuple):
    """The checkpoints' models ready to predict, as `predict` and `segment` run them."""
    config: Config  # the first checkpoint's, with the tuned rule and the overrides applied
    top_k: int  # the rule's empty-mask gate looks at this many pixels
    device: torch.device
    dtype: torch.dtype | None  # autocast's, from train.precision
    compiling: bool  # predict.compile resolved for the device
    forwards: list  # the models, each under torch.compile when compiling
    fingerprints: tuple[str | None, ...] = ()  # the checkpoints' (`checkpoint.fingerprint`), in their order


def load_ensemble(checkpoints: list[str], postprocess_file: str | None, overrides: list[str] = (),
                  device: str = "auto", work_pixels: int | None = None) -> Ensemble:
    """Load the checkpoints on `device` (auto, cpu or cuda), take the first one's config, the
    tuned rule (see `tuned_rule`) and then `overrides` (predict.tta=..., predict.compile=...). An
    every-fold run's best.pt stands for its folds' checkpoints, whose rule is the run's pooled one.
    `work_pixels`: the pixels of the images the call will predict, when known; predict.compile=auto
    then compiles only where they, times the test-time flips, repay it (compiled.resolve_compile)."""
    checkpoints = [str(path) for checkpoint in checkpoints for path in fold_checkpoints(checkpoint) or [checkpoint]]
    rule_file = tuned_rule(checkpoints, postprocess_file)
    device = resolve_device(device, "--device")
    speed_switches(device, inference=True)
    loaded = [load_model(path, device) for path in checkpoints]
    for path, (_, other) in zip(checkpoints[1:], loaded[1:]):
        if other.data.image_size != loaded[0][1].data.image_size:
            raise ValueError(f"{path}: trained on images of {other.data.image_size}, {checkpoints[0]} on "
                             f"{loaded[0][1].data.image_size}: an ensemble's models must share one input size")
    raw = loaded[0][1].model_dump(mode="json")
    top_k = TOP_K
    if rule_file:
        rule = read_rule_file(rule_file)
        raw["predict"].update({key: rule[key] for key in (*RULE_KEYS, *RULE_DEFAULTS)})
        top_k = rule.get("top_k", TOP_K)
    config = from_dict(apply_overrides(raw, overrides), f"{checkpoints[0]} (saved config)", overrides)
    if change := first_change(from_dict(raw), config, FIXED_BY_CHECKPOINT):
        key, was, now = change
        raise ValueError(f"{key} comes from the checkpoint ({was!r} in {checkpoints[0]}), "
                         f"not from an override ({now!r}); it applies to training")
    flipped = None if work_pixels is None else work_pixels * len(TTA_FLIPS[config.predict.tta])
    compiling = resolve_compile(config.predict.compile, device, "predict.compile", flipped)
    models = [model for model, _ in loaded]
    if any(kind in HEAD_GATES for kind in config.predict.gate_on) and not all(model.has_head for model in models):
        raise ValueError(f"{rule_file or 'predict.gate_on'}: the rule gates on the classification head "
                         f"({', '.join(config.predict.gate_on)}), and "
                         f"{'not every model has one' if len(models) > 1 else 'the model has none'} (model.cls_head); "
                         "tune the rule for these checkpoints, or use --postprocess none")
    forwards = [compiled(model) for model in models] if compiling else models
    return Ensemble(config, top_k, device, autocast_dtype(config.train.precision, device), compiling, forwards,
                    tuple(getattr(model, "fingerprint", None) for model in models))  # a stand-in model has none


def ensemble_native(ensemble: Ensemble, images: torch.Tensor, *,
                    zero_black: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ensemble's probabilities and head probabilities (`ensemble_probs` with the config's
    predict.tta, and its zero_black unless `zero_black` is given) for a batch of at most
    predict.batch_size images, padded to that size for a compiled model."""
    count, predict_config = len(images), ensemble.config.predict
    zero_black = predict_config.zero_black if zero_black is None else zero_black
    if ensemble.compiling:
        images = padded(images, predict_config.batch_size)
    with compile_logged(ensemble.compiling, images.shape, what="prediction batches"):
        native, classes = ensemble_probs(ensemble.forwards, images, ensemble.dtype, predict_config.tta, zero_black,
                                         combine=predict_config.ensemble)
    return native[:count], None if classes is None else classes[:count]


def tuned_rule(checkpoints: list[str], postprocess_file: str | None) -> Path | None:
    """The postprocess.json that prediction applies: `postprocess_file` when given ("none":
    none, the checkpoints' own config rule); else the one beside a single checkpoint (every run
    writes its own); else, for the folds of one CV directory (CV/fold*/best.pt), the pooled
    rule CV/postprocess.json of `make cv`. Says which in one log line."""
    if postprocess_file == "none":
        log.info("post-processing: the checkpoint's config rule (--postprocess none)")
        return None
    if postprocess_file:
        return Path(postprocess_file)
    parents = {Path(checkpoint).resolve().parent for checkpoint in checkpoints}
    if len(parents) == 1:
        rule = parents.pop() / RULE_FILE
        if rule.is_file():
            log.info("post-processing: the tuned rule of %s (--postprocess none turns it off)", rule)
            return rule
        log.warning("post-processing: no %s beside %s; the config's rule, not tuned (run cloudseg tune)",
                    RULE_FILE, checkpoints[0])
        return None
    cv_dirs = {parent.parent for parent in parents}
    if len(cv_dirs) == 1 and all(is_cv_fold(parent) for parent in parents):
        pooled = cv_dirs.pop() / RULE_FILE
        if pooled.is_file():
            log.info("post-processing: the pooled rule of %s (--postprocess none turns it off)", pooled)
            return pooled
        raise ValueError(f"the checkpoints are folds of {pooled.parent}, which has no pooled {RULE_FILE}: "
                         f"run cloudseg tune over them (make tune), or name a rule with --postprocess FILE|none")
    raise ValueError(f"{len(checkpoints)} checkpoints from different runs and no --postprocess: name the rule "
                     f"(e.g. --postprocess CV_DIR/{RULE_FILE} from cloudseg tune over their runs), "
                     "or --postprocess none for the config's")


def write_submission(rows: list[tuple[str, str]], sample_path: Path, out: str | Path) -> Path:
    """Write rows in the order of sample_submission.csv's rows after checking they form a valid
    submission: each of its Image_Labels once, each decoding at 350x525."""
    import pandas as pd  # here: pandas takes 0.3 s to import, and segment, which imports this module, makes no table

    submission = pd.DataFrame(rows, columns=[ID_COLUMN, RLE_COLUMN]).set_index(ID_COLUMN)
    expected = sample_rows(sample_path.parent)
    missing, extra = set(expected) - set(submission.index), set(submission.index) - set(expected)
    if len(submission) != len(expected) or missing or extra:
        raise ValueError(f"submission has {len(submission)} rows, {sample_path} asks for {len(expected)}"
                         + "".join(f"; {name} {', '.join(sorted(keys)[:3])}{' ...' if len(keys) > 3 else ''}"
                                   for name, keys in (("missing", missing), ("not asked for", extra)) if keys))
    submission = submission.loc[expected]
    for key, encoded in submission[RLE_COLUMN].items():
        try:
            rle.decode(encoded, SUBMISSION_SHAPE)
        except ValueError as error:  # a bug if it ever happens: never write a file Kaggle rejects
            raise ValueError(f"submission row {key} does not decode at 350x525: {error}") from None
    with atomic_path(out) as tmp:
        submission.reset_index().to_csv(tmp, index=False)
    return Path(out)

