"""Typed run configuration: YAML files in configs/, dotted `key=value` overrides. It steers
every step of the data path and travels with the run (config.yaml) and every checkpoint.

Every field documents itself (`cloudseg config -c FILE` prints them). Unknown keys and
wrong types are errors that name the key. The resolved config is saved in every run
directory and inside every checkpoint, so inference needs no config file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, field_validator,
                      model_validator)

from cloudseg.task import LABELS


GateScore = Literal["top_k", "head", "score"]


class Section(BaseModel):
    # numbers finite: lr=.inf or a NaN threshold is a slip, not a setting (pydantic takes them by default)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def no_boolean_but_for_a_switch(cls, value, info):
        """YAML's true or false (also as it reads off, on, yes and no) where the field is no switch,
        alone or in a per-class list: pydantic would take them as 1 and 0 for a number, and list a
        word's choices against a False the user never typed."""
        annotation = cls.model_fields[info.field_name].annotation
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, bool) for item in values) and not takes(annotation, bool):
            raise ValueError("give a number, not true or false" if takes(annotation, int, float) else
                             "YAML reads off, on, yes and no as false and true: quote the word, in quotes the shell "
                             "keeps, e.g. \"train.speedups.autotune='off'\"")
        return value


def takes(annotation, *kinds: type) -> bool:
    """Whether a field's type has one of `kinds` in it (bool | Literal["auto"] takes bool,
    tuple[PositiveInt, PositiveInt] takes int; bool is no int here)."""
    return annotation in kinds or any(takes(arg, *kinds) for arg in get_args(annotation))


class DataConfig(Section):
    dir: str = Field("data/kaggle", description="folder in the Kaggle layout (train.csv, train_images/, ...)")
    fold: int = Field(0, ge=0, description="fold held out for validation; the other folds train")
    n_folds: int = Field(5, ge=2, description="number of folds (folds.csv is made once per data folder)")
    image_size: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="expected native [H, W] of every image; null = the size most of the first 32 images have"
    )
    num_workers: int = Field(2, ge=0, description="DataLoader worker processes")
    prefetch_factor: int = Field(2, ge=1, description="micro-batches each worker loads ahead (with num_workers > 0)")
    on_bad_sample: Literal["raise", "skip"] = Field(
        "raise", description="a bad image or train.csv row: raise = stop with an error naming it; "
        "skip = leave it out with a warning, listed in RUN/skipped.csv (run `cloudseg check` first)"
    )
    decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="where images and masks are decoded and augmented: cpu = in the DataLoader workers; "
        "gpu = batched on the GPU (nvjpeg, RLE), workers only read bytes and draw the augmentation; needs CUDA; "
        "auto = gpu when the run is on CUDA, else cpu"
    )


class AugmentConfig(Section):
    hflip: float = Field(0.5, ge=0, le=1, description="probability of a horizontal flip")
    vflip: float = Field(0.5, ge=0, le=1, description="probability of a vertical flip")
    shift_scale_rotate: float = Field(0.0, ge=0, le=1, description="probability of a small shift/scale/rotation")
    brightness_contrast: float = Field(0.0, ge=0, le=1, description="probability of a brightness/contrast change")
    nodata_band: float = Field(0.0, ge=0, le=1, description="probability of a black no-data band (labels removed under it)")


