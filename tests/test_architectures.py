"""model.arch: UNet, UNet++ and FPN behind the same wrapper, with every memory switch.

Small models (mobilenet_v2, random weights, narrow decoders) on 64x96 images keep this fast.
"""

import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn

from cloudseg.cli import main
from cloudseg.config import ModelConfig, load_config
from cloudseg.memory import estimate
from cloudseg import model as model_module
from cloudseg.model import CloudNet, build_model, checkpoint_blocks, loaded_model, set_checkpointing, train_mode
from tests.test_memory_savers import loss_grads_and_stats

ARCHS = ("unet", "unetplusplus", "fpn")
# Narrow decoders; FPN's segmentation width must be a multiple of 32 (its GroupNorm has 32 groups).
SMALL_DECODER = {"unet": (16, 8, 8, 8, 8), "unetplusplus": (16, 8, 8, 8, 8), "fpn": (16, 32)}


def small_config(arch, **kw):
    return ModelConfig(arch=arch, encoder="mobilenet_v2", encoder_weights=None,
                       decoder_channels=SMALL_DECODER[arch], **kw)


def float64_model(arch, mode):
    torch.manual_seed(0)  # the same weights (and FPN's dropout masks) with and without checkpointing
    model = build_model(small_config(arch)).double().train()
    set_checkpointing(model, mode)
    return model


def first_conv(module):
    return next(m for m in module.modules() if isinstance(m, nn.Conv2d))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("size", [(64, 96), (70, 100)])
def test_logits_come_back_at_the_input_size(arch, size):
    """Catches a wrapper that forgets FPN's 1/4-resolution head or crops odd sizes wrongly."""
    model = build_model(small_config(arch)).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 3, *size, dtype=torch.uint8)).shape == (2, 4, *size)


def counted_builds(monkeypatch) -> list[str]:
    """The default device of each `build_model` call that `loaded_model` makes, in order."""
    builds = []
    monkeypatch.setattr(model_module, "build_model", lambda *args, **kw: builds.append(
        torch.empty(0).device.type) or build_model(*args, **kw))
    return builds


