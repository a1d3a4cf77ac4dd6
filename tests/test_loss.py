"""The training loss pinned to hand-computed values."""

import math

import pytest
import torch

from cloudseg.loss import per_image_loss


def test_bce_plus_weighted_soft_dice_by_hand():
    """One image, one class, two pixels: logits [0, ln 3] (probabilities 1/2 and 3/4), truth [1, 0].

    BCE  = (-ln 1/2 - ln 1/4) / 2 = 1.5 ln 2
    Dice = 1 - (2 × 1/2 + 1) / ((1/2 + 3/4 + 1) + 1) = 1 - 2 / 3.25   (smoothing 1)
    loss = BCE + 2 × Dice with dice_weight 2.
    Would catch: a missing or different smoothing, Dice weighted by anything but dice_weight,
    BCE summed instead of averaged over pixels, and probabilities taken without the sigmoid."""
    logits = torch.tensor([[[[0.0, math.log(3)]]]], dtype=torch.float64)
    masks = torch.tensor([[[[1, 0]]]], dtype=torch.uint8)
    expected = 1.5 * math.log(2) + 2 * (1 - 2 / 3.25)
    # rel 1e-7: the masks enter as float32, so the BCE term is not exact to float64
    assert per_image_loss(logits, masks, dice_weight=2.0).item() == pytest.approx(expected, rel=1e-7)


def test_soft_dice_is_averaged_over_classes_and_kept_per_image():
    """Two images, two classes; the second class of image 0 is empty in truth and prediction
    alike (logit -∞ would give Dice 0 loss; a finite -20 gives ~0). Would catch: Dice pooled
    over the batch (smp's DiceLoss) or over classes, instead of per image and per class."""
    logits = torch.full((2, 2, 1, 2), -20.0, dtype=torch.float64)
    logits[0, 0] = torch.tensor([[20.0, 20.0]])  # class 0 of image 0: predicted everywhere, true everywhere
    masks = torch.zeros((2, 2, 1, 2), dtype=torch.uint8)
    masks[0, 0] = 1
    masks[1, 1] = 1  # class 1 of image 1: true everywhere, predicted nowhere
    loss = per_image_loss(logits, masks, dice_weight=1.0)
    # image 0: both classes right: Dice losses ~0 and ~0 (empty: (0 + 1) / (0 + 1)); BCE ~0
    # image 1: class 1 all missed: Dice loss 1 - 1/3 (smoothing), class 0 empty: 0; mean 1/3; BCE 20/2 per pixel avg
    bce_image1 = (20.0 * 2) / 4  # two of four pixels cost ~20 each
    assert loss[0].item() == pytest.approx(0.0, abs=1e-7)
    assert loss[1].item() == pytest.approx(bce_image1 + (1 - 1 / 3) / 2, rel=1e-6)
