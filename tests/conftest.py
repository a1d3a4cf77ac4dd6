"""Fixtures and helpers shared by the tests: the tiny dataset, the tiny training options, ways to
plant behaviour in the models that training builds, and the skip of the `gpu` tests without CUDA."""

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from cloudseg import train as train_module
from cloudseg.synth import synthesize
from tests.fake_cuda import CU126_ARCHS, FakeCuda, present_to_all_but_torch

# Tests train on tiny images, where a second intra-op thread costs more in synchronisation than
# it gains (one tiny training on the 2-core VM: 3.7 s on one thread, 13 s on two while another
# job ran); `make test` runs one pytest worker per core instead. The variable reaches the CLI and
# torchrun subprocesses.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# No test remembers a memory probe in the user's cache, nor takes one from it (memory.probed_peak):
# tests/test_cuda_paths.py names a file of its own where it means to.
os.environ["CLOUDSEG_PROBE_CACHE"] = ""

# A GPU as users have one. Every user has a GPU, this machine and CI have none: a test that silently
# assumed "no CUDA" passed here and failed on an H100 (issue 30). So on a machine without CUDA the
# tests, their process and every Python process they start, see one fake H100 (tests/fake_cuda.py,
# `present_to_all_but_torch`; tests/fake_gpu starts it in subprocesses): a test that means the CPU
# says so (train.device=cpu, --device cpu), one that means "whatever device there is" takes the
# `device` fixture, and one that leaves it to `auto` fails here as it would on a GPU. The `fake_cuda`
# fixture still sets any cards, none included. CLOUDSEG_FAKE_GPU=none: the machine as it is.
REAL_CUDA = not getattr(torch.cuda, "fake_gpu", None) and torch.cuda.is_available()  # xdist's workers start faked
FAKE_GPU = "none" if REAL_CUDA else os.environ.get("CLOUDSEG_FAKE_GPU", "H100")
os.environ["CLOUDSEG_FAKE_GPU"] = FAKE_GPU
if FAKE_GPU != "none":
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "fake_gpu"),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    present_to_all_but_torch(FAKE_GPU)

TINY_SHAPE = (64, 96)

# A training run in seconds on the tiny dataset: 16 train and 8 validation images. On the CPU
# whatever the machine: the tests built on it compare runs bit for bit (resume, out-of-memory
# retry, EMA), which only the CPU promises by default; tests/test_gpu.py adds train.device=cuda.
TINY = [
    "data.num_workers=0", "data.n_folds=3", "model.arch=unet", "model.decoder_channels=[16,8,8,8,8]",
    "train.epochs=2", "train.micro_batch=2", "train.effective_batch=4", "train.warmup_steps=1", "train.device=cpu",
    "train.compile=false",  # on a CUDA machine auto would compile every test's run; tests/test_compile.py asks for it
    "model.cls_head=false",  # the tests of the head (test_head.py, the DDP test) ask for it
    "train.every_fold=false",  # 24 images would train every fold (auto); tests/test_every_fold.py asks for it
    "train.min_steps=0",  # train.epochs as given: 16 images would train 50 epochs (tests/test_min_steps.py asks for it)
]


