"""The batched RLE decode of data.decode=gpu (`rle.runs`, `rle.concat_runs`, `rle.decode_runs`)
against `rle.decode`, on the CPU: the same torch code runs on a GPU."""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from cloudseg import rle
from cloudseg.task import LABELS
from tests.host_syncs import HostSyncs


def special_masks(shape):
    """Masks whose runs touch every edge case: empty, full, the first and the last pixel,
    one-pixel runs, runs across a column boundary and whole columns."""
    height, width = shape
    masks = np.zeros((6, height, width), np.uint8)
    masks[1] = 1
    masks[2, 0, 0] = masks[2, -1, -1] = 1
    masks[3, ::2, ::3] = 1  # one-pixel runs
    masks[4, -1, 0] = masks[4, 0, 1] = 1  # one run from the bottom of a column to the top of the next
    masks[5, :, 0] = masks[5, :, -1] = 1
    return masks


@pytest.mark.parametrize("seed", range(4))
def test_batched_decode_of_runs_equals_rle_decode(seed):
    """Would catch: rows and columns swapped (the RLE is column-major), an off-by-one at a run's
    start or end, runs of one mask spilling into the next (wrong offsets), adjacent runs (one
    ending where the next starts, also across two masks) losing a pixel, or the uint8 count
    not wrapping back to 0."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(side) for side in rng.integers(1, 30, 2))
    random = (rng.random((10, *shape)) < rng.uniform(0.05, 0.95, (10, 1, 1))).astype(np.uint8)
    masks = np.concatenate([special_masks(shape), random])  # 16 masks: 4 items of 4 labels
    encoded = [rle.encode(mask) for mask in masks]
    runs = [torch.from_numpy(rle.runs(text, shape)) for text in encoded]
    decoded = rle.decode_runs(rle.concat_runs(runs, masks[0].size), (4, len(LABELS), *shape))
    assert decoded.dtype == torch.uint8 and decoded.is_contiguous()
    np.testing.assert_array_equal(decoded.reshape(masks.shape).numpy(), [rle.decode(text, shape) for text in encoded])


def test_decoding_runs_on_a_gpu_waits_for_nothing():
    """decode_runs on fake CUDA tensors, each operation as this torch dispatches it, under
    HostSyncs: no host sync. Would catch: `edges[starts] = 1` on a torch that dispatches it as a
    copy of the 1 from the host (2.11 does: a wait for the queued backward once per micro-batch,
    so until issue 30), an `.item()` or a boolean mask's selection."""
    with FakeTensorMode(), HostSyncs() as syncs:
        runs = torch.zeros(2, 5, dtype=torch.int64, device="cuda")
        rle.decode_runs(runs, (2, len(LABELS), 4, 6))
    assert syncs.found == []


def test_the_test_can_fail_host_syncs_sees_each_kind_of_host_sync():
    """The control of the test above, on fake CUDA tensors: a host value written in place into a GPU
    tensor (what `t[index] = 1` is on torch 2.11), a read on the host, a copy each way, an output
    sized by the data, are each found; the same work kept on the GPU is not."""
    with FakeTensorMode(), HostSyncs() as syncs:
        edges, index = torch.zeros(10, dtype=torch.uint8, device="cuda"), torch.zeros(3, dtype=torch.int64, device="cuda")
        edges.index_put_((index,), torch.ones((), dtype=torch.uint8))  # the value on the host
        edges.index_fill_(0, index, 1)
        edges.cumsum(0)
        edges.cpu()
        torch.zeros(3).to("cuda")
        with pytest.raises(DynamicOutputShapeException):  # a fake tensor has no data to size the output by
            edges.nonzero()
        with pytest.raises(DataDependentOutputException):  # nor a value to read
            edges.sum().item()
    assert [why for _, why in syncs.found] == ["a copy between cpu/cuda and cuda", "a copy between cuda and cpu",
                                               "a copy between cpu and cuda", "an output sized by the GPU's data",
                                               "a GPU value read on the host"]
