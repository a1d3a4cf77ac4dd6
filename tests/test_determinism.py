"""train.deterministic on a GPU, checked on the CPU: which operations of each architecture's graph
have no deterministic CUDA backward (hardware.NO_DETERMINISTIC_CUDA_BACKWARD), and the refusal
before any step. The graphs are built on fake CUDA tensors (no GPU needed); tests/test_gpu.py runs
a deterministic step of each architecture on a real one."""

import re
import signal
import typing

import pytest
import torch
from torch import nn

from cloudseg import hardware
from cloudseg import train as train_module
from cloudseg.config import ModelConfig, load_config
from cloudseg.hardware import NO_DETERMINISTIC_CUDA_BACKWARD, nondeterministic_cuda_backward, require_deterministic_kernels
from cloudseg.model import CloudNet, build_model
from cloudseg.task import LABELS
from tests.conftest import TINY, TINY_SHAPE, signal_during
from tests.fake_cuda import H100

GPU0 = torch.device("cuda", 0)
ARCHS = typing.get_args(ModelConfig.model_fields["arch"].annotation)  # every model.arch the config accepts
TINY_DECODERS = {"fpn": "[32,32]"}  # [pyramid, segmentation]; the UNets take five stages


def tiny_model(arch: str, encoder: str = "mobilenet_v2", head: bool = False) -> CloudNet:
    config = load_config("configs/demo.yaml", [*TINY, f"model.arch={arch}", f"model.encoder={encoder}",
                                               f"model.decoder_channels={TINY_DECODERS.get(arch, '[16,8,8,8,8]')}",
                                               f"model.cls_head={str(head).lower()}"])
    return build_model(config.model, pretrained=False)


@pytest.mark.parametrize("head", [False, True], ids=["no head", "head"])  # model.cls_head: on in both configs
@pytest.mark.parametrize("encoder", ["mobilenet_v2", "resnet34"])  # the demo's and configs/fullres.yaml's
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_has_a_deterministic_cuda_backward(arch, encoder, head):
    """The autograd graph of each model.arch, as a CUDA run under train.deterministic builds it,
    holds no operation that PyTorch's docs list as raising in deterministic mode on CUDA. Would
    catch: a new architecture (or an smp or torch upgrade) with such an operation, which would
    crash at the first backward of a deterministic GPU run; the arch list is the config's own,
    so a new arch is walked without editing this test. Device: fake CUDA tensors on the CPU."""
    model = tiny_model(arch, encoder, head).eval()
    assert model.has_head == head
    assert nondeterministic_cuda_backward(model, TINY_SHAPE) == []
    assert not model.training and not torch.are_deterministic_algorithms_enabled()  # left as it was
    assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())


def test_the_walk_finds_fpn_s_bilinear_upsampling_where_interpolate_takes_no_deterministic_route():
    """FPN upsamples bilinearly (its segmentation blocks and head). On CPU tensors F.interpolate
    keeps the native kernel, whose CUDA backward has no deterministic version; on CUDA tensors
    under deterministic mode it routes to a decomposition. Would catch: a walk that misses nodes
    (only the output's own node, one branch of the graph), the graph built on the CPU (it would
    refuse the FPN, which runs on a GPU), or a misspelt node name. Device: CPU and fake CUDA."""
    model = tiny_model("fpn")
    assert nondeterministic_cuda_backward(model, TINY_SHAPE, device="cpu") == [
        "torch.nn.functional.interpolate (bilinear)"]
    assert nondeterministic_cuda_backward(model, TINY_SHAPE) == []


def test_the_walk_covers_the_classification_head():
    """The head is a second output: its graph must be walked too. A head planted with a listed
    operation (adaptive pooling to 2×2, whose CUDA backward has no deterministic kernel) must be
    found. Would catch: a walk from the mask output alone (smp's own head pools to 1×1, which
    PyTorch computes as a mean, so only a planted head shows it). Device: fake CUDA tensors."""
    model = tiny_model("unet", head=True)
    channels = [m for m in model.unet.classification_head.modules() if isinstance(m, nn.Linear)][0].in_features
    model.unet.classification_head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                                   nn.Linear(4 * channels, len(LABELS)))
    assert nondeterministic_cuda_backward(model, TINY_SHAPE) == ["torch.nn.AdaptiveAvgPool2d"]