class ModelConfig(Section):
    arch: Literal["unet", "unetplusplus", "fpn"] = Field(
        "unet", description="smp architecture: unet; unetplusplus (nested skip paths: more compute and memory); "
        "fpn (feature pyramid, predicts at 1/4 resolution and upsamples bilinearly)"
    )
    encoder: str = Field("resnet34", description="smp encoder name (e.g. resnet34, resnet18, efficientnet-b0)")
    encoder_weights: str | None = Field("imagenet", description="pretrained encoder weights; null = random init")
    decoder_channels: tuple[int, ...] | None = Field(
        None, description="decoder widths. unet, unetplusplus: one per decoder stage, deep to shallow (their count "
        "is the encoder depth); null = [256, 128, 64, 32, 16]. fpn: [pyramid, segmentation], segmentation a "
        "multiple of 32 (its decoder uses GroupNorm with 32 groups); null = [256, 128]"
    )
    norm: Literal["batch", "frozen", "group"] = Field(
        "batch", description="batch: BatchNorm as is; frozen: encoder norm layers in eval mode; group: GroupNorm"
    )
    cls_head: bool = Field(
        False, description="a classification head (smp's aux_params) on the encoder's deepest features: a presence "
        "logit per class, trained with train.cls_weight, that the tuned rule may use as its empty-mask gate"
    )

    @model_validator(mode="after")
    def _decoder_channels_fit_the_arch(self):
        """Refused rather than reinterpreted: UNet widths make no sense as FPN widths, and back."""
        channels = self.decoder_channels
        if channels is None:
            return self
        if not channels or any(width < 1 for width in channels):
            raise ValueError(f"model.decoder_channels must be one or more positive widths, got {list(channels)}")
        if self.arch == "fpn" and (len(channels) != 2 or channels[1] % 32):
            raise ValueError(
                f"model.decoder_channels={list(channels)} does not fit model.arch=fpn: give [pyramid, segmentation] "
                "widths with segmentation a multiple of 32 (e.g. [128, 64]), or null for [256, 128]"
            )
        return self


class SpeedupsConfig(Section):
    """Exact-maths speed-ups of the compiled step (issue #37): each off until a GPU measurement
    shows it faster (benchmarks/train_speed.py's rows h), each tested on the CPU to train the same
    weights as without it."""

    cudnn_search: bool = Field(
        False, description="cuDNN's benchmark tries every convolution algorithm per shape (benchmark_limit 0) "
        "instead of its first 10: the same maths, a longer first window"
    )
    autotune: Literal["off", "reductions", "all"] = Field(
        "off", description="with train.compile, inductor's autotuning: reductions = coordinate-descent tuning of its "
        "kernels (batch-norm statistics among them); all = max-autotune-no-cudagraphs (also convolutions against "
        "Triton templates with fused epilogues; minutes more compiling)"
    )
    pad_stem: bool = Field(
        False, description="the stem convolution runs on 4 input channels, its input and weight each padded with "
        "a zero channel inside the forward: the same function and updates; checkpoints keep 3 channels"
    )