def pytest_report_header(config):
    return f"CUDA: {'real' if REAL_CUDA else 'none'}; fake GPU seen outside torch: {FAKE_GPU} (tests/conftest.py)"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a real CUDA GPU: skipped where PyTorch sees none (`make test-gpu`
    refuses to run there at all)."""
    if REAL_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu, on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Whatever device there is, for a test that holds on any: the GPU where CUDA is real, else the CPU."""
    return torch.device("cuda" if REAL_CUDA else "cpu")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small synthetic dataset in the Kaggle layout (shared; tests must not modify it)."""
    return synthesize(tmp_path_factory.mktemp("tiny"), n_train=24, n_test=6, height=TINY_SHAPE[0], width=TINY_SHAPE[1], seed=3)


@pytest.fixture
def data_copy(tiny_data, tmp_path):
    """A private copy of the tiny dataset, for tests that write folds.csv or spoil files."""
    return shutil.copytree(tiny_data, tmp_path / "data")


@pytest.fixture
def fake_cuda(monkeypatch):
    """fake_cuda(card, ...): torch.cuda reports these cards (tests/fake_cuda.py), GPU 0 current,
    as strict as torch about its arguments; returns the FakeCuda (its cards and call log)."""

    def install(*cards, arch_list=CU126_ARCHS, cuda="12.6"):
        return FakeCuda([dataclasses.replace(card) for card in cards]).install(monkeypatch, arch_list, cuda)

    return install


@pytest.fixture
def wrap_built_models(monkeypatch):
    """`wrap(f)`: every model that training builds from now on is passed through `f` (e.g. to
    plant a signal or an out-of-memory error); `wrap(None)` builds plain models again."""
    real_build = train_module.build_model

    def wrap(wrapper):
        build = real_build if wrapper is None else (lambda *a, **k: wrapper(real_build(*a, **k)))
        monkeypatch.setattr(train_module, "build_model", build)

    return wrap


def signal_during(model, call, signum, training=True):
    """Deliver `signum` to this process at the `call`-th forward with gradients (training,
    mid-window) or without (validation, out-of-fold). A forward pre-hook, not a replaced
    `forward`: a deep copy of the model (train.ema's average) must not run this model's forward.
    Forwards on fake tensors are no training (train.deterministic's check of the graph on a GPU)."""
    calls = []

    def hook(module, args):
        if torch.is_grad_enabled() == training and not isinstance(args[0], FakeTensor):
            calls.append(1)
            if len(calls) == call:
                os.kill(os.getpid(), signum)

    model.register_forward_pre_hook(hook)
    return model


def stem_norm_statistics(model, data_dir, config, ids=None):
    """(name, layer, mean of its input over the config's training images, or `ids`) of the model's
    first BatchNorm (the stem's), the input measured with a hook in one eval-mode forward: what its
    running mean must be once BatchNorm is measured again over those images under these weights."""
    from cloudseg.data import CloudDataset, fold_ids

    name, norm = next((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d))
    inputs = []
    handle = norm.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    dataset = CloudDataset(data_dir, "train", fold_ids(config.data, config.seed)[0] if ids is None else ids)
    with torch.no_grad():
        model.eval()(torch.stack([dataset[i]["image"] for i in range(len(dataset))]))
    handle.remove()
    return name, norm, inputs[0].mean((0, 2, 3))


def named(name: str):
    """torch.testing.assert_close's `msg`: the tensor's name, then torch's own figures (the greatest
    absolute and relative differences and the tolerances), so that noise can be told from a defect."""
    return lambda figures: f"{name}: {figures}"


def assert_same_parameters(a, b, tol=1e-12):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=tol, rtol=0), f"{name} differs by {(p - q).abs().max():.3g}"


@pytest.fixture
def aot_eager(monkeypatch):
    """train.compile's graphs without code generation (torch.compile's aot_eager backend: the
    same graph capture and AOTAutograd, eager kernels), from a clean torch._dynamo state whose
    counters the test can read."""
    from torch._dynamo.utils import counters

    from cloudseg import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def write_tiny_checkpoint(path, image_size=TINY_SHAPE, seed=0, options=()):
    """A checkpoint of an untrained tiny UNet (mobilenet_v2 encoder, decoder [16,8,8,8,8]) that
    trained on images of `image_size`, without a training run: for the commands that only load one."""
    from cloudseg.checkpoint import save_checkpoint
    from cloudseg.config import load_config
    from cloudseg.model import build_model

    size = "null" if image_size is None else f"[{image_size[0]},{image_size[1]}]"
    config = load_config("configs/demo.yaml", [*TINY, f"data.image_size={size}", *options])
    torch.manual_seed(seed)
    model = build_model(config.model, pretrained=False).eval()
    save_checkpoint(path, {"model": model.state_dict(), "config": config.model_dump(mode="json"), "epoch": 0, "step": 0})
    return path
