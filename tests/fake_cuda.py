"""A fake CUDA for the tests that reach cloudseg's CUDA branches on a CPU: GPUs that torch.cuda
reports (name, compute capability, memory) and the allocator statistics cloudseg reads.

The fake is as strict as torch about its arguments, because a fake that accepts what torch
refuses tests nothing: each function takes its device argument through torch's own
`torch.cuda._utils._get_device_index` with the `optional` flag the real function uses (so a CPU
device is refused everywhere, and `torch.device("cuda")` without an index where torch requires
one), checks the index against the cards, and checks the other arguments as torch does. An index
past the cards raises what torch raises: AssertionError where torch.cuda checks it in Python
(get_device_properties and what reads it), RuntimeError where the C++ allocator or the CUDA
runtime does (the memory functions, synchronize, streams), IndexError where torch.cuda indexes
its tuple of generators (the random states). The fake behaves as after CUDA's initialization:
before it, torch's memory statistics read 0 without checking their argument. It also keeps what
the GPU path leans on besides memory: streams (the current one per card, `torch.cuda.stream`,
`synchronize`, `wait_stream`, `Tensor.record_stream`), events (`record`, `synchronize`), the sync debug mode (a stream's
synchronize raises under "error", as torch's does; `torch.cuda.synchronize()` does not: torch's
sync debug mode checks stream syncs and copies only, as an H100 showed), and one random state per
card (16 bytes: seed and offset, as CUDA's Philox generator keeps them), which `torch.manual_seed`
seeds. `tests/test_gpu.py` compares the fake with the real torch.cuda on a GPU machine.

`present_to_all_but_torch` installs a fake GPU for every test of a CPU machine (tests/conftest.py):
cloudseg, the tests and the benchmarks then see CUDA as users' machines have it, while torch's own
modules keep the real answer (see `OutsideTorch`).

No tensor goes to a fake GPU: code under test keeps its tensors on the CPU (the memory planner
takes its allocator readings through `memory.peak_bytes`, which the tests replace).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
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
    rng: torch.Tensor = field(default_factory=lambda: philox_state(0), compare=False)  # its default generator's state


def philox_state(seed: int, offset: int = 0) -> torch.Tensor:
    """A CUDA generator's state as torch.cuda.get_rng_state returns it: 16 bytes, seed and offset."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


@dataclass(eq=False)
class FakeStream:
    """A CUDA stream of a fake card: what it was asked to do goes into the FakeCuda's log, with
    the sync debug mode at the time of a synchronize."""

    cuda: "FakeCuda"
    index: int  # the card
    name: str

    def synchronize(self) -> None:
        self.cuda.check_sync()
        self.cuda.calls.append(("synchronize stream", self.name, self.cuda.sync_debug_mode))

    def wait_stream(self, stream) -> None:
        if not isinstance(stream, FakeStream):  # torch takes only a Stream
            raise TypeError(f"wait_stream expects a Stream, got {type(stream).__name__}")
        self.cuda.calls.append(("wait_stream", self.name, stream.name))


@dataclass(eq=False)
class FakeEvent:
    """A CUDA event (torch.cuda.Event) of a fake card: its records and synchronizes go into the
    FakeCuda's log. As torch's: recorded on the current stream unless given one (a Stream only),
    bound to the card of its first record, and its synchronize is not checked by the sync debug
    mode (c10's CUDAEvent::synchronize calls cudaEventSynchronize alone; tests/test_gpu.py holds
    the real one to that)."""

    cuda: "FakeCuda"
    blocking: bool = False
    stream: FakeStream | None = None  # where it was last recorded

    def record(self, stream=None) -> None:
        stream = self.cuda.current_stream() if stream is None else stream
        if not isinstance(stream, FakeStream):
            raise TypeError(f"record(): argument 'stream' must be Stream, not {type(stream).__name__}")
        if self.stream is not None and stream.index != self.stream.index:
            raise RuntimeError(f"Event device {self.stream.index} does not match recording stream's device {stream.index}.")
        self.stream = stream
        self.cuda.calls.append(("record event", stream.name))

    def synchronize(self) -> None:
        self.cuda.calls.append(("synchronize event", self.stream and self.stream.name, self.cuda.sync_debug_mode))


