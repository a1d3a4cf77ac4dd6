"""MFU: FLOPs per image counted on meta tensors, the datasheet peak by GPU name, the metrics column."""

import math

import pandas as pd
import pytest
import torch
from torch import nn

from cloudseg import flops, train as train_module
from cloudseg.config import ModelConfig, load_config
from cloudseg.model import build_model
from cloudseg.train import train
from tests.conftest import TINY

SMALL_MODEL = ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(8, 8, 8))


def convolution_flops_by_hand(config: ModelConfig, image_size) -> float:
    """Each convolution's multiply-adds × 2, from its output size (forward hooks on a real CPU
    pass); backward costs two forwards (input and weight gradients), one for the first
    convolution, whose input (the image) needs no gradient."""
    model = build_model(config, pretrained=False).train()
    total = []

    def count(module, inputs, output):
        forward = 2 * output.numel() * module.in_channels // module.groups * math.prod(module.kernel_size)
        total.append(forward * (3 if inputs[0].requires_grad else 2))

    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_hook(count)
    model(torch.zeros(1, 3, *image_size, dtype=torch.uint8))
    return sum(total)


def test_step_flops_per_image_are_the_convolutions_forward_and_backward():
    """Would catch: forward only (a third), a multiply-add counted once, the batch dimension
    left in, or the unpadded size (50×90 pads to 64×96)."""
    assert flops.step_flops_per_image(SMALL_MODEL, (50, 90)) == convolution_flops_by_hand(SMALL_MODEL, (64, 96))


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.05), ("NVIDIA L4", 121.0),
    ("Tesla T4", 65.0), ("Tesla V100-PCIE-16GB", 112.0), ("NVIDIA GeForce RTX 4090", None), ("NVIDIA A10G", None),
])
def test_the_datasheet_peak_is_found_by_gpu_name(name, tflops):
    """Would catch: the first match taking a longer name's figure (H100 PCIe as SXM, A100 as
    A10, L40S as L4), and a guess for a GPU the table does not list."""
    assert flops.peak_flops(name) == (None if tflops is None else tflops * 1e12)


def test_peak_seconds_per_image_on_a_gpu_and_on_a_cpu(monkeypatch):
    """Would catch: a figure on a CPU, and two GPUs' peak not counted (the CUDA branch, faked by name)."""
    assert math.isnan(flops.peak_seconds_per_image(SMALL_MODEL, (64, 96), torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    expected = flops.step_flops_per_image(SMALL_MODEL, (64, 96)) / (2 * 989.5e12)
    assert flops.peak_seconds_per_image(SMALL_MODEL, (64, 96), torch.device("cuda", 0), world=2) == expected


def test_metrics_csv_has_the_mfu_of_each_epoch(data_copy, tmp_path, monkeypatch):
    """Would catch: an mfu column missing, or not images/s × one image's seconds at the peak
    (which is NaN on a CPU, above)."""
    monkeypatch.setattr(train_module, "peak_seconds_per_image", lambda *args: 0.25)
    train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.device=cpu"]), tmp_path / "run")
    metrics = pd.read_csv(tmp_path / "run/metrics.csv")
    assert metrics["mfu"].tolist() == pytest.approx((metrics["images_per_s"] * 0.25).tolist())
