"""Device and precision decisions (cloudseg.hardware) and `cloudseg doctor`.

This machine has no GPU: every CUDA path is driven by faking what torch.cuda reports (the
compute capability, properties, kernel list) and, for the driver, an nvidia-smi script on PATH.
"""

from __future__ import annotations

import logging
import os
import textwrap

import pytest
import torch

from cloudseg import hardware
from cloudseg.cli import main
from cloudseg.hardware import (
    autocast_dtype, has_kernels, needs_grad_scaler, precision_for_capability, require_usable_device,
    resolve_device, resolve_precision, speed_switches, usable_cores,
)
from tests.fake_cuda import A100, CU13_ARCHS, CU126_ARCHS, GTX_1080_TI, RTX_2080_TI, Card

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture
def no_driver(tmp_path, monkeypatch):
    """No nvidia-smi on PATH and no /proc/driver/nvidia."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(hardware, "NVIDIA_PROC", tmp_path / "no-proc-driver-nvidia")


def fake_nvidia_smi(tmp_path, monkeypatch, driver="470.82.01", cuda="11.4", gpus=("NVIDIA GeForce GTX 1080 Ti",)):
    """An nvidia-smi on PATH printing what the real one prints for `-L` and for its table header."""
    listing = "\n".join(f"GPU {i}: {name} (UUID: GPU-{i}abc)" for i, name in enumerate(gpus))
    header = f"| NVIDIA-SMI {driver}    Driver Version: {driver}    CUDA Version: {cuda}     |"
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "-L" ]; then echo "{listing}"; else echo "{header}"; fi
        """))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(script.parent))
    monkeypatch.setattr(hardware, "NVIDIA_PROC", tmp_path / "no-proc-driver-nvidia")


# ---------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("card, expected", [
    (Card("Tesla P100", (6, 0), 16 * 2**30), "fp16"),
    (GTX_1080_TI, "fp16"),
    (Card("Tesla V100", (7, 0), 16 * 2**30), "fp16"),
    (RTX_2080_TI, "fp16"),  # and the T4
    (A100, "bf16"),
    (Card("NVIDIA GeForce RTX 3090", (8, 6), 24 * 2**30), "bf16"),
    (Card("NVIDIA H100", (9, 0), 80 * 2**30), "bf16"),
    (Card("NVIDIA RTX PRO 6000", (12, 0), 96 * 2**30), "bf16"),
])
def test_auto_precision_is_bf16_only_where_native(fake_cuda, card, expected):
    """Catches asking torch.cuda.is_bf16_supported() with its default (emulation counts: bf16 on
    a T4 or 1080 Ti, where it is slowest), a threshold other than 8.0 (e.g. 7.0 or major > 8),
    and resolve_precision and `cloudseg memory`'s precision_for_capability disagreeing."""
    fake_cuda(card)
    assert resolve_precision("auto", CUDA) == expected == precision_for_capability(card.capability)
    assert autocast_dtype("auto", CUDA) == {"bf16": torch.bfloat16, "fp16": torch.float16}[expected]


def test_auto_precision_asks_the_device_it_is_given(fake_cuda):
    """GPU 0 is a 2080 Ti, GPU 1 an A100. Catches asking the current device (as
    is_bf16_supported does) instead of the one the process trains on, e.g. cuda:1 under DDP."""
    fake_cuda(RTX_2080_TI, A100)
    assert resolve_precision("auto", torch.device("cuda", 1)) == "bf16"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "fp16"


def test_auto_precision_on_the_cpu_is_fp32_even_beside_a_gpu(fake_cuda):
    """Catches deciding from torch.cuda (here an A100 is visible) rather than from the device."""
    fake_cuda(A100)
    assert resolve_precision("auto", CPU) == "fp32" and autocast_dtype("auto", CPU) is None