class TrainConfig(Section):
    epochs: int = Field(15, ge=1, description="passes over the training folds")
    min_steps: int = Field(
        200, ge=0, description="at least this many optimizer steps: where train.epochs passes over few images "
        "make fewer, the run trains more epochs (said in the log, written in its config.yaml); 0 = exactly "
        "train.epochs (docs/cross-validation.md)"
    )
    micro_batch: int | Literal["auto"] = Field(
        4, description="images per forward/backward pass; auto = the largest that fits the GPU (probed)"
    )
    effective_batch: int = Field(16, ge=1, description="images per optimizer step (micro_batch x accumulation)")
    lr: float = Field(3e-4, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="learning-rate shape after warmup, per step")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "auto", description="autocast dtype; auto = bf16 on a GPU of compute capability >= 8.0, "
        "fp16 with a GradScaler on older GPUs, fp32 on CPU"
    )
    grad_clip: float | None = Field(1.0, gt=0, description="max global gradient norm; null = no clipping")
    dice_weight: float = Field(1.0, ge=0, description="loss = BCE + dice_weight x per-image soft Dice loss")
    cls_weight: float = Field(
        0.1, ge=0, description="with model.cls_head: loss += cls_weight x BCE of the head's logits on "
        "'this class has a mask' (per image, so it accumulates exactly like the rest)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    max_skipped_windows: int = Field(
        5, ge=1, description="stop after this many windows in a row with a non-finite loss or gradient"
    )
    channels_last: bool = Field(True, description="NHWC memory format (faster convolutions on tensor cores)")
    ema: float | None = Field(
        None, gt=0, lt=1, description="decay of an exponential moving average of the weights (and BatchNorm "
        "statistics), updated once per optimizer step, validated and saved as the model (e.g. 0.99); null = off"
    )
    checkpointing: Literal["auto", "none", "encoder", "full"] = Field(
        "auto", description="recompute activations in backward: none; encoder (the encoder as one region); full "
        "(also each decoder block, encoder blocks nested); auto = the least of these under which micro_batch fits "
        "the GPU, by probe steps (none on CPU)"
    )
    deterministic: bool = Field(
        False, description="deterministic GPU algorithms (cuDNN, cuBLAS, no benchmark): runs and resumes repeat bit "
        "for bit on a GPU, ~10% slower; false = fastest kernels, runs differ in the last bits"
    )
    swa: int | None = Field(
        None, ge=1, description="average the weights of K epochs (train.swa_from) at the end, BatchNorm statistics "
        "recomputed over the training images; the average becomes best.pt's model; keeps each epoch's weights in "
        "RUN/epochs/; null = off"
    )
    swa_from: Literal["last", "best"] = Field(
        "last", description="which K epochs train.swa averages: the last K, or the K with the highest dice_tuned"
    )
    save_epochs: bool = Field(
        False, description="keep every epoch's training weights in RUN/epochs/epochN.pt (train.swa does anyway), "
        "to average later with cloudseg swa"
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each micro-batch's forward and loss (one graph per micro-batch shape, "
        "compiled in the first window); auto = on with CUDA (where Triton is installed)"
    )
    speedups: SpeedupsConfig = Field(
        SpeedupsConfig(), description="exact-maths speed-ups of the step, each off until measured on a GPU"
    )
    every_fold: bool | Literal["auto"] = Field(
        "auto", description="train every fold of data.n_folds in one run (RUN/foldK), tune one rule on all their "
        "out-of-fold images and predict with their ensemble (RUN/best.pt names them); false = data.fold alone; "
        "auto = every fold where the data has at most 400 training images (docs/cross-validation.md)"
    )
    in_sample_rule: bool | Literal["auto"] = Field(
        "auto", description="an every-fold run also tunes its rule on the folds' ensemble predicting every training "
        "image (RUN/insample.npz), beside their out-of-fold images: a rule that fits the ensemble predict applies; "
        "auto = where the data has at most 400 training images (docs/cross-validation.md)"
    )

    @model_validator(mode="after")
    def _accumulation_divides(self):
        if self.micro_batch == "auto":
            return self
        if self.micro_batch < 1:
            raise ValueError(f"train.micro_batch must be at least 1 or auto, got {self.micro_batch}")
        if self.effective_batch % self.micro_batch:
            raise ValueError(
                f"train.effective_batch ({self.effective_batch}) must be a multiple of "
                f"train.micro_batch ({self.micro_batch})"
            )
        return self

    @model_validator(mode="after")
    def _swa_fits_the_epochs(self):
        if self.swa is not None and self.swa > self.epochs:
            raise ValueError(f"train.swa={self.swa} averages {self.swa} epochs' weights, more than train.epochs="
                             f"{self.epochs} saves; set train.swa to at most {self.epochs}")
        return self

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on one process (once micro_batch is a number)."""
        return self.accumulation_for(1)

    def accumulation_for(self, world: int) -> int:
        """Micro-batches per process per optimizer step on `world` processes, keeping
        effective_batch = micro_batch × accumulation × processes."""
        if self.micro_batch == "auto":
            raise ValueError("train.micro_batch=auto is resolved when training starts")
        per_step = self.micro_batch * world
        if self.effective_batch % per_step:
            raise ValueError(f"train.effective_batch ({self.effective_batch}) must be a multiple of "
                             f"train.micro_batch x processes ({self.micro_batch} x {world})")
        return self.effective_batch // per_step


class PredictConfig(Section):
    threshold: tuple[float, float, float, float] = Field(
        (0.5,) * 4, description="per-class probability threshold (Fish, Flower, Gravel, Sugar); one number = all"
    )
    min_area: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt, NonNegativeInt] = Field(
        (0,) * 4, description="per-class minimum connected-component area in pixels at 350x525; one number = all"
    )
    gate: tuple[float, float, float, float] = Field(
        (0.0,) * 4, description="per-class empty-mask gate: keep a mask only if its gate score (predict.gate_on) "
        "clears it"
    )
    gate_on: tuple[GateScore, GateScore, GateScore, GateScore] = Field(
        ("top_k",) * 4, description="per-class gate score: top_k = mean of the top-1000 pixel probabilities; head = "
        "the classification head's probability; score = the mean of the two (pudae's); head and score need "
        "model.cls_head"
    )
    gate_search: tuple[GateScore, ...] = Field(
        ("top_k",), description="gate scores the tuning tries per class: top_k, head, score (head and score only for "
        "a model with a head; they scored lower on noisy labels at demo scale, BENCHMARKS.md)"
    )
    force_label: float | None = Field(
        None, ge=0, le=1, description="at least one label per image: where the rule empties all four classes, keep "
        "the class of highest score (head and top-k mean, or top-k mean alone) thresholded at this; null = off"
    )
    force_label_search: bool = Field(
        False, description="the tuning also tries force_label (off or one threshold); off by default: it did not "
        "score higher on noisy labels at demo scale (BENCHMARKS.md)"
    )
    box: tuple[bool, bool, bool, bool] = Field(
        (False,) * 4, description="per-class: each kept component becomes its bounding box (Kaggle's labels are "
        "unions of labellers' rectangles); one value = all"
    )
    box_search: bool = Field(
        True, description="the tuning also decides box per class: on where it raises the out-of-fold Dice under "
        "the tuned rule (measured on noisy labels at demo scale, BENCHMARKS.md)"
    )
    batch_size: int = Field(4, ge=1, description="images per inference batch")
    zero_black: bool = Field(False, description="zero the probabilities where the image is black (no-data bands)")
    tta: Literal["none", "hflip", "hvflip", "d4-lite"] = Field(
        "none", description="flip test-time augmentation (validation too): d4-lite = identity, h, v and hv flips"
    )
    ensemble: Literal["logits", "probabilities"] = Field(
        "logits", description="how several checkpoints' probabilities combine (e.g. every fold's): the sigmoid of "
        "their mean logit (each clamped to [1e-4, 1 - 1e-4]), or their mean"
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model for test prediction (one graph: the short last batch is padded); "
        "auto = on with CUDA (where Triton is installed)"
    )

    @field_validator("threshold", "min_area", "gate", "gate_on", "box", mode="before")
    @classmethod
    def _one_per_class(cls, value):
        return (value,) * len(LABELS) if isinstance(value, (bool, int, float, str)) else value


class Config(Section):
    seed: int = Field(42, description="seed for weights, data order and augmentation")
    data: DataConfig = DataConfig()
    augment: AugmentConfig = AugmentConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    predict: PredictConfig = PredictConfig()


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (or the defaults when path is None) plus `key=value` overrides."""
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config file not found")
        raw = parsed_yaml(path.read_text(), str(path)) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a config file must be a mapping of sections")
    return from_dict(apply_overrides(raw, overrides), str(path or "defaults"), overrides)


