"""Where the model runs and in which precision: every such decision is made here, once, for
the steps of the data path that run the model (accumulated step, probabilities at 350×525).

Training, validation, out-of-fold and test prediction, `cloudseg memory` and `cloudseg doctor`
all ask these functions, so a precision name means the same autocast dtype everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from cloudseg.units import human_duration

log = logging.getLogger("cloudseg")

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Ampere (A100, RTX 30xx) is the first NVIDIA generation with bf16 in hardware. Before it
# (GTX 1080 Ti 6.1, P100 6.0, V100 7.0, T4 and RTX 2080 Ti 7.5) bf16 is emulated through fp32
# and cuDNN has no bf16 convolutions, while fp16 halves the activations just as well.
NATIVE_BF16 = (8, 0)
# Full-resolution forward+backward of UNet-ResNet34 on a 2-core CPU (design.md); a CPU step
# costs about the same per pixel at any size, so this scales with the image area.
CPU_SECONDS_PER_FULL_IMAGE = 28.0
FULL_IMAGE_PIXELS = 1400 * 2100
# train.device=auto refuses the CPU above this area: at 512x512 a CPU step already takes
# ~2.5 s per image (hours per epoch on the Kaggle set), while the CPU demo (192x288) and
# the tests (64x96) stay far below it.
CPU_MAX_PIXELS = 512 * 512
# CUDA 13 builds of PyTorch (and its newest CUDA 12 builds) have no kernels for Maxwell,
# Pascal and Volta (compute capability < 7.5); its CUDA 12.6 builds still do.
OLD_GPU_BACKEND = "cu126"
NVIDIA_PROC = Path("/proc/driver/nvidia")  # the kernel driver's view, present even without nvidia-smi


# ---------------------------------------------------------------------------------- device


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS keeps one (taskset, a
    Slurm job, a container's cpuset), not every core of the machine as os.cpu_count() counts;
    its share of them where torchrun started several processes on this machine
    (LOCAL_WORLD_SIZE: `cloudseg segment` may run two on one GPU), at least one. (A launcher that
    pins each process to cores of its own, torchrun --numa-binding, gets fewer threads than it could.)"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, cores // max(1, int(processes) if processes.isdigit() else 1))


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """`auto` -> cuda when PyTorch can use a GPU, else cpu; a GPU this build has no kernels for is an
    error, as is cuda without a GPU (naming `option`, what the user set: a config key or a flag).

    A CUDA device always carries its index (the current GPU's when none is named): some
    torch.cuda calls refuse `torch.device("cuda")` without one (set_per_process_memory_fraction)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        given = f"{option} " if option.startswith("--") else f"{option}="  # a flag or a config key
        raise ValueError(f"{given}cuda but PyTorch sees no CUDA GPU; `cloudseg doctor` says why (or give {given}cpu)")
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        problem = unsupported_gpu(device.index)
        if problem:  # otherwise the first convolution fails with "no kernel image is available"
            raise ValueError(problem)
    return device


def require_usable_device(requested: str, device: torch.device, image_size, n_images: int) -> None:
    """No silent CPU: with train.device=auto, images larger than CPU_MAX_PIXELS need a GPU."""
    height, width = image_size
    if requested != "auto" or device.type != "cpu" or height * width <= CPU_MAX_PIXELS:
        return
    seconds = CPU_SECONDS_PER_FULL_IMAGE * height * width / FULL_IMAGE_PIXELS
    raise ValueError(f"train.device=auto found no usable GPU, and on the CPU {height}x{width} images take "
                     f"~{human_duration(seconds)} each: ~{human_duration(seconds * n_images)} per epoch of {n_images} images; "
                     "`cloudseg doctor` says why PyTorch sees no GPU (set train.device=cpu to train on the CPU anyway)")


def has_kernels(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a PyTorch built for `arch_list` (torch.cuda.get_arch_list()) runs on a GPU of `capability`.

    Machine code sm_XY runs on GPUs of major version X and minor >= Y; PTX compute_XY is
    compiled by the driver for any GPU of capability >= X.Y.
    """
    if not arch_list:  # nothing known about this build: nothing to say
        return True
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        code = divmod(int(re.sub(r"\D", "", number)), 10)  # sm_120 -> (12, 0); sm_90a -> (9, 0)
        if kind == "sm" and code[0] == capability[0] and code[1] <= capability[1]:
            return True
        if kind == "compute" and code <= tuple(capability):
            return True
    return False


def unsupported_gpu(index: int) -> str | None:
    """Why this PyTorch cannot run kernels on GPU `index` (and how to fix it), or None when it can."""
    if torch.version.cuda is None:  # ROCm builds name their targets differently
        return None
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    arch_list = torch.cuda.get_arch_list()
    if has_kernels(capability, arch_list):
        return None
    backend = OLD_GPU_BACKEND if capability < (7, 5) else "auto"
    return (f"GPU {index} ({props.name}, compute capability {props.major}.{props.minor}) has no kernels in "
            f"PyTorch {torch.__version__} (built for {' '.join(arch_list)}): "
            f"reinstall with `make install TORCH_BACKEND={backend}`")


CUDNN_BENCHMARK_LIMIT = 10  # PyTorch's default: cuDNN's benchmark times the first 10 algorithms its heuristics list


def speed_switches(device: torch.device, deterministic: bool = False, cudnn_search: bool = False,
                   inference: bool = False) -> None:
    """How kernels are chosen.

    Fast (the default, training's): cuDNN benchmarks its convolution algorithms once per input
    shape and keeps the fastest, worth it here where a handful of shapes recur. Which algorithm
    wins, and the atomic additions of some kernels, make two runs differ in their last bits.
    `inference` (predict, segment, oof): no benchmark, cuDNN's heuristics pick (PyTorch's default).
    On an H200 (torch 2.11, UNet-ResNet34 in bf16, 1400x2100 windows, 2026-11-27) their picks
    ran every batch as fast (26.8 against 26.7 ms a batch of 4, 7.7 against 7.7 of 1), while the
    search cost the first batch of each shape 1.0-1.6 s (4) and 0.6-0.7 s (1): 1.3-2.1 s of a
    one-scene `cloudseg segment` call of 7 (benchmarks/cudnn_search.py measures another GPU).
    `cudnn_search` (train.speedups.cudnn_search): the benchmark times every algorithm cuDNN
    offers for a shape, not the first CUDNN_BENCHMARK_LIMIT (the full-resolution weight gradients
    may have a faster one further down); the same maths, a longer first window. PyTorch keeps
    each shape's pick for the life of the process, whatever the limit was when it was made.
    `deterministic` (train.deterministic): PyTorch's deterministic algorithms (an error names any
    op that has none), cuDNN's deterministic ones without benchmarking, and the fixed cuBLAS
    workspace those require: a run repeats bit for bit (37.9 against 41-42 img/s on an H100).
    Set before the first CUDA kernel: cuBLAS reads its workspace setting once.
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic and not inference
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark_limit = 0 if cudnn_search else CUDNN_BENCHMARK_LIMIT


@contextlib.contextmanager
def without_cudnn_search():
    """Inside the block cuDNN's heuristics pick each convolution's algorithm, among its
    deterministic ones; after it, benchmark and deterministic modes are as they were. For the
    memory probes: a search times every algorithm of a shape, seconds a shape at full resolution.
    Deterministic too, because PyTorch keeps the algorithm it first ran for a shape, searched or
    not, under a key that holds `deterministic` but not `benchmark`: heuristics' picks under
    training's own key would be what training then runs, its search never made."""
    searching, deterministic = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = searching, deterministic


# Autograd nodes whose CUDA kernel PyTorch has no deterministic version of: under
# torch.use_deterministic_algorithms(True) the backward raises a RuntimeError on a GPU (the CPU
# runs it). From PyTorch's list in the docs of torch.use_deterministic_algorithms, "will throw a
# RuntimeError when mode=True", CUDA entries that autograd records as one node
# (docs.pytorch.org/docs/stable/generated/torch.use_deterministic_algorithms.html, read for
# torch 2.14, and the same docstring in the pinned 2.15). That list still names interpolate's
# linear modes, but since torch 2.1 F.interpolate routes a CUDA input under deterministic mode to
# a decomposition whose backward is a deterministic index_put: those nodes appear only in a graph
# built without it. Left out: entries that throw in the forward already (NLLLoss, histc, bincount,
# median, put_) and those a node name cannot tell apart (EmbeddingBag's max mode, scatter_reduce).
NO_DETERMINISTIC_CUDA_BACKWARD = {
    "AvgPool3DBackward0": "torch.nn.AvgPool3d",
    "AdaptiveAvgPool2DBackward0": "torch.nn.AdaptiveAvgPool2d",
    "AdaptiveAvgPool3DBackward0": "torch.nn.AdaptiveAvgPool3d",
    "AdaptiveMaxPool2DBackward0": "torch.nn.AdaptiveMaxPool2d",
    "FractionalMaxPool2DBackward0": "torch.nn.FractionalMaxPool2d",
    "FractionalMaxPool3DBackward0": "torch.nn.FractionalMaxPool3d",
    "MaxUnpool2DBackward0": "torch.nn.MaxUnpool2d",  # MaxUnpool1d runs it too
    "MaxUnpool3DBackward0": "torch.nn.MaxUnpool3d",
    "UpsampleLinear1DBackward0": "torch.nn.functional.interpolate (linear)",
    "UpsampleBilinear2DBackward0": "torch.nn.functional.interpolate (bilinear)",
    "UpsampleBilinear2DAaBackward0": "torch.nn.functional.interpolate (bilinear, antialias)",
    "UpsampleBicubic2DBackward0": "torch.nn.functional.interpolate (bicubic)",
    "UpsampleBicubic2DAaBackward0": "torch.nn.functional.interpolate (bicubic, antialias)",
    "UpsampleTrilinear3DBackward0": "torch.nn.functional.interpolate (trilinear)",
    "ReflectionPad1DBackward0": "torch.nn.ReflectionPad1d",
    "ReflectionPad2DBackward0": "torch.nn.ReflectionPad2d",
    "ReflectionPad3DBackward0": "torch.nn.ReflectionPad3d",
    "CtcLossBackward0": "torch.nn.CTCLoss",
    "GridSampler2DBackward0": "torch.nn.functional.grid_sample",
    "GridSampler3DBackward0": "torch.nn.functional.grid_sample",
}


def nondeterministic_cuda_backward(model: torch.nn.Module, image_size, device: str = "cuda") -> list[str]:
    """The operations of `model`'s graph whose backward has no deterministic CUDA kernel (see
    NO_DETERMINISTIC_CUDA_BACKWARD), as the graph is on `device` under deterministic mode.

    One forward of a uint8 image of `image_size`, in training mode, on fake tensors (shapes only,
    no memory, any machine: FakeTensorMode's CUDA tensors need no GPU), then a walk of the autograd
    graph. The model is left as it was: its weights and buffers are swapped for fake ones only
    for the call. Fake CUDA tensors take the same Python branches as real ones (F.interpolate's
    deterministic route among them), which a graph built on the CPU would not."""
    was_training, was_deterministic = model.training, torch.are_deterministic_algorithms_enabled()
    fake = FakeTensorMode()
    try:
        torch.use_deterministic_algorithms(True)
        with fake:
            state = {name: fake.from_tensor(tensor).to(device)
                     for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
            image = torch.zeros(1, 3, *image_size, dtype=torch.uint8, device=device)
            heads = {"with_classes": True} if getattr(model, "has_head", False) else {}  # the head's graph too
            outputs = torch.func.functional_call(model.train(), state, (image,), heads)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        model.train(was_training)
    found, seen, stack = [], set(), [out.grad_fn for out in tree_leaves(outputs) if isinstance(out, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        operation = NO_DETERMINISTIC_CUDA_BACKWARD.get(type(node).__name__)
        if operation and operation not in found:
            found.append(operation)
        stack += [parent for parent, _ in node.next_functions]
    return found


def require_deterministic_kernels(model: torch.nn.Module, image_size, device: torch.device,
                                  deterministic: bool) -> None:
    """train.deterministic=true on a GPU: refuse, before any step, a model with an operation whose
    backward PyTorch can only run nondeterministically there (it would raise at the first backward)."""
    if not deterministic or device.type != "cuda":
        return
    found = nondeterministic_cuda_backward(model, image_size)
    if found:
        raise ValueError(f"train.deterministic=true: the backward of {', '.join(found)} in this model has no "
                         f"deterministic CUDA kernel in PyTorch {torch.__version__}; set train.deterministic=false "
                         "(fastest kernels, runs differ in their last bits), train on the CPU, or choose a "
                         "model.arch/model.encoder without it")


# ---------------------------------------------------------------------------------- precision


def precision_for_capability(capability: tuple[int, int]) -> str:
    """What train.precision=auto means on a GPU of this compute capability: bf16 where it is native,
    else fp16 (with a GradScaler). `cloudseg memory` asks it about cards it is not running on."""
    return "bf16" if tuple(capability) >= NATIVE_BF16 else "fp16"


def resolve_precision(name: str, device: torch.device) -> str:
    """`train.precision` on `device` -> fp32, bf16 or fp16. auto: fp32 on the CPU, else by compute capability.

    The capability of this very device decides, not torch.cuda.is_bf16_supported(): by default
    that counts emulation (True on a T4), and it asks only the current device.
    """
    if name not in PRECISIONS:
        raise ValueError(f"train.precision={name!r}: expected one of {', '.join(PRECISIONS)}")
    if device.type != "cuda":
        return "fp32" if name == "auto" else name
    capability = torch.cuda.get_device_capability(device)
    if name == "auto":
        return precision_for_capability(capability)
    if name == "bf16" and capability < NATIVE_BF16:
        log.warning("train.precision=bf16 on a GPU of compute capability %d.%d: bf16 is emulated there (slow, "
                    "and cuDNN has no bf16 convolutions); train.precision=auto picks fp16", *capability)
    return name


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.precision` on `device` (None = plain fp32)."""
    return AUTOCAST_DTYPES[resolve_precision(precision, device)]


def needs_grad_scaler(dtype: torch.dtype | None) -> bool:
    """fp16 gradients underflow below ~6e-8, so its losses are scaled up; bf16 has fp32's range."""
    return dtype == torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed-precision context for `dtype` (a no-op for None)."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


# ---------------------------------------------------------------------------------- doctor


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it is missing or fails (no driver loaded)."""
    program = shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        return subprocess.run([program, *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def driver_versions() -> tuple[str | None, str | None]:
    """The NVIDIA driver's version and the newest CUDA it supports (None where unknown)."""
    text = nvidia_smi() or ""
    driver, cuda = (re.search(rf"{key} Version:\s*([\d.]+)", text) for key in ("Driver", "CUDA"))
    if driver is None:
        try:
            driver = re.search(r"Kernel Module.*?\s(\d+\.\d+[\d.]*)\s", (NVIDIA_PROC / "version").read_text())
        except OSError:
            pass
    return driver and driver.group(1), cuda and cuda.group(1)


def system_gpus() -> list[str]:
    """The NVIDIA GPUs the operating system sees, whether or not PyTorch can use them."""
    listed = nvidia_smi("-L")
    if listed:
        return [line.split(" (UUID")[0] for line in listed.splitlines() if line.startswith("GPU")]
    gpus = NVIDIA_PROC / "gpus"
    return [f"GPU at PCI {path.name}" for path in sorted(gpus.iterdir())] if gpus.is_dir() else []


def torch_build() -> str:
    """PyTorch's version and what it was built for."""
    if torch.version.cuda:
        return (f"PyTorch {torch.__version__}, built for CUDA {torch.version.cuda} "
                f"({' '.join(torch.cuda.get_arch_list()) or 'no kernel list'}), cuDNN {cudnn_version()}")
    if getattr(torch.version, "hip", None):
        return f"PyTorch {torch.__version__}, built for ROCm {torch.version.hip}"
    return f"PyTorch {torch.__version__}, a CPU-only build"


def cudnn_version() -> str:
    try:
        return str(torch.backends.cudnn.version())
    except RuntimeError as error:  # cuDNN 9.11 and later refuse to load beside a GPU older than 7.5
        return f"unusable here ({str(error).split('. ')[0]})"


def gpu_line(index: int) -> str:
    """One GPU PyTorch can see: what it is and the precision train.precision=auto gives it."""
    props = torch.cuda.get_device_properties(index)
    precision = precision_for_capability((props.major, props.minor))
    return (f"GPU {index}: {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, native bf16: {'yes' if precision == 'bf16' else 'no'}, "
            f"precision auto: {precision}{' with a GradScaler' if precision == 'fp16' else ''}")


def auto_device() -> str:
    """What train.device=auto resolves to, as training would see it."""
    try:
        device = resolve_device("auto")
    except ValueError:
        return "nothing, training refuses to start (see the problems)"
    return f"cuda (GPU {device.index})" if device.type == "cuda" else "the CPU"


def library_versions() -> str:
    import cv2
    import numpy

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"segmentation-models-pytorch {version('segmentation-models-pytorch')}, "
            f"albumentations {version('albumentations')}, OpenCV {cv2.__version__}, numpy {numpy.__version__}")


def unusable_gpu_problem(gpus: list[str], driver: str | None, driver_cuda: str | None) -> str | None:
    """When the system has an NVIDIA GPU but PyTorch cannot use any: why, in plain words, and what to do."""
    if not gpus or torch.cuda.is_available():
        return None
    seen = (f"the system has {len(gpus)} NVIDIA GPU(s) ({'; '.join(gpus)}), "
            f"but PyTorch {torch.__version__} cannot use them")
    fix = "`make install TORCH_BACKEND=auto` (uv picks the build for this driver; or name one, e.g. cu118)"
    if not torch.version.cuda:
        return f"{seen}: it is a CPU-only build. Reinstall with a CUDA build: {fix}"
    return (f"{seen}: it is built for CUDA {torch.version.cuda}, and the driver ({driver or 'version unknown'}"
            f"{f', CUDA up to {driver_cuda}' if driver_cuda else ''}) is most likely too old for it. "
            f"Update the NVIDIA driver, or reinstall with a build for this driver: {fix}")


def doctor() -> tuple[list[str], list[str]]:
    """What a bug report needs (lines), and the problems found, each saying what to do."""
    import cloudseg

    driver, driver_cuda = driver_versions()
    gpus = system_gpus()
    lines = [f"cloudseg {cloudseg.__version__} ({Path(cloudseg.__file__).parent})",
             f"Python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
             torch_build(),
             f"NVIDIA driver {driver} (CUDA up to {driver_cuda or 'unknown'})" if driver
             else "NVIDIA driver: none found (no nvidia-smi, no /proc/driver/nvidia)"]
    usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines += [gpu_line(index) for index in range(usable)]
    if not usable:
        lines.append(f"GPUs PyTorch can use: none{f' (the system lists {len(gpus)})' if gpus else ''}")
    lines += [f"train.device=auto uses: {auto_device()}", library_versions()]
    problems = [problem for problem in [unusable_gpu_problem(gpus, driver, driver_cuda)]
                + [unsupported_gpu(index) for index in range(usable)] if problem]
    if not gpus and not usable:
        lines.append("no NVIDIA GPU found: only the CPU demo is practical here (train.device=cpu for larger images)")
    return lines, problems
