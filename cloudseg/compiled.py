"""`train.compile` and `predict.compile`: the model under torch.compile.

Data path: train.csv → Dataset → loader → **model → loss, compiled** → accumulated step →
checkpoint → **probabilities, compiled** → post-process → submission.

Training compiles each micro-batch's forward with its loss, and AOTAutograd's backward: one
graph per micro-batch shape (`dynamic=False`). A new shape (the short last window of an epoch,
or the out-of-memory retry's halved micro-batch) compiles a new graph once. Test prediction
compiles the model's forward in eval mode, one graph for every batch (predict pads the short
last one). Validation and out-of-fold prediction run eagerly: at their own batch sizes they
would each be another graph to wait for, for a few hundred images. engine.window_norm_statistics
keeps BatchNorm free of the Python float that would otherwise break the graph in every layer.
`train.speedups.autotune` adds inductor's autotuning to the training compile (AUTOTUNE).

A compile costs tens of seconds once per process; inductor keeps what it compiled in its on-disk
cache (the command line puts it in ~/.cache/cloudseg/inductor, cli.keep_compiled_graphs), where
the next process with the same graph finds it. `cloudseg segment` compiles only for a job large
enough to repay even that (`resolve_compile`'s work_pixels).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
import sys
import time
import types

import torch

from cloudseg.units import human_duration

log = logging.getLogger("cloudseg")

BACKEND = "inductor"  # torch.compile's default; tests swap in "aot_eager" (the same graphs, no code generation)
# predict.compile=auto compiles only for a job whose model input is at least this many pixels. For an
# H100 and configs/fullres.yaml's UNet: the compile cost 21 s, and 10.6 s with its graphs in inductor's
# cache (measured: a one-scene segment call eager and compiling, 2026-11-27, BENCHMARKS.md); compiled
# saves about a quarter of the eager forward, some 0.6 ms a megapixel (estimated from the training
# step's eager and compiled rates, 46 and 61.5 images/s of 1400x2100): it repays from about 35
# gigapixels cold and 18 cached. 20 gigapixels: some 1,700 scenes of 2800x4200, or 160 of 7000x18000.
COMPILE_REPAID_PIXELS = 20e9


def resolve_compile(setting: bool | str, device: torch.device, key: str = "train.compile",
                    work_pixels: float | None = None) -> bool:
    """`train.compile` or `predict.compile` (`key`): auto compiles on CUDA where Triton is
    installed, which inductor writes GPU kernels in (PyTorch's Linux wheels bring it; Windows
    ones do not). On a CPU the compile costs more than it saves. Given `work_pixels`, the pixels
    the model will see in this call (segment: its scenes' pixels times the test-time flips), auto
    compiles only from COMPILE_REPAID_PIXELS: a smaller job is done before a compile would repay."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cuda":
        return False
    if importlib.util.find_spec("triton") is None:
        log.info("%s=auto: not compiling, Triton is not installed (torch.compile needs it on a GPU)", key)
        return False
    if work_pixels is not None and work_pixels < COMPILE_REPAID_PIXELS:
        log.info("%s=auto: not compiling for %.2f gigapixels of model input (compiling repays from %.0f; "
                 "%s=true compiles anyway)", key, work_pixels / 1e9, COMPILE_REPAID_PIXELS / 1e9, key)
        return False
    return True


# train.speedups.autotune: inductor's options for each setting, or the name of torch's mode that
# holds them. "all" is max-autotune-no-cudagraphs: no CUDA graphs, which would keep a copy of every
# input and replay the step outside the accumulation's control. (A mode's options are looked up when
# compiling: torch._inductor is not imported by a command that never compiles.)
AUTOTUNE = {"off": {}, "reductions": {"coordinate_descent_tuning": True}, "all": "max-autotune-no-cudagraphs"}


def compiled(function, autotune: str = "off"):
    """`function` under torch.compile with one graph per input shape; `autotune` (a key of
    AUTOTUNE) sets inductor's autotuning for this compile only. Other backends (the tests'
    aot_eager) generate no kernels to tune: they get none of inductor's options."""
    options = AUTOTUNE[autotune] if BACKEND == "inductor" else {}
    if isinstance(options, str):  # a mode's name: its options from torch._inductor, imported now
        options = importlib.import_module("torch._inductor").list_mode_options(options)
    return torch.compile(function, backend=BACKEND, dynamic=False, options=options or None)


DYNAMO_UTILS = "torch._dynamo.utils"


@contextlib.contextmanager
def dynamo_deferred():
    """While the block imports, torch._dynamo is loaded only where something uses it. Imported for
    segmentation_models_pytorch: its timm and torchvision load torch._dynamo as they are imported
    (1.5-2 s, with sympy and torch._inductor; the 2-core VM's demo call, BENCHMARKS.md) for what
    they use only when they run: torchvision's roi_align imports `torch._dynamo.utils`'s
    `is_compile_supported`, and timm decorates some of its models' methods with
    `torch.compiler.disable`, which imports torch._dynamo to wrap them. In the block,
    `torch._dynamo.utils` is a stand-in (`LoadedOnUse`) whose `is_compile_supported` is the real
    one, taken at its first call, and `torch.compiler.disable` wraps a function when it is first
    called (`disabled_on_first_call`). Once torch._dynamo is loaded the block changes nothing;
    after it, nothing is left in place but what the block's imports kept."""
    if DYNAMO_UTILS in sys.modules:
        yield
        return
    stand_in, disable = LoadedOnUse(DYNAMO_UTILS), torch.compiler.disable
    stand_in.is_compile_supported = made_on_first_call(lambda: stand_in.__getattr__("is_compile_supported"))
    sys.modules[DYNAMO_UTILS], torch.compiler.disable = stand_in, functools.partial(disabled_on_first_call, disable)
    try:
        yield
    finally:
        torch.compiler.disable = disable
        if sys.modules.get(DYNAMO_UTILS) is stand_in:
            del sys.modules[DYNAMO_UTILS]


class LoadedOnUse(types.ModuleType):
    """A stand-in for a module in sys.modules: the first name read from it that it lacks loads the
    module itself (in its place) and comes from there. Python's own names (`__path__`, `__file__`,
    which `inspect` asks of every module) find nothing and load nothing; its `__spec__` is None, so
    `importlib.util.find_spec` of its name fails while it stands in."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def disabled_on_first_call(disable, function=None, recursive: bool = True, **options):
    """`disable(function, recursive, **options)` (torch.compiler.disable) made when `function`
    is first called, not when it is decorated; a class (or any other callable) at once, as
    `disable` keeps it what it is. Where the first call is inside a compiled region, that compile
    breaks its graph there twice more (the later ones see `disable`'s own)."""
    if function is None:  # @torch.compiler.disable(recursive=False)
        return functools.partial(disabled_on_first_call, disable, recursive=recursive, **options)
    if not inspect.isfunction(function):
        return disable(function, recursive, **options)
    return functools.wraps(function)(made_on_first_call(lambda: disable(function, recursive, **options)))


def made_on_first_call(make):
    """A function that calls the function `make()` returns, `make` called once, at its first call."""
    made = []

    def call(*args, **kwargs):
        if not made:
            made.append(make())
        return made[0](*args, **kwargs)

    return call


def dynamo_counters():
    """torch._dynamo's counters (graphs, graph breaks, inductor's cache hits), imported here: importing
    torch._dynamo takes seconds, and a command that compiles nothing never needs it (torch.compile
    imports it when first called)."""
    from torch._dynamo.utils import counters

    return counters


def graph_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) in this process so far, from torch._dynamo's counters."""
    counters = dynamo_counters()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@contextlib.contextmanager
def compile_logged(compiling: bool, shape: torch.Size, world: int = 1, what: str = "micro-batches"):
    """Around a micro-batch's forward and backward (or a prediction batch's, `what`): when it
    compiled anything (the first, or a new `shape`), log the graphs (and how many of them came
    from inductor's cache, as a second call's should), the graph breaks and its time, compiling
    included. A graph break is a warning on one process; on several, DDP's own
    hooks break the graph by design."""
    if not compiling:
        yield
        return
    counters = dynamo_counters()
    (graphs, breaks), reasons, start = graph_counts(), set(counters["graph_break"]), time.perf_counter()
    cached = counters["aot_autograd"]["autograd_cache_hit"]
    yield
    new_graphs, new_breaks = graph_counts()[0] - graphs, graph_counts()[1] - breaks
    if new_graphs:
        log.info("torch.compile: %s of shape %s: %d graph(s) compiled, %d graph break(s); it took %s with "
                 "compiling (%d graph(s) from inductor's cache in %s)", what, list(shape), new_graphs, new_breaks,
                 human_duration(time.perf_counter() - start), counters["aot_autograd"]["autograd_cache_hit"] - cached,
                 os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default folder"))
    if new_breaks and world == 1:
        log.warning("torch.compile: graph breaks in the %s (each costs speed): %s", what,
                    "; ".join(reason.splitlines()[0] for reason in set(counters["graph_break"]) - reasons) or "as before")