GTX_1080_TI = Card("NVIDIA GeForce GTX 1080 Ti", (6, 1), 11264 * 2**20)
RTX_2080_TI = Card("NVIDIA GeForce RTX 2080 Ti", (7, 5), 11264 * 2**20)
A100 = Card("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB)
H100 = Card("NVIDIA H100 80GB HBM3", (9, 0), int(79.2 * GiB))


def cudnn_refuses_old_gpus():
    raise RuntimeError("cuDNN version 92600 is not compatible with devices with SM < 7.5. Please install ...")


@dataclass
class FakeCuda:
    """The cards torch.cuda reports (GPU 0 current until set_device) and a log of the calls that change state."""

    cards: list[Card]
    calls: list[tuple] = field(default_factory=list)
    current: int = 0  # torch.cuda.current_device()
    sync_debug_mode: int = 0
    current_streams: dict[int, FakeStream] = field(default_factory=dict)

    def index(self, device, optional: bool, error: type[Exception] = AssertionError) -> int:
        """The card `device` names, by torch's rules (see the module docstring); past the cards,
        `error`: AssertionError as torch.cuda checks in Python, RuntimeError as its C++ side does."""
        index = _get_device_index(device, optional=optional)
        if not 0 <= index < len(self.cards):
            raise error(f"Invalid device id {index}")
        return index

    def set_device(self, device) -> None:
        index = _get_device_index(device)  # as torch's: no index, or the CPU, a ValueError; below 0, nothing
        if index >= 0:
            self.current = self.index(index, False, RuntimeError)  # past the cards: the CUDA runtime's error
            self.calls.append(("set_device", index))

    def position(self, card: Card) -> int:
        """The index of `card` itself (cards of one model compare equal)."""
        return next(index for index, other in enumerate(self.cards) if other is card)

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
        self.calls.append(("reset_peak_memory_stats", self.position(card)))

    def synchronize(self, device=None) -> None:
        """torch.cuda.synchronize: not checked by the sync debug mode (measured on an H100)."""
        index = self.index(device, True, RuntimeError)
        self.calls.append(("synchronize", index))

    # ------------------------------------------------------------------ streams and host syncs

    def check_sync(self) -> None:
        """What torch does at a synchronizing call under torch.cuda.set_sync_debug_mode."""
        if self.sync_debug_mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")
        if self.sync_debug_mode == 1:
            warnings.warn("called a synchronizing CUDA operation", stacklevel=3)

    def set_sync_debug_mode(self, debug_mode) -> None:
        if isinstance(debug_mode, str):
            if debug_mode not in SYNC_DEBUG_MODES:
                raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
            debug_mode = SYNC_DEBUG_MODES[debug_mode]
        if not isinstance(debug_mode, int) or debug_mode not in (0, 1, 2):  # torch's C++ side takes 0, 1, 2
            raise RuntimeError(f"invalid debug mode {debug_mode!r}")
        self.sync_debug_mode = debug_mode

    def current_stream(self, device=None) -> FakeStream:
        index = self.index(device, True, RuntimeError)
        return self.current_streams.setdefault(index, FakeStream(self, index, f"default stream of GPU {index}"))

    def new_stream(self, device=None, priority=0, **kwargs) -> FakeStream:
        index = self.index(device, True, RuntimeError)
        return FakeStream(self, index, f"stream {len(self.calls)} of GPU {index}")

    def new_event(self, enable_timing=False, blocking=False, interprocess=False, external=False) -> FakeEvent:
        return FakeEvent(self, blocking=bool(blocking))

    @contextlib.contextmanager
    def stream(self, stream):
        """torch.cuda.stream: `stream` the current one of its card (None: no change)."""
        if stream is None:
            yield
            return
        if not isinstance(stream, FakeStream):
            raise TypeError(f"expected a Stream, got {type(stream).__name__}")
        was = self.current_stream(stream.index)
        self.current_streams[stream.index] = stream
        try:
            yield
        finally:
            self.current_streams[stream.index] = was

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tensor.record_stream; the fake's tensors stay on the CPU and stand for a card's."""
        if not isinstance(stream, FakeStream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, not {type(stream).__name__}")
        self.calls.append(("record_stream", stream.name))

    # ------------------------------------------------------------------ random states

    def rng_card(self, device) -> Card:
        """torch.cuda's rule in get_rng_state/set_rng_state: a str or int becomes a device, whose
        index (None: the current one) indexes the tuple of generators (IndexError past it)."""
        if isinstance(device, str):
            device = torch.device(device)
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        index = device.index  # AttributeError for None, as torch's
        index = torch.cuda.current_device() if index is None else index
        if index >= len(self.cards):
            raise IndexError("tuple index out of range")
        return self.cards[index]

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng_card(device).rng.clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        card = self.rng_card(device)
        if new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
            raise TypeError("expected a torch.ByteTensor, but got " + new_state.type())
        if new_state.numel() != 16:
            raise RuntimeError("RNG state is wrong size")
        card.rng = new_state.clone()
        self.calls.append(("set_rng_state", self.position(card)))

    def set_rng_state_all(self, new_states) -> None:
        for index, state in enumerate(new_states):  # as torch's: past the cards, IndexError
            self.set_rng_state(state, index)

    def manual_seed_all(self, seed) -> None:
        for card in self.cards:
            card.rng = philox_state(int(seed))

    def install(self, monkeypatch, arch_list=CU126_ARCHS, cuda="12.6") -> FakeCuda:
        cards = self.cards
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(cards))
        # FakeTensorMode's first CUDA tensor makes a real one to start the GPU's context where torch.cuda
        # says it is available (torch 2.11; 2.15 asks torch.accelerator): a fake GPU has no context to start
        from torch._subclasses import fake_tensor
        monkeypatch.setattr(fake_tensor, "init_gpu_context", lambda device: None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cards))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
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
        monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                            lambda device=None: self.card(device, error=RuntimeError).peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache",)))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", self.get_fraction, raising=False)
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.sync_debug_mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self.set_sync_debug_mode)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "Event", self.new_event)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: self.record_stream(tensor, stream))
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [card.rng.clone() for card in cards])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_rng_state_all)
        monkeypatch.setattr(torch.cuda, "manual_seed_all", self.manual_seed_all)
        if cuda and any(card.capability < (7, 5) for card in cards):  # as torch does with cuDNN >= 9.11
            monkeypatch.setattr(torch.backends.cudnn, "version", cudnn_refuses_old_gpus)
        return self


class OutsideTorch:
    """What `FakeCuda.install` sets, through `monkeypatch`, answered to callers outside torch alone:
    a torch.cuda function called from a module of torch itself gives the real answer. So cloudseg,
    the tests and the benchmarks see a GPU, and torch's internals (the optimizer's check for a
    CUDA graph capture, dynamo's guards) do not call CUDA's runtime on the fake's word, which would
    fail on this machine for CPU tensors that a real GPU machine handles without any GPU call. A
    tensor sent to the fake GPU still fails, as it must: no test may put one there unasked."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def setattr(self, target, name, value, raising=True):
        real = getattr(target, name, None)
        if callable(value) and callable(real):
            value = answer_by_caller(value, real)
        self.monkeypatch.setattr(target, name, value, raising=raising)


_inside_fake = threading.local()


def answer_by_caller(fake, real):
    """`fake` for callers outside torch, and for torch's helpers while a fake runs (the fake's
    `_get_device_index` asks torch.cuda.current_device); `real` for torch's own calls."""

    def answer(*args, **kwargs):
        depth = getattr(_inside_fake, "depth", 0)
        if not depth and sys._getframe(1).f_globals.get("__name__", "").partition(".")[0] == "torch":
            return real(*args, **kwargs)
        _inside_fake.depth = depth + 1
        try:
            return fake(*args, **kwargs)
        finally:
            _inside_fake.depth = depth

    return answer


CARDS = {"H100": H100, "A100": A100, "RTX_2080_TI": RTX_2080_TI, "GTX_1080_TI": GTX_1080_TI}


class ForGood:
    """A `monkeypatch` that never undoes: the fake GPU of a whole process."""

    @staticmethod
    def setattr(target, name, value, raising=True):
        setattr(target, name, value)


def present_to_all_but_torch(card_name: str) -> None:
    """One GPU of CARDS[card_name] for the rest of this process, seen by everything but torch itself
    (`OutsideTorch`), with what a CUDA 13 build of PyTorch reports about itself. Once per process:
    the `fake_cuda` fixture of a test patches over it and restores it."""
    if getattr(torch.cuda, "fake_gpu", None):
        return
    card = CARDS[card_name]
    FakeCuda([Card(card.name, card.capability, card.total_memory)]).install(OutsideTorch(ForGood()), CU13_ARCHS, "13.0")
    torch.cuda.fake_gpu = card_name