# One op per listed autograd node, on a small CPU tensor that requires grad.
EXAMPLES = {
    "AvgPool3DBackward0": lambda x: nn.AvgPool3d(1)(x[None]),
    "AdaptiveAvgPool2DBackward0": lambda x: nn.AdaptiveAvgPool2d(2)(x),
    "AdaptiveAvgPool3DBackward0": lambda x: nn.AdaptiveAvgPool3d(2)(x[None]),
    "AdaptiveMaxPool2DBackward0": lambda x: nn.AdaptiveMaxPool2d(2)(x),
    "FractionalMaxPool2DBackward0": lambda x: nn.FractionalMaxPool2d(2, output_size=3)(x),
    "FractionalMaxPool3DBackward0": lambda x: nn.FractionalMaxPool3d(2, output_size=2)(x.reshape(1, 2, 4, 4, 4)),
    "MaxUnpool2DBackward0": lambda x: nn.MaxUnpool2d(2)(*nn.MaxPool2d(2, return_indices=True)(x)),
    "MaxUnpool3DBackward0": lambda x: nn.MaxUnpool3d(2)(*nn.MaxPool3d(2, return_indices=True)(x[None])),
    "UpsampleLinear1DBackward0": lambda x: nn.functional.interpolate(x[0], scale_factor=2, mode="linear"),
    "UpsampleBilinear2DBackward0": lambda x: nn.functional.interpolate(x, scale_factor=2, mode="bilinear"),
    "UpsampleBilinear2DAaBackward0": lambda x: nn.functional.interpolate(x, scale_factor=2, mode="bilinear",
                                                                         antialias=True),
    "UpsampleBicubic2DBackward0": lambda x: nn.functional.interpolate(x, scale_factor=2, mode="bicubic"),
    "UpsampleBicubic2DAaBackward0": lambda x: nn.functional.interpolate(x, scale_factor=2, mode="bicubic",
                                                                        antialias=True),
    "UpsampleTrilinear3DBackward0": lambda x: nn.functional.interpolate(x[None], scale_factor=2, mode="trilinear"),
    "ReflectionPad1DBackward0": lambda x: nn.ReflectionPad1d(1)(x[0]),
    "ReflectionPad2DBackward0": lambda x: nn.ReflectionPad2d(1)(x),
    "ReflectionPad3DBackward0": lambda x: nn.ReflectionPad3d(1)(x[None]),
    "CtcLossBackward0": lambda x: nn.CTCLoss(reduction="none")(
        x[0, :, :, :3].reshape(8, 2, 3).log_softmax(2), torch.ones(2, 2, dtype=torch.long), [8] * 2, [2] * 2),
    "GridSampler2DBackward0": lambda x: nn.functional.grid_sample(x, torch.zeros(1, 2, 2, 2), align_corners=False),
    "GridSampler3DBackward0": lambda x: nn.functional.grid_sample(x[None], torch.zeros(1, 1, 2, 2, 3),
                                                                  align_corners=False),
}


def throwing_section() -> str:
    """PyTorch's own list, in the docstring of the installed torch.use_deterministic_algorithms."""
    doc = torch.use_deterministic_algorithms.__doc__
    return doc[doc.index("will throw a"):doc.index("In addition")]


@pytest.mark.parametrize("node", NO_DETERMINISTIC_CUDA_BACKWARD)
def test_each_listed_node_is_the_one_autograd_records_and_pytorch_lists_its_operation(node):
    """Each key is the class name autograd gives that operation's node, and each operation is in
    the installed PyTorch's own list of what raises in deterministic mode (its mode too, for
    interpolate). Would catch: a misspelt or renamed node (it would never match, and the check
    would pass everything), and an operation on our list that PyTorch does not list. Device: CPU."""
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    assert type(EXAMPLES[node](x).grad_fn).__name__ == node
    operation = NO_DETERMINISTIC_CUDA_BACKWARD[node]
    name, mode = re.fullmatch(r"(\S+)(?: \((\w+).*\))?", operation).groups()
    assert name.removeprefix("torch.") in throwing_section()
    if mode:
        assert f"``{mode}``" in throwing_section()


class PaddedNet(nn.Module):
    """A network with reflection padding after a convolution (so its backward runs)."""

    def __init__(self):
        super().__init__()
        self.conv, self.pad, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.ReflectionPad2d(1), nn.Conv2d(4, 4, 3)

    def forward(self, x):
        return self.out(self.pad(self.conv(x)))


def test_require_deterministic_kernels_names_the_operation_and_what_works_instead():
    """Would catch: a refusal that does not name the operation or the way out, one raised on the
    CPU (where every backward is deterministic) or without train.deterministic, and none at all.
    Device: the fake CUDA tensors of the walk; GPU 0 is only named."""
    model = CloudNet(PaddedNet())
    with pytest.raises(ValueError, match=r"train.deterministic=true: the backward of torch.nn.ReflectionPad2d in "
                                         r"this model has no deterministic CUDA kernel.*train.deterministic=false"):
        require_deterministic_kernels(model, (32, 32), GPU0, deterministic=True)
    require_deterministic_kernels(model, (32, 32), torch.device("cpu"), deterministic=True)
    require_deterministic_kernels(model, (32, 32), GPU0, deterministic=False)


def test_training_refuses_before_the_model_reaches_the_gpu(fake_cuda, monkeypatch, tiny_data):
    """train.start builds the model in training_model, whose probes run backwards on the GPU:
    the refusal must come before them and before the model moves there. With nearest
    upsampling (the UNet's) put on the list, as a torch without its deterministic kernel would
    be, training_model on a fake H100 refuses with the message; the fake GPU holds no tensor, so
    a check after the move or the probes would meet a RuntimeError first. Would catch: no check
    in training, or one after the probes. Device: fake CUDA (tests/fake_cuda.py)."""
    fake_cuda(H100)
    monkeypatch.setitem(hardware.NO_DETERMINISTIC_CUDA_BACKWARD, "UpsampleNearest2DBackward0",
                        "torch.nn.functional.interpolate (nearest)")
    config = load_config("configs/demo.yaml", [f"data.dir={tiny_data}", *TINY, "train.device=cuda",
                                               "train.deterministic=true"])
    with pytest.raises(ValueError, match=r"interpolate \(nearest\)"):
        train_module.training_model(config, TINY_SHAPE, GPU0)


def test_the_check_s_forward_on_fake_tensors_is_not_a_training_forward_for_signal_during():
    """tests' signal_during counts training forwards to stop a run mid-window; the check above
    runs the model once on fake tensors before any step. Would catch: that forward counted (on a
    GPU the deterministic resume test then stopped a window early, so until issue 30)."""
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        model = signal_during(tiny_model("unet"), 1, signal.SIGUSR1)
        nondeterministic_cuda_backward(model, TINY_SHAPE)
        assert received == []
        model(torch.zeros(1, 3, *TINY_SHAPE, dtype=torch.uint8))
        assert received == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
