"""Model FLOPs utilization (MFU): the share of the GPU's datasheet peak that the accumulated
step of the data path turns into useful arithmetic (model → loss → backward).

MFU = images/s × FLOPs per image / (peak FLOP/s × GPUs). FLOPs are the model's own (forward
and backward, a multiply-add counted as 2), counted by PyTorch's FlopCounterMode on meta
tensors: activation checkpointing's recomputation does not count, as MFU defines it. The peak
is the datasheet's dense (no sparsity) 16-bit figure: bf16 and fp16 are equal on every GPU
below that has both, so one MFU serves either precision (fp32 training is measured against it
too). A GPU the table does not know gets no MFU (NaN), never a guess.
"""

from __future__ import annotations

import math
import re

import torch
from torch.utils.flop_counter import FlopCounterMode

from cloudseg.config import ModelConfig
from cloudseg.data import padded_shape
from cloudseg.loss import per_image_loss
from cloudseg.model import build_model
from cloudseg.task import LABELS

# Datasheet dense bf16/fp16 tensor-core TFLOP/s (NVIDIA's figures "with sparsity" halved),
# matched against torch.cuda.get_device_name in this order. V100 and T4 have no bf16: their fp16
# tensor figure; P100 has no tensor cores: its fp16 figure.
PEAK_TFLOPS = (
    (r"H100.*PCIe", 756.5), (r"H100.*NVL|H200.*NVL", 835.5), (r"H100|H200", 989.5), (r"A100", 312.0),
    (r"A30\b", 165.0), (r"L40S", 362.05), (r"L40\b", 181.05), (r"L4\b", 121.0), (r"A10\b", 125.0),
    (r"V100S", 130.0), (r"V100.*PCIE", 112.0), (r"V100", 125.0), (r"T4\b", 65.0),
    (r"P100.*PCIE", 18.7), (r"P100", 21.2),
)


def peak_flops(name: str) -> float | None:
    """Datasheet dense 16-bit FLOP/s of the GPU called `name`; None for one the table lacks."""
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, name):
            return tflops * 1e12
    return None


def step_flops_per_image(config: ModelConfig, image_size) -> float:
    """FLOPs of one image's forward and backward through the model of `config`, padded as
    training pads `image_size`: meta tensors, so no memory and about a second at 1400×2100."""
    with torch.device("meta"):
        model = build_model(config, pretrained=False).train()
        images = torch.zeros(1, 3, *padded_shape(tuple(image_size)), dtype=torch.uint8)
        masks = torch.zeros(1, len(LABELS), *images.shape[-2:], dtype=torch.uint8)
    with FlopCounterMode(display=False) as counter:
        per_image_loss(model(images), masks).sum().backward()
    return float(counter.get_total_flops())


def peak_seconds_per_image(config: ModelConfig, image_size, device: torch.device, world: int = 1) -> float:
    """The seconds one training image would take at the datasheet peak of `world` GPUs like
    `device`: images/s × this = MFU. NaN on a CPU or an unknown GPU."""
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peak is None:
        return math.nan
    return step_flops_per_image(config, image_size) / (peak * world)