@pytest.mark.parametrize("arch, options", [("unet", {}), ("unetplusplus", {"cls_head": True}), ("fpn", {"norm": "group"})])
def test_a_model_loaded_from_weights_is_built_on_meta_and_equals_one_built_then_loaded(arch, options, monkeypatch):
    """CPU. Would catch: a tensor left on the meta device (CloudNet's unsaved mean and std were,
    and every load then fell back to the slow build), weights copied where they are meant to be
    assigned (the random initialisation no longer skipped: two builds), or a model whose logits
    differ from `build_model` then `load_state_dict`."""
    torch.manual_seed(0)
    weights = build_model(small_config(arch, **options)).state_dict()
    reference = build_model(small_config(arch, **options)).eval()
    reference.load_state_dict(weights)
    builds = counted_builds(monkeypatch)
    model = loaded_model(small_config(arch, **options), weights, "best.pt").eval()
    assert builds == ["meta"]  # one build, on the meta device
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors.keys() == (dict(reference.named_parameters()) | dict(reference.named_buffers())).keys()
    assert all(tensor.device.type == "cpu" for tensor in tensors.values())
    assert all(parameter.requires_grad for parameter in model.parameters())
    images = torch.randint(0, 256, (1, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.equal(model(images), reference(images))


def test_an_encoder_that_cannot_be_built_on_meta_is_built_as_usual(monkeypatch):
    """CPU. Would catch: no fallback where the meta build itself fails (smp's mit_b* calls .item()
    on a tensor while it is built): predict and segment could not load such a checkpoint."""
    config = ModelConfig(encoder="mit_b0", encoder_weights=None, decoder_channels=(16, 8, 8, 8, 8))
    torch.manual_seed(0)
    reference = build_model(config).eval()
    builds = counted_builds(monkeypatch)
    model = loaded_model(config, reference.state_dict(), "best.pt").eval()
    assert builds == ["meta", "cpu"]  # the meta build failed: the usual one followed
    images = torch.randint(0, 256, (1, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.equal(model(images), reference(images))


def test_weights_of_another_dtype_are_cast_to_the_model_s_as_load_state_dict_does():
    """CPU. Would catch: bfloat16 weights assigned as they are, so that the model would run in
    bfloat16 where a checkpoint loaded into `build_model` runs in float32."""
    torch.manual_seed(0)
    weights = {key: value.to(torch.bfloat16) if value.is_floating_point() else value
               for key, value in build_model(small_config("unet")).state_dict().items()}
    model = loaded_model(small_config("unet"), weights, "best.pt")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert all(torch.equal(tensor, weights[key].float()) for key, tensor in model.state_dict().items()
               if tensor.is_floating_point())


def test_weights_that_do_not_fit_are_refused_by_the_meta_build_too():
    """CPU. Would catch: the meta build's load not strict (missing keys left on the meta device)."""
    weights = build_model(small_config("unet")).state_dict()
    del weights[next(iter(weights))]
    with pytest.raises(RuntimeError, match="Missing key"):
        loaded_model(small_config("unet"), weights, "best.pt")


def test_unet_checkpoints_from_before_model_arch_still_load():
    """A state dict of the wrapper around smp.Unet, as build_model made it before model.arch,
    loads strictly into today's default model and gives the same logits. Catches a renamed
    `unet.` prefix, a different default architecture or default decoder widths."""
    torch.manual_seed(0)
    old = CloudNet(smp.Unet(encoder_name="resnet18", encoder_weights=None, decoder_channels=(256, 128, 64, 32, 16),
                            encoder_depth=5, classes=4)).eval()
    new = build_model(ModelConfig(encoder="resnet18", encoder_weights=None)).eval()
    new.load_state_dict(old.state_dict())
    images = torch.randint(0, 256, (1, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.equal(old(images), new(images))


@pytest.mark.parametrize("arch, widths, head_width", [("unet", (32, 16, 24), 24), ("unetplusplus", (32, 16, 24), 24),
                                                      ("fpn", (48, 64), 64)])
def test_decoder_channels_set_the_decoder_widths(arch, widths, head_width):
    """The last width feeds the segmentation head; for FPN [pyramid, segmentation] (catches a
    swapped FPN mapping, or decoder_channels ignored in favour of smp's defaults)."""
    net = build_model(ModelConfig(arch=arch, encoder="mobilenet_v2", encoder_weights=None,
                                  decoder_channels=widths)).unet
    assert net.segmentation_head[0].in_channels == head_width
    if arch == "fpn":
        assert net.decoder.p5.out_channels == widths[0]
    else:  # three widths: three decoder stages on a three-stage encoder
        assert len(net.encoder.out_channels) == 4


@pytest.mark.parametrize("widths", [[128, 64, 32, 16, 8], [256, 48], [256]])
def test_unet_widths_are_refused_for_fpn(widths):
    """A UNet's five widths, or an FPN segmentation width GroupNorm(32) cannot split, are a
    one-line config error naming the key, not reinterpreted or ignored."""
    with pytest.raises(ValueError, match=r"model: model\.decoder_channels=.* does not fit model\.arch=fpn"):
        load_config("configs/demo.yaml", ["model.arch=fpn", f"model.decoder_channels={widths}"])


def test_empty_decoder_channels_are_refused():
    """Catches [] silently falling back to the default widths."""
    with pytest.raises(ValueError, match="one or more positive widths"):
        ModelConfig(decoder_channels=())


# ---------------------------------------------------------------- activation checkpointing


def decoder_blocks_of(net, arch):
    """The decoder blocks `full` must wrap, named independently of the generic discovery."""
    return {"unet": lambda: list(net.decoder.blocks), "unetplusplus": lambda: list(net.decoder.blocks.values()),
            "fpn": lambda: list(net.decoder.seg_blocks)}[arch]()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_checkpointing_wraps_and_recomputes_every_decoder_block(arch):
    """Each decoder block runs twice with gradients (forward, then recomputed in backward) and
    once without. Catches block discovery that misses UNet++'s ModuleDict or FPN's blocks."""
    model = float64_model(arch, "full")
    blocks = decoder_blocks_of(model.unet, arch)
    found = checkpoint_blocks(model, "full")
    assert all(any(block is f for f in found) for block in blocks)
    calls = {id(block): [] for block in blocks}
    for block in blocks:
        first_conv(block).register_forward_hook(lambda *a, key=id(block): calls[key].append(1))
    loss_grads_and_stats(model)
    assert [len(c) for c in calls.values()] == [2] * len(blocks)
    for c in calls.values():
        c.clear()
    with torch.no_grad():
        model(torch.zeros(1, 3, 64, 96, dtype=torch.uint8))
    assert [len(c) for c in calls.values()] == [1] * len(blocks)  # nothing to recompute without gradients


@pytest.mark.parametrize("arch", [arch if arch == "unet" else pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in ARCHS])  # float64 UNet++ and FPN: the heavy part of this file
def test_full_checkpointing_gives_the_same_loss_gradients_and_norm_statistics(arch):
    """float64, so any difference is a bug: a recomputation that sees other inputs or another
    dropout mask changes gradients; BatchNorm updated twice changes the running statistics."""
    reference = loss_grads_and_stats(float64_model(arch, "none"))
    checkpointed = loss_grads_and_stats(float64_model(arch, "full"))
    assert torch.equal(reference[0], checkpointed[0])
    assert reference[1].keys() == checkpointed[1].keys()
    for name, grad in reference[1].items():
        assert torch.allclose(grad, checkpointed[1][name], rtol=0, atol=1e-12), name
    assert reference[2].keys() == checkpointed[2].keys() and reference[2]
    for name, value in reference[2].items():
        assert torch.equal(value, checkpointed[2][name]), name


# ---------------------------------------------------------------- norm switches


def forward_backward(model):
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    model(images).square().mean().backward()


@pytest.mark.parametrize("arch", ARCHS)
def test_group_norm_trains_every_arch(arch):
    """Catches a BatchNorm left in some architecture's decoder or head, or a parameter cut off from the loss."""
    model = build_model(small_config(arch, norm="group")).train()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    forward_backward(model)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_frozen_norm_keeps_the_encoder_statistics_of_every_arch(arch):
    """The encoder's BatchNorm statistics stay put; the decoder's (where it has BatchNorm:
    FPN's decoder uses GroupNorm) still adapt. Catches freezing that misses or overreaches."""
    model = build_model(small_config(arch, norm="frozen"))
    encoder_bn = [m for m in model.unet.encoder.modules() if isinstance(m, nn.BatchNorm2d)]
    decoder_bn = [m for m in model.unet.decoder.modules() if isinstance(m, nn.BatchNorm2d)]
    before = [m.running_mean.clone() for m in encoder_bn + decoder_bn]
    train_mode(model, "frozen")
    forward_backward(model)
    after = [m.running_mean for m in encoder_bn + decoder_bn]
    assert all(torch.equal(a, b) for a, b in zip(before[:len(encoder_bn)], after))
    assert all(not torch.equal(a, b) for a, b in zip(before[len(encoder_bn):], after[len(encoder_bn):]))
    assert (len(decoder_bn) > 0) == (arch != "fpn")


# ---------------------------------------------------------------- memory estimate


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointing_lowers_the_estimate_for_every_arch(arch):
    """full < encoder < none: catches an arch whose decoder blocks checkpointing does not find
    (then full == encoder)."""
    widths = "[128,64]" if arch == "fpn" else "[128,64,32,16,8]"
    config = load_config("configs/demo.yaml", [f"model.arch={arch}", f"model.decoder_channels={widths}"])
    steps = estimate(config, (128, 192))
    assert steps["full"].activations_per_image < steps["encoder"].activations_per_image \
        < steps["none"].activations_per_image


def test_memory_command_names_the_arch(capsys):
    assert main(["memory", "-c", "configs/demo.yaml", "model.arch=fpn", "model.decoder_channels=[128,64]",
                 "data.image_size=[128,192]", "train.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fpn-mobilenet_v2 at 128x192")  # not the old fixed "UNet-"
    for mode in ("none", "encoder", "full"):
        assert sum(line.startswith(mode) for line in out.splitlines()) == 2  # breakdown and fits


def test_memory_command_plans_the_micro_batch_training_plans_and_refuses_none(capsys):
    """micro_batch auto with an effective batch of 6: the breakdown at 3, the largest divisor up to
    4 (what training plans for); --micro-batch -2 refused by argparse. Would catch the report's
    fixed 4 (no divisor of 6) and a table printed at micro-batch -2."""
    base = ["memory", "-c", "configs/demo.yaml", "model.arch=fpn", "model.decoder_channels=[128,64]",
            "data.image_size=[128,192]", "train.device=cpu"]
    assert main([*base, "train.micro_batch=auto", "train.effective_batch=6"]) == 0
    assert "breakdown at micro-batch 3 (GiB)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*base, "--micro-batch", "-2"])
    assert "--micro-batch: must be at least 1, got -2" in capsys.readouterr().err
