"""Memory savers must not change the maths: checkpointing, channels_last, uint8 on the device."""

import pytest
import torch

from cloudseg.config import ModelConfig
from cloudseg.model import IMAGENET_MEAN, IMAGENET_STD, build_model, set_checkpointing, prepare_for_training
from cloudseg.loss import per_image_loss


def float64_model(encoder, mode, seed=0):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(encoder=encoder, encoder_weights=None, decoder_channels=(16, 8, 8, 8, 8)))
    model = model.double().train()
    set_checkpointing(model, mode)
    return model


def loss_grads_and_stats(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8, generator=g)
    masks = (torch.rand(2, 4, 64, 96, generator=g) < 0.3).to(torch.uint8)
    loss = per_image_loss(model(images), masks).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = {n: b.clone() for n, b in model.named_buffers() if "running" in n or "num_batches" in n}
    return loss.detach(), grads, stats


@pytest.mark.parametrize("encoder", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("mode", ["encoder", "full"])
def test_checkpointing_gives_the_same_loss_gradients_and_norm_statistics(encoder, mode):
    reference = loss_grads_and_stats(float64_model(encoder, "none"))
    checkpointed = loss_grads_and_stats(float64_model(encoder, mode))
    assert torch.equal(reference[0], checkpointed[0])
    for name, grad in reference[1].items():
        assert torch.allclose(grad, checkpointed[1][name], rtol=0, atol=1e-12), name
    assert reference[2].keys() == checkpointed[2].keys()
    for name, value in reference[2].items():  # running stats updated once, not twice
        assert torch.equal(value, checkpointed[2][name]), name


def test_checkpointing_really_recomputes():
    model = float64_model("resnet18", "full")
    calls = []
    model.unet.decoder.blocks[0].conv1.register_forward_hook(lambda *a: calls.append(1))
    loss_grads_and_stats(model)
    assert len(calls) == 2  # once in forward, once in backward
    calls.clear()
    with torch.no_grad():
        model(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))
    assert len(calls) == 1  # nothing to recompute without gradients


def forward_counts(model):
    """How often, in one training forward and backward, the stem's conv, a layer1 block's conv
    and the first decoder block's conv run."""
    calls = {"stem": 0, "layer1": 0, "decoder": 0}
    for name, module in [("stem", model.unet.encoder.conv1), ("layer1", model.unet.encoder.layer1[0].conv1),
                         ("decoder", model.unet.decoder.blocks[0].conv1)]:
        module.register_forward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
    loss_grads_and_stats(model)
    return calls


def test_encoder_mode_recomputes_the_whole_encoder_once_and_leaves_the_decoder_alone():
    """Would catch: the stem left out of the region (it ran once: its half-resolution activations
    kept), the decoder recomputed, or the encoder recomputed more than once."""
    assert forward_counts(float64_model("resnet18", "encoder")) == {"stem": 2, "layer1": 2, "decoder": 1}


def test_full_mode_nests_the_encoder_blocks_and_recomputes_the_decoder_blocks():
    """The encoder region is recomputed once (stem twice in all); inside it each block again in its
    own backward (three times). Would catch: the nested blocks dropped (two), or the decoder left out."""
    assert forward_counts(float64_model("resnet18", "full")) == {"stem": 2, "layer1": 3, "decoder": 2}


def test_switching_modes_replaces_the_wrappers_and_keeps_other_patches():
    """`train.checkpointing: auto` tries the modes on one model. Would catch: wrappers stacking up
    (full after encoder recomputing twice over), `none` leaving a wrapper behind, and undoing a
    forward that someone else patched (the tests' out-of-memory planter)."""
    model = float64_model("resnet18", "encoder")
    set_checkpointing(model, "full")
    assert forward_counts(model) == {"stem": 2, "layer1": 3, "decoder": 2}
    model = float64_model("resnet18", "full")
    own_forward = model.forward
    model.forward = lambda images: own_forward(images)  # a patch that is not a checkpoint wrapper
    set_checkpointing(model, "none")
    assert "forward" in vars(model)
    assert forward_counts(model) == {"stem": 1, "layer1": 1, "decoder": 1}


def test_channels_last_gives_the_same_output():
    torch.manual_seed(0)
    plain = build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(16, 8, 8, 8, 8))).eval()
    fast = build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(16, 8, 8, 8, 8))).eval()
    fast.load_state_dict(plain.state_dict())
    prepare_for_training(fast, channels_last=True, checkpointing="none")
    assert fast.unet.encoder.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.allclose(plain(images), fast(images), atol=1e-5)


def test_uint8_normalization_on_the_device_equals_cpu_normalization():
    """What the model does to uint8 input equals the usual float normalization done on the CPU."""
    model = build_model(ModelConfig(encoder="resnet18", encoder_weights=None)).eval()
    seen = []
    model.unet.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    with torch.no_grad():
        model(images)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (images.float() / 255 - mean) / std
    assert torch.allclose(seen[0], expected, atol=1e-5)