def from_dict(raw: dict, source: str = "config", overrides: list[str] = ()) -> Config:
    """Validated Config; ValueError lists every bad key as `section.key: problem`, after the
    override that set it (`overrides`, already applied to `raw`) or else `source`."""
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        by_origin = {}
        for e in error.errors():
            key = ".".join(map(str, e["loc"])) or "config"
            problem = f"{key}: {e['msg'].removeprefix('Value error, ')}" + (
                f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and not isinstance(e["input"], dict) else "")
            origin = _setter(key, problem if e["type"] != "extra_forbidden" else None, overrides)
            by_origin.setdefault(origin or source, []).append(problem)
        told = "; ".join(f"{origin}: {'; '.join(problems)}" for origin, problems in by_origin.items())
        raise ValueError(told.replace("Extra inputs are not permitted", "unknown key")) from None


def _setter(key: str, problem: str | None, overrides: list[str]) -> str | None:
    """The last of `overrides` that set `key` or a section above it, or a key inside `key`: an
    unknown section it made (`problem` None: `trian.lr=0.1` is told at `trian`), or one that the
    problem of a whole section (keys that do not fit together) names; as an error names it."""
    for override in reversed(overrides):
        name = override.partition("=")[0]
        inside = name.startswith(f"{key}.") and (problem is None or re.search(rf"\b{re.escape(name)}\b", problem))
        if key == name or key.startswith(f"{name}.") or inside:
            return f"override {override!r}"
    return None


