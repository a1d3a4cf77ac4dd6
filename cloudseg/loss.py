"""The training loss, per image so that it adds up across micro-batches.

Data path: train.csv → Dataset → loader → model → **loss** → accumulated step → checkpoint →
probabilities at 350×525 → post-process → submission.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_image_loss(logits: torch.Tensor, masks: torch.Tensor, dice_weight: float = 1.0,
                   class_logits: torch.Tensor | None = None, cls_weight: float = 0.0) -> torch.Tensor:
    """BCE + soft Dice loss for each image (shape N), so that losses add up across micro-batches;
    with `class_logits` (N×4, a classification head's) plus `cls_weight` × their BCE on whether
    each class has a mask, also per image, so the head's loss accumulates exactly like the rest.

    The soft Dice is per image and per class, then averaged: smp's DiceLoss pools the batch,
    and a mean of micro-batch pooled Dice losses is not the pooled Dice of the window.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: the loss in fp32
    # 0/1 targets are exact in any dtype; a float32 target beside float64 logits would compute part of the
    # loss in float32 (1.6e-8 off), and eager and compiled float64 steps 1e-10 apart under torch 2.11
    target = masks.to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none").mean((1, 2, 3))
    probs = logits.sigmoid()
    overlap, total = (probs * target).sum((2, 3)), (probs + target).sum((2, 3))
    soft_dice = 1 - (2 * overlap + 1) / (total + 1)
    loss = bce + dice_weight * soft_dice.mean(1)
    if class_logits is None:
        return loss
    present = target.amax((2, 3))
    class_logits = class_logits.to(torch.promote_types(class_logits.dtype, torch.float32))
    return loss + cls_weight * F.binary_cross_entropy_with_logits(class_logits, present, reduction="none").mean(1)
