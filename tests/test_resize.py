"""The resize contract holds even when there is nothing to resize."""

import numpy as np
import torch

from cloudseg.metrics import resize_masks, resize_probs


def test_already_at_the_target_size_the_output_still_has_the_contract_types():
    """Catches returning the input unchanged at the target size: a 0/255 or bool mask must come back
    as uint8 0/1, float64 probabilities as float32 (the bug before this test)."""
    mask = np.array([[0, 255], [3, 0]], np.uint8)
    for given in (mask, mask != 0):
        out = resize_masks(given, (2, 2))
        assert out.dtype == np.uint8 and out.tolist() == [[0, 1], [1, 0]]
    probs = np.array([[0.25, 1.0], [0.0, 0.5]])
    out = resize_probs(probs, (2, 2))
    assert out.dtype == np.float32 and out.tolist() == probs.tolist()
    tensor = resize_masks(torch.from_numpy(mask), (2, 2))
    assert tensor.dtype == torch.uint8 and tensor.tolist() == [[0, 1], [1, 0]]
    assert resize_probs(torch.from_numpy(probs), (2, 2)).dtype == torch.float32