@pytest.mark.parametrize("card", [None, RTX_2080_TI, A100])
@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_explicit_precisions_pass_through(fake_cuda, card, name):
    """Catches overriding an explicit choice (fp16 forced on a 7.5 card, fp32 on the CPU...)."""
    fake_cuda(*([card] if card else []))
    device = CUDA if card else CPU
    assert resolve_precision(name, device) == name
    assert autocast_dtype(name, device) == {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def test_explicit_bf16_warns_only_where_it_is_emulated(fake_cuda, caplog):
    """Catches a silent slow bf16 on a pre-Ampere card, and warning on every Ampere run."""
    fake_cuda(RTX_2080_TI, A100)
    with caplog.at_level(logging.WARNING, logger="cloudseg"):
        assert resolve_precision("bf16", torch.device("cuda", 1)) == "bf16"
        assert not caplog.records
        assert resolve_precision("bf16", torch.device("cuda", 0)) == "bf16"
    assert len(caplog.records) == 1 and "7.5" in caplog.text and "emulated" in caplog.text


def test_unknown_precision_is_a_clear_error():
    """Catches a bare KeyError from the dtype table."""
    with pytest.raises(ValueError, match=r"train.precision='fp8': expected one of auto, fp32, bf16, fp16"):
        resolve_precision("fp8", CPU)


def test_grad_scaler_only_for_fp16(fake_cuda):
    """Catches a scaler for bf16 (needless: it has fp32's range) or none for fp16 (gradients
    underflow), and auto on a 7.5 card not ending up with a scaler."""
    assert needs_grad_scaler(torch.float16)
    assert not needs_grad_scaler(torch.bfloat16) and not needs_grad_scaler(None)
    fake_cuda(RTX_2080_TI)
    assert needs_grad_scaler(autocast_dtype("auto", CUDA))


# ---------------------------------------------------------------------------------- device


@pytest.mark.parametrize("capability, arch_list, expected", [
    ((6, 1), CU13_ARCHS, False),  # a 1080 Ti with the CUDA 13 wheel: the GPU is seen, nothing runs
    ((6, 1), CU126_ARCHS, True),  # sm_60 machine code runs on 6.1
    ((8, 9), CU126_ARCHS, True),  # sm_86 runs on an RTX 4090
    ((12, 0), CU126_ARCHS, False),  # sm_90 machine code does not run on 12.0 ...
    ((12, 0), ["sm_80", "compute_90"], True),  # ... but PTX for 9.0 is compiled for it by the driver
    ((7, 5), ["sm_80", "compute_80"], False),  # nothing runs on an older GPU than the code
    ((10, 0), ["sm_90a", "sm_100"], True),  # suffixes and three digits: "sm_100" < "sm_75" as text
])
def test_has_kernels(capability, arch_list, expected):
    """Catches ignoring the major version (sm_90 on 12.0), comparing arch names as text, and
    ignoring PTX."""
    assert has_kernels(capability, arch_list) == expected


def test_a_gpu_without_kernels_is_refused_with_the_fix(fake_cuda):
    """A 1080 Ti under the CUDA 13 wheel. Catches returning a cuda device anyway, so that the
    first convolution fails with "no kernel image is available for execution on the device"."""
    fake_cuda(GTX_1080_TI, arch_list=CU13_ARCHS, cuda="13.2")
    with pytest.raises(ValueError) as error:
        resolve_device("auto")
    message = str(error.value)
    assert "GTX 1080 Ti" in message and "6.1" in message and "make install TORCH_BACKEND=cu126" in message
    fake_cuda(GTX_1080_TI, arch_list=CU126_ARCHS)
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_cuda_without_a_gpu_points_to_doctor_and_names_what_the_user_set(fake_cuda, capsys):
    """CPU, no GPU faked. Would catch: `cloudseg oof --device cuda` told to set train.device, which
    it does not read."""
    fake_cuda()
    assert resolve_device("auto") == CPU
    with pytest.raises(ValueError, match=r"^train\.device=cuda but .*cloudseg doctor.*\(or give train\.device=cpu\)$"):
        resolve_device("cuda")
    assert main(["oof", "--checkpoint", "any.pt", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == ("cloudseg: error: --device cuda but PyTorch sees no CUDA GPU; "
                                               "`cloudseg doctor` says why (or give --device cpu)")


def test_no_silent_cpu_for_large_images():
    """1400x2100 on the CPU: 28 s per image, 5546 images -> 28 * 5546 / 3600 = 43.1 h per epoch.
    Catches a multi-line or unhelpful message and a wrong time estimate."""
    with pytest.raises(ValueError) as error:
        require_usable_device("auto", CPU, (1400, 2100), 5546)
    message = str(error.value)
    assert "\n" not in message
    assert "1400x2100" in message and "~28 s each" in message and "~43 h per epoch of 5546 images" in message
    assert "cloudseg doctor" in message and "train.device=cpu" in message


def test_the_cpu_estimate_of_a_few_images_is_in_minutes():
    """6 images at 1400x2100 on the CPU: 6 * 28 s = 168 s = 2.8 min. Catches the estimate that
    said "~0 h per epoch of 6 images"."""
    with pytest.raises(ValueError, match=r"~28 s each: ~2\.8 min per epoch of 6 images;"):
        require_usable_device("auto", CPU, (1400, 2100), 6)


@pytest.mark.parametrize("requested, device, size, refused", [
    ("auto", CPU, (512, 512), False),  # the threshold itself is allowed
    ("auto", CPU, (512, 513), True),
    ("auto", CPU, (256, 2048), True),  # area decides, not the height alone
    ("auto", CPU, (192, 288), False),  # the CPU demo
    ("cpu", CPU, (1400, 2100), False),  # asked for explicitly
    ("auto", CUDA, (1400, 2100), False),
])
def test_cpu_guard_threshold(requested, device, size, refused):
    """Catches the threshold on the wrong side, a test on one side only, refusing an explicit
    train.device=cpu, and refusing a GPU."""
    if refused:
        with pytest.raises(ValueError):
            require_usable_device(requested, device, size, 100)
    else:
        require_usable_device(requested, device, size, 100)


@pytest.fixture
def switches_restored(monkeypatch):
    """cuDNN's flags, the deterministic-algorithms switch and CUBLAS_WORKSPACE_CONFIG as they
    were before the test (all process-wide)."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def test_speed_switches_benchmark_cudnn_on_cuda_only(switches_restored):
    """Catches not turning cuDNN's benchmark on for CUDA, flipping it for CPU runs, and the fast
    mode turning deterministic algorithms on (or off, where a user had set them)."""
    speed_switches(CPU)
    assert torch.backends.cudnn.benchmark is False
    speed_switches(CUDA)
    assert torch.backends.cudnn.benchmark is True and torch.backends.cudnn.deterministic is False
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    torch.use_deterministic_algorithms(True)
    speed_switches(CUDA)
    assert torch.are_deterministic_algorithms_enabled()


def test_deterministic_switches_what_a_bit_exact_gpu_run_needs(switches_restored):
    """Catches benchmark mode left on (its algorithm choice can differ between processes, so a
    resumed run would not repeat), cuDNN's nondeterministic algorithms allowed, PyTorch's
    deterministic algorithms not asked for, and the cuBLAS workspace they need left unset (torch
    raises at the first cuBLAS call); and a user's own CUBLAS_WORKSPACE_CONFIG overwritten."""
    speed_switches(CUDA, deterministic=True)
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    speed_switches(CUDA, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


# ---------------------------------------------------------------------------------- doctor


def test_doctor_on_a_machine_without_gpu(no_driver, fake_cuda, capsys):
    """Catches doctor failing without a driver, and leaving out the versions a report needs."""
    fake_cuda(cuda="13.2", arch_list=CU13_ARCHS)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"PyTorch {torch.__version__}, built for CUDA 13.2" in out
    assert "NVIDIA driver: none found" in out and "no NVIDIA GPU found" in out and "no problems found" in out
    assert "train.device=auto uses: the CPU" in out and "numpy " in out and "segmentation-models-pytorch " in out


def test_doctor_explains_a_driver_too_old_for_the_wheel(tmp_path, monkeypatch, fake_cuda, capsys):
    """nvidia-smi lists a GPU, PyTorch (CUDA 13.2) sees none. Catches reporting just "no GPU"."""
    fake_nvidia_smi(tmp_path, monkeypatch, driver="470.82.01", cuda="11.4")
    fake_cuda(cuda="13.2", arch_list=CU13_ARCHS)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "NVIDIA driver 470.82.01 (CUDA up to 11.4)" in out and "(the system lists 1)" in out
    assert "GPU 0: NVIDIA GeForce GTX 1080 Ti" in out and "cannot use them" in out
    assert "built for CUDA 13.2" in out and "too old" in out and "make install TORCH_BACKEND=auto" in out


def test_doctor_explains_a_cpu_only_wheel(tmp_path, monkeypatch, fake_cuda, capsys):
    """Catches blaming the driver when the wheel itself has no CUDA."""
    fake_nvidia_smi(tmp_path, monkeypatch)
    fake_cuda(cuda=None, arch_list=[])
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "a CPU-only build" in out and "too old" not in out and "make install TORCH_BACKEND=auto" in out


def test_doctor_finds_the_gpu_without_nvidia_smi(no_driver, fake_cuda, capsys):
    """Only the kernel driver's /proc entry says a GPU is there. Catches relying on nvidia-smi alone."""
    (hardware.NVIDIA_PROC / "gpus" / "0000:01:00.0").mkdir(parents=True)
    (hardware.NVIDIA_PROC / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)\n")
    fake_cuda(cuda="13.2", arch_list=CU13_ARCHS)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "NVIDIA driver 550.54.15" in out and "GPU at PCI 0000:01:00.0" in out and "cannot use them" in out


def test_doctor_lists_each_gpu_with_its_own_precision(tmp_path, monkeypatch, fake_cuda, capsys):
    """A 2080 Ti and an A100. Catches every GPU shown with GPU 0's capability or precision."""
    fake_nvidia_smi(tmp_path, monkeypatch, driver="550.54.15", cuda="12.4", gpus=(RTX_2080_TI.name, A100.name))
    fake_cuda(RTX_2080_TI, A100)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert ("GPU 0: NVIDIA GeForce RTX 2080 Ti, compute capability 7.5, 11.0 GiB, native bf16: no, "
            "precision auto: fp16 with a GradScaler") in out
    assert ("GPU 1: NVIDIA A100-SXM4-40GB, compute capability 8.0, 40.0 GiB, native bf16: yes, "
            "precision auto: bf16\n") in out
    assert "train.device=auto uses: cuda (GPU 0)" in out and "no problems found" in out


def test_doctor_flags_a_gpu_the_wheel_has_no_kernels_for(tmp_path, monkeypatch, fake_cuda, capsys):
    """The project's own 11 GB card under the pinned CUDA 13 wheel: seen, but unusable. Catches
    doctor stopping at cuDNN's RuntimeError (it refuses to load beside a GPU older than 7.5)."""
    fake_nvidia_smi(tmp_path, monkeypatch, driver="580.95.05", cuda="13.0")
    fake_cuda(GTX_1080_TI, arch_list=CU13_ARCHS, cuda="13.2")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "has no kernels in PyTorch" in out and "make install TORCH_BACKEND=cu126" in out
    assert "train.device=auto uses: nothing, training refuses to start" in out
    assert "cuDNN unusable here (cuDNN version 92600 is not compatible with devices with SM < 7.5)" in out


def test_usable_cores_are_the_process_s_affinity_not_the_machine_s(monkeypatch):
    """CPU. Would catch: os.cpu_count() (every core of the machine) where the process may run on
    fewer (taskset, a Slurm job, a container's cpuset): segment would start a compression thread
    and a read ahead per core it cannot use."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one process on the machine, not torchrun's several
    assert usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS and Windows keep none
    assert usable_cores() == 64


@pytest.mark.parametrize("processes, share", [(None, 16), ("1", 16), ("3", 5), ("4", 4), ("32", 1),
                                               ("", 16), ("0", 16), ("two", 16)])
def test_processes_torchrun_started_on_one_machine_share_its_cores(monkeypatch, processes, share):
    """CPU. Would catch: each of torchrun's processes (LOCAL_WORLD_SIZE of them on this machine,
    segment's sharing one GPU) sizing its reading and compressing threads by every core, N times
    too many threads in all; a share of none where there are more processes than cores; a value
    torchrun never sets (empty, 0, not a number) failing every import of segment."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    if processes is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
    assert usable_cores() == share
