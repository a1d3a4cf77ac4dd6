"""A fake CUDA for the tests that reach cloudseg's CUDA branches on a CPU: GPUs that torch.cuda
reports (name, compute capability, memory) and the allocator statistics cloudseg reads.

The fake is as strict as torch about its arguments, because a fake that accepts what torch
refuses tests nothing: each function takes its device argument through torch's own
`torch.cuda._utils._get_device_index` with the `optional` flag the real function uses (so a CPU
device is refused everywhere, and `torch.device("cuda")` without an index where torch requires
one), checks the index against the cards, and checks the other arguments as torch does. An index
past the cards raises what torch raises: AssertionError where torch.cuda checks it in Python
(get_device_properties and what reads it), RuntimeError where the C++ allocator or the CUDA
runtime does (the memory functions, synchronize). The fake behaves as after CUDA's
initialization: before it, torch's memory statistics read 0 without checking their argument.
`tests/test_gpu.py` compares the fake with the real torch.cuda on a GPU machine.

No tensor goes to a fake GPU: code under test keeps its tensors on the CPU (the memory planner
takes its allocator readings through `memory.peak_bytes`, which the tests replace).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.cuda._utils import _get_device_index

GiB = 2**30

# torch.cuda.get_arch_list() of PyTorch's CUDA 12.6 and CUDA 13 Linux builds
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@dataclass
class Card:
    name: str
    capability: tuple[int, int]
    total_memory: int
    free: int | None = None  # what mem_get_info reports free; None = all of it
    reserved: int = 0  # what this process's allocator holds
    fraction: float = 1.0  # set_per_process_memory_fraction's cap
    peak: int = 0  # max_memory_allocated since the last reset
    peak_reserved: int = 0  # max_memory_reserved since the last reset


GTX_1080_TI = Card("NVIDIA GeForce GTX 1080 Ti", (6, 1), 11264 * 2**20)
RTX_2080_TI = Card("NVIDIA GeForce RTX 2080 Ti", (7, 5), 11264 * 2**20)
A100 = Card("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB)
H100 = Card("NVIDIA H100 80GB HBM3", (9, 0), int(79.2 * GiB))


def cudnn_refuses_old_gpus():
    raise RuntimeError("cuDNN version 92600 is not compatible with devices with SM < 7.5. Please install ...")


@dataclass
class FakeCuda:
    """The cards torch.cuda reports (GPU 0 current) and a log of the calls that change state."""

    cards: list[Card]
    calls: list[tuple] = field(default_factory=list)

    def index(self, device, optional: bool, error: type[Exception] = AssertionError) -> int:
        """The card `device` names, by torch's rules (see the module docstring); past the cards,
        `error`: AssertionError as torch.cuda checks in Python, RuntimeError as its C++ side does."""
        index = _get_device_index(device, optional=optional)
        if not 0 <= index < len(self.cards):
            raise error(f"Invalid device id {index}")
        return index

    def card(self, device, optional: bool = True, error: type[Exception] = AssertionError) -> Card:
        return self.cards[self.index(device, optional, error)]

    def properties(self, device=None):
        card = self.card(device)
        return SimpleNamespace(name=card.name, major=card.capability[0], minor=card.capability[1],
                               total_memory=card.total_memory)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        card = self.card(torch.cuda.current_device() if device is None else device, error=RuntimeError)
        return (card.total_memory if card.free is None else card.free), card.total_memory

    def set_fraction(self, fraction, device=None) -> None:
        index = _get_device_index(torch.cuda.current_device() if device is None else device, optional=False)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        card = self.card(index, error=RuntimeError)  # the range is checked after the fraction, as torch does
        card.fraction = fraction
        self.calls.append(("set_per_process_memory_fraction", fraction, index))

    def get_fraction(self, device=None) -> float:
        return self.card(torch.cuda.current_device() if device is None else device, False, RuntimeError).fraction

    def reset_peak(self, device=None) -> None:
        card = self.card(device, error=RuntimeError)
        card.peak = card.peak_reserved = 0
        self.calls.append(("reset_peak_memory_stats", self.cards.index(card)))

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize", self.index(device, True, RuntimeError)))

    def install(self, monkeypatch, arch_list=CU126_ARCHS, cuda="12.6") -> FakeCuda:
        cards = self.cards
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(cards))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cards))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: self.card(device).capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.card(device).name)
        # as torch's own: counts emulation by default, so it says True on any card
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True:
                            bool(cards) and (including_emulation or cards[0].capability >= (8, 0)))
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.card(device, error=RuntimeError).reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.card(device, error=RuntimeError).peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.card(device, error=RuntimeError).peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache",)))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", self.get_fraction, raising=False)
        if cuda and any(card.capability < (7, 5) for card in cards):  # as torch does with cuDNN >= 9.11
            monkeypatch.setattr(torch.backends.cudnn, "version", cudnn_refuses_old_gpus)
        return self
