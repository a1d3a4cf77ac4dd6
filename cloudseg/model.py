"""The network: a segmentation-models-pytorch UNet, UNet++ or FPN behind a uint8-in, logits-out wrapper.

Data path: train.csv → Dataset → loader → **model** → loss → accumulated step → checkpoint →
probabilities at 350×525 → post-process → submission, with the memory switches
(channels_last and activation checkpointing) and train.speedups.pad_stem.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from cloudseg.compiled import dynamo_deferred
from cloudseg.config import ModelConfig
from cloudseg.data import crop, pad
from cloudseg.task import LABELS

with dynamo_deferred():  # smp's timm and torchvision would load torch._dynamo (seconds) for nothing we use
    import segmentation_models_pytorch as smp

# Every smp ImageNet encoder uses these (asking smp for them would query the model hub).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# smp's defaults, for model.decoder_channels=null (the UNet's count also sets the encoder depth).
UNET_DECODER_CHANNELS = (256, 128, 64, 32, 16)
FPN_DECODER_CHANNELS = (256, 128)  # pyramid, segmentation


class CloudNet(nn.Module):
    """uint8 RGB images (N×3×H×W, any H, W) in; logits for the four labels (N×4×H×W) out, and
    with `with_classes=True` also the classification head's presence logits (N×4, None for a
    network without model.cls_head).

    Normalization runs on the model's device, so batches travel there as uint8 (4x fewer
    bytes); padding to a multiple of 32 and the exact crop back happen here too. The smp
    network is `self.unet` whatever its architecture: the name predates model.arch, and the
    state-dict keys of existing checkpoints (`unet.…`) depend on it.
    """

    def __init__(self, unet: nn.Module, channels_last: bool = False):
        super().__init__()
        self.unet = unet
        self.channels_last = channels_last
        self.fingerprint: str | None = None  # of the checkpoint it was loaded from (checkpoint.fingerprint)
        self.register_normalization()

    def register_normalization(self) -> None:
        """The input's mean and std (×255) as buffers, on the current default device: not saved
        in checkpoints, so made again on the CPU after a build on the meta device (`loaded_model`).
        Scaled on the CPU whatever the device: an operation on meta tensors imports torch._dynamo
        (seconds; `initialisation_skipped`)."""
        for name, values in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
            scaled = (torch.tensor(values, device="cpu") * 255).tolist()  # the products as before, exact as floats
            self.register_buffer(name, torch.tensor(scaled).view(1, 3, 1, 1), persistent=False)

    @property
    def has_head(self) -> bool:
        return getattr(self.unet, "classification_head", None) is not None

    def forward(self, images: torch.Tensor, with_classes: bool = False):
        x = pad((images.float() - self.mean) / self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out = self.unet(x)  # smp gives (masks, labels) when it has a classification head
        masks, classes = out if isinstance(out, tuple) else (out, None)
        masks = crop(masks, images.shape[-2:])
        return (masks, classes) if with_classes else masks


def forward_with_classes(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mask logits, class logits or None) from a CloudNet, also inside DistributedDataParallel
    or torch.compile (called through the wrapper, as DDP needs); any other module's output, or a
    CloudNet's without a head, is its mask logits."""
    inner = unwrapped(model)
    if isinstance(inner, CloudNet) and inner.has_head:
        return model(images, with_classes=True)
    return model(images), None  # without a head, the plain call: as before the head existed


def unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel (`module`) and torch.compile (`_orig_mod`) wrappers."""
    while not isinstance(model, CloudNet):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


HEAD_PREFIX = "unet.classification_head."  # the state-dict keys of smp's classification head


def load_weights(model: CloudNet, weights: dict, source, assign: bool = False) -> None:
    """`model.load_state_dict(weights, assign=assign)`, with a one-line error naming `source` when
    the weights have a classification head and the model has none, or the other way round (a
    checkpoint whose model.cls_head does not match its weights, or weights from another run)."""
    saved = any(key.startswith(HEAD_PREFIX) for key in weights)
    if saved != model.has_head:
        raise ValueError(f"{source}: the weights {'have' if saved else 'have no'} classification head but the config "
                         f"says model.cls_head={str(model.has_head).lower()}; they do not belong together")
    model.load_state_dict(weights, assign=assign)


def loaded_model(config: ModelConfig, weights: dict, source) -> CloudNet:
    """`build_model(config, pretrained=False)` holding `weights` (`load_weights`), built on the meta
    device so that the random initialisation the weights replace is skipped (0.3 of its 0.4 s for
    UNet-ResNet34 on 2 cores: a call's fixed cost, and every scene job's), torch.nn.init's
    functions too (`initialisation_skipped`), the weights then assigned, not copied. Built as
    usual where that fails or would change the model: an encoder that computes with its tensors
    while it is built (smp's mit_b*), a weight of another dtype than the model's, or a tensor the
    weights do not hold (a buffer not saved); the usual build then raises what belongs to the
    weights (`load_weights`)."""
    try:
        with torch.device("meta"), initialisation_skipped():
            model = build_model(config, pretrained=False)
        model.register_normalization()  # on the CPU: not in the weights
        expected = model.state_dict()
        if all(key not in weights or weights[key].dtype == tensor.dtype for key, tensor in expected.items()):
            load_weights(model, weights, source, assign=True)
            if not any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
                return model
    except Exception:  # noqa: BLE001, S110 -- whatever it was, the usual build says what is wrong
        pass
    model = build_model(config, pretrained=False)
    load_weights(model, weights, source)
    return model


@contextlib.contextmanager
def initialisation_skipped():
    """torch.nn.init's functions (kaiming_normal_ and the others that fill a tensor in place) leave
    their tensor as it is while the block runs, in every thread: for a model built on the meta
    device, where there is nothing to fill. They cost 0.03-0.05 s a build there, and torch's meta
    `normal_` (a Python reference wrapped against compiling) imports torch._dynamo, seconds of a
    call that compiles nothing (`compiled.dynamo_deferred`)."""
    names = [name for name in vars(nn.init) if name.endswith("_") and not name.startswith("_")]
    kept = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, _left_as_it_is)
    try:
        yield
    finally:
        for name, function in kept.items():
            setattr(nn.init, name, function)


def _left_as_it_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def build_model(config: ModelConfig, pretrained: bool = True) -> CloudNet:
    """The network of `config`; `pretrained=False` skips the weight download (e.g. before loading a checkpoint)."""
    try:
        unet = _unet(config, weights=None)  # a bad encoder name fails here, before any download
    except KeyError as error:
        raise ValueError(f"model.encoder={config.encoder!r} is not an smp encoder: {str(error)[:160]}...") from None
    except ValueError as error:  # e.g. more decoder stages than the encoder has
        raise ValueError(f"model.arch={config.arch} with model.encoder={config.encoder!r} and "
                         f"model.decoder_channels={config.decoder_channels}: {error}") from None
    if pretrained and config.encoder_weights is not None:
        unet = _download_weights(config)
    if config.norm == "group":
        batchnorm_to_groupnorm(unet)
    return CloudNet(unet)


def _unet(config: ModelConfig, weights: str | None) -> nn.Module:
    """The smp network of `config`, of any model.arch (the name predates the others)."""
    # Logits (no activation) and no dropout: smp's default 0.2 would draw other masks on each of
    # several processes, and the step would no longer equal one process's.
    head = {"aux_params": {"classes": len(LABELS), "dropout": None}} if config.cls_head else {}
    return smp.create_model(config.arch, encoder_name=config.encoder, encoder_weights=weights,
                            classes=len(LABELS), **decoder_arguments(config), **head)


def decoder_arguments(config: ModelConfig) -> dict:
    """smp's keyword arguments for model.decoder_channels: the stage widths of a UNet or UNet++
    decoder (their count is the encoder depth), or FPN's pyramid and segmentation widths."""
    if config.arch == "fpn":
        pyramid, segmentation = config.decoder_channels or FPN_DECODER_CHANNELS
        return {"decoder_pyramid_channels": pyramid, "decoder_segmentation_channels": segmentation}
    channels = tuple(config.decoder_channels or UNET_DECODER_CHANNELS)
    return {"decoder_channels": channels, "encoder_depth": len(channels)}


def _download_weights(config: ModelConfig) -> nn.Module:
    try:
        return _unet(config, weights=config.encoder_weights)
    except Exception as error:  # network, hub and cache errors come in many classes
        raise RuntimeError(
            f"could not get the {config.encoder_weights!r} weights for encoder {config.encoder!r} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            "Without internet access, set model.encoder_weights=null to train from random weights, "
            "or pre-fill the model cache (HF_HOME, TORCH_HOME) on a machine that has access."
        ) from error


def batchnorm_to_groupnorm(module: nn.Module) -> None:
    """Replace every BatchNorm2d in place by a GroupNorm over the same channels (32 groups or fewer).

    The learned scale and shift carry over; the running statistics have no GroupNorm analogue.
    """
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            group_norm = nn.GroupNorm(math.gcd(32, child.num_features), child.num_features, eps=child.eps)
            if child.affine:
                group_norm.load_state_dict({"weight": child.weight.detach(), "bias": child.bias.detach()})
            setattr(module, name, group_norm)
        else:
            batchnorm_to_groupnorm(child)


def train_mode(model: CloudNet, norm: str) -> None:
    """model.train(), except that `norm: frozen` keeps the encoder's norm layers in eval mode."""
    model.train()
    if norm == "frozen":
        net = getattr(model, "module", model)  # inside DistributedDataParallel
        for module in net.unet.encoder.modules():
            if isinstance(module, _BatchNorm):
                module.eval()


def prepare_for_training(model: CloudNet, channels_last: bool, checkpointing: str) -> CloudNet:
    """Apply the memory and speed switches of `train.*` to a freshly built model."""
    model.channels_last = channels_last
    if channels_last:
        model.to(memory_format=torch.channels_last)
    set_checkpointing(model, checkpointing)
    return model


# ---------------------------------------------------------------------------------- padded stem


def pad_stem(model: CloudNet, on: bool = True) -> nn.Conv2d | None:
    """train.speedups.pad_stem: the encoder's stem (its first convolution of 3 input channels) runs
    on 4, as tuned ResNet training does: a channels_last bf16 pixel of 4 channels is 8 bytes, the
    alignment cuDNN's tensor-core kernels want, where 3 channels are 6. The weight stays a 3-channel
    parameter (the checkpoint's shape, the optimizer's state): the input and the weight are each
    padded with a zero channel inside the forward, so the fourth channel adds 0 × 0 to each sum
    and no parameter exists for AdamW to move. `on=False` restores the plain stem. Returns the
    stem, or None for an encoder without one."""
    stem = next((m for m in model.unet.encoder.modules() if isinstance(m, nn.Conv2d) and m.in_channels == 3), None)
    if stem is not None:
        vars(stem).pop("forward", None)
        if on:
            stem.forward = functools.partial(_four_channel_stem, stem)
    return stem


def _four_channel_stem(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    x = F.pad(x, (0, 0, 0, 0, 0, 1)).contiguous(memory_format=layout)  # N×4×H×W, channel 4 zero
    weight = F.pad(conv.weight, (0, 0, 0, 0, 0, 1))  # out×4×k×k, slice 4 zero: its gradient goes nowhere
    return conv._conv_forward(x, weight, conv.bias)


# ---------------------------------------------------------------------------------- checkpointing


CHECKPOINTING_MODES = ("none", "encoder", "full")  # least recomputation first; train.checkpointing also takes auto


def set_checkpointing(model: CloudNet, mode: str) -> list[nn.Module]:
    """Recompute activations in backward instead of keeping them (`mode` as in
    `checkpoint_blocks`), replacing whatever mode the model had: `train.checkpointing: auto`
    tries the modes on one model. Returns the wrapped modules."""
    for module in model.modules():
        wrapper = vars(module).get("forward")
        if isinstance(wrapper, functools.partial) and wrapper.func is _checkpointed:  # an earlier mode's
            del module.forward
    regions = checkpoint_blocks(model, mode)
    for region in regions:
        region.forward = functools.partial(_checkpointed, region, region.forward)
    return regions


def checkpoint_blocks(model: CloudNet, mode: str) -> list[nn.Module]:
    """The modules that checkpointing `mode` wraps, each recomputed in backward.

    `encoder`: the whole encoder, one region: only its input is kept, and its outputs are the
    decoder's skip features, kept anyway. (Per encoder block, the stem's activations at half
    resolution and the block inputs stayed: 1.7 GiB more at micro-batch 4, same recomputation.)
    `full`: also each decoder block (UNet's and UNet++'s blocks, FPN's segmentation blocks), where
    most full-resolution activations live, and each encoder block inside the encoder's region, so
    that recomputing the encoder holds one block's activations at a time; this costs one more
    encoder forward. For UNet-ResNet34 at 1408×2112 a step is 2.12 TFLOP per image, of which an
    encoder forward is 0.43 and a decoder forward 0.27: encoder +20%, full +54%.
    """
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"checkpointing {mode!r}: expected one of {', '.join(CHECKPOINTING_MODES)} "
                         "(train.checkpointing=auto is resolved when training starts)")
    encoder, decoder = model.unet.encoder, model.unet.decoder
    return {"none": [], "encoder": [encoder],
            "full": [encoder, *_blocks(encoder), *_blocks(decoder)]}[mode]


def _blocks(module: nn.Module):
    """The blocks of a network: members of its Sequential/ModuleList/ModuleDict containers that
    hold parameters and submodules (ResNet's BasicBlocks, MobileNet's InvertedResiduals, smp's
    UNet decoder blocks, UNet++'s decoder blocks in a ModuleDict, FPN's segmentation blocks),
    without descending into a block once found."""
    for child in module.children():
        is_block = any(True for _ in child.children()) and any(True for _ in child.parameters())
        if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and is_block:
            yield child
        else:
            yield from _blocks(child)


def _checkpointed(block: nn.Module, forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        # torch.compile refuses a context_fn. Its recomputation writes the BatchNorm buffers
        # again: harmless inside engine.window_norm_statistics, which sets them at the window's end.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), norm_statistics_kept(block)), **kwargs)


@contextlib.contextmanager
def norm_statistics_kept(block: nn.Module):
    """Around the recomputation in backward: BatchNorm computes the same output from the same
    batch, but must not update its running statistics a second time."""
    saved = norm_statistics(block)
    try:
        yield
    finally:
        restore_norm_statistics(block, saved)


NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def norm_statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the BatchNorm running statistics in `module`, to undo a forward's updates."""
    return {name: buffer.clone() for name, buffer in module.named_buffers()
            if name.rsplit(".", 1)[-1] in NORM_STATISTICS}


def restore_norm_statistics(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in saved.items():
            buffers[name].copy_(value)
