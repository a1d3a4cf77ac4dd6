"""metrics.csv's memory columns: each epoch's own peaks, allocated and reserved (docs/run-directory.md)."""

import math
import shutil

import pandas as pd
import torch

from cloudseg import train as train_module
from cloudseg.config import load_config
from cloudseg.train import peak_memory_mb, reset_peak_memory, train
from tests.conftest import TINY
from tests.fake_cuda import H100

GPU0 = torch.device("cuda", 0)
GiB = 2**30


def test_the_peaks_are_the_allocator_s_allocated_and_reserved_since_the_reset(fake_cuda):
    """On a GPU: the probes' peaks are gone after the reset, and the two columns read the two
    statistics. Would catch: no reset, the reserved column reading allocated memory (or the
    reverse), and bytes not turned into MiB. Device: fake CUDA (tests/fake_cuda.py)."""
    cuda = fake_cuda(H100)
    card = cuda.cards[0]
    card.peak, card.peak_reserved = 9 * GiB, 10 * GiB  # what the probes of checkpointing: auto left
    reset_peak_memory(GPU0)
    assert ("reset_peak_memory_stats", 0) in cuda.calls
    card.peak, card.peak_reserved = max(card.peak, 1 * GiB), max(card.peak_reserved, 3 * GiB)  # this epoch's
    assert peak_memory_mb(GPU0) == {"peak_allocated_mb": 1024, "peak_reserved_mb": 3072}


def test_on_the_cpu_only_the_resident_peak_is_reported():
    """Would catch: a CPU row that claims an allocator peak it does not have. Device: CPU."""
    peaks = peak_memory_mb(torch.device("cpu"))
    assert math.isnan(peaks["peak_allocated_mb"]) and peaks["peak_reserved_mb"] > 0
    reset_peak_memory(torch.device("cpu"))  # nothing to reset, and no CUDA call


def test_each_epoch_s_peaks_start_after_the_probes_and_at_that_epoch_s_start(tiny_data, tmp_path, monkeypatch):
    """The order of events in a two-epoch run: the probes (training_model), then per epoch a reset
    before its first step and the reading for its row after it. Would catch: the running maximum
    since the start (no reset, or one before the probes only), a reset after the first step,
    and a row read before the epoch's windows. Device: CPU, with the peak functions recorded."""
    events = []

    def recorded(name, function=None):
        def wrapper(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs) if function else {"peak_allocated_mb": 1.0, "peak_reserved_mb": 2.0}
        return wrapper

    monkeypatch.setattr(train_module, "training_model", recorded("probes", train_module.training_model))
    monkeypatch.setattr(train_module, "reset_peak_memory", recorded("reset", lambda device: None))
    monkeypatch.setattr(train_module, "resilient_step", recorded("step", train_module.resilient_step))
    monkeypatch.setattr(train_module, "peak_memory_mb", recorded("read"))
    data = shutil.copytree(tiny_data, tmp_path / "data")
    train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY]), tmp_path / "run")
    merged = [event for i, event in enumerate(events) if i == 0 or event != events[i - 1]]
    assert merged == ["probes", "reset", "step", "read", "reset", "step", "read"]
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert metrics["peak_allocated_mb"].tolist() == [1.0, 1.0] and metrics["peak_reserved_mb"].tolist() == [2.0, 2.0]
    assert "peak_memory_mb" not in metrics
