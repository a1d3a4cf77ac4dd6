"""Where the model runs and in which precision: every such decision is made here, once.

Training, validation, out-of-fold and test prediction and `cloudseg memory` all ask these
functions, so a precision name means the same autocast dtype everywhere.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA GPU is visible; use train.device=auto or cpu")
    return torch.device(name)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.precision` (None = plain fp32); auto = bf16 on CUDA when supported."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed-precision context for `dtype` (a no-op for None)."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