# What a run's state was made with: its folds, its weights' shapes, its data order and its
# optimizer's and scheduler's states (which a resume loads over the config's lr, weight decay and
# schedule). A resume that changes one is refused: it would be ignored, or break the run.
FIXED_ON_RESUME = ("seed", "data.fold", "data.n_folds", "data.image_size", "model", "train.effective_batch",
                   "train.lr", "train.weight_decay", "train.schedule", "train.warmup_steps", "train.ema")


# What a checkpoint's model was built with. Prediction takes them from the checkpoint, so an
# override of one would be ignored; it is refused instead.
FIXED_BY_CHECKPOINT = ("model", "data.image_size", "train.channels_last")


def resumed_config(saved: dict, overrides: list[str], source: str) -> Config:
    """The config of a resumed run: `saved` (a checkpoint's) with `overrides`, none of which may
    change a key of FIXED_ON_RESUME (a one-line error naming it); others apply (train.epochs, the
    workers, the rule validation scores with, ...)."""
    config = from_dict(apply_overrides(saved, overrides), source, overrides)
    if change := first_change(from_dict(saved, source), config, FIXED_ON_RESUME):
        key, was, now = change
        raise ValueError(f"{source}: a resumed run keeps the {key} it trained with ({was!r}, not {now!r}): "
                         "train a new run (--out) for another")
    return config


def first_change(before: Config, after: Config, keys: tuple[str, ...]) -> tuple[str, object, object] | None:
    """The first key, dotted down to a value (`model.encoder`, not `model`), that differs from
    `before` to `after` among `keys` (each a key or a whole section), with its two values."""
    was, now = _leaves(before.model_dump(mode="json")), _leaves(after.model_dump(mode="json"))
    for key in was:
        if any(key == fixed or key.startswith(f"{fixed}.") for fixed in keys) and was[key] != now[key]:
            return key, was[key], now[key]
    return None


def _leaves(raw: dict, prefix: str = "") -> dict:
    """{"section.key": value} for every value of nested sections."""
    leaves = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Copy of `raw` with each `a.b=value` set; values parse as YAML (null, [1400, 2100], true)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override {override!r} is not of the form section.key=value")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {override!r}: {part} is not a section")
        node[leaf] = parsed_yaml(text, f"override {override!r}") if text.strip() else ""
    return raw


def parsed_yaml(text: str, source: str):
    """`text` as YAML, or a one-line ValueError naming `source` and where the text stops parsing."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{source}{where}: not valid YAML ({getattr(error, 'problem', None) or error})") from None


def dump(config: Config) -> str:
    """The config as YAML (loadable again with `load_config`)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def describe() -> str:
    """Every key with its type, default and one-line doc."""
    return "\n".join(_described(Config, ""))


def _described(section: type[BaseModel], prefix: str):
    """One line per key of `section`, nested sections (train.speedups) key by key."""
    for name, field in section.model_fields.items():
        if isinstance(field.default, BaseModel):
            yield from _described(type(field.default), f"{prefix}{name}.")
        else:
            yield f"{prefix}{name} = {field.default!r}  # {field.description}"
