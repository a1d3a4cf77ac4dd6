"""train.speedups (issue #37): exact-maths speed-ups of the compiled step, each off by default
until a GPU measures it. Each must train what the step without it trains (float64 on the CPU,
the compiled step still one graph without a break): cuDNN's full algorithm search (a switch of
hardware.speed_switches), inductor's autotuning (compiled.py) and the stem padded to 4 channels
(model.pad_stem). Where the maths is claimed equal, the tolerance is the float64 floor that
tests/test_compile.py measured for a different order of a few sums."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cloudseg import compiled
from cloudseg.checkpoint import load_checkpoint
from cloudseg.compiled import graph_counts
from cloudseg.config import ModelConfig, describe, load_config
from cloudseg.engine import StepContext, train_step, windows
from cloudseg.hardware import CUDNN_BENCHMARK_LIMIT, speed_switches
from cloudseg.model import build_model, pad_stem, prepare_for_training
from tests.conftest import write_tiny_checkpoint
from tests.test_accumulation import CPU, Images
from tests.test_compile import EXACT, GPU_UPDATE_RTOL, SMALL, assert_same_state
from tests.test_distributed import train_one_process

CUDA = torch.device("cuda")
# The padded stem's weight gradient sums its 196 terms (4 channels × 7 × 7) where the plain one sums
# 147: in float64 the stem's gradient differs by 5.8e-16 absolute, 4.2e-15 of its largest element
# (measured here, one micro-batch). AdamW divides each gradient by its running root mean square, so
# over the 8 steps of a tiny training run one element of 9,408 moved 6.5e-12 (1.6e-9 relative).
# A defect moves the weights by the learning rate's order (1e-3): these bounds sit between.
ADAMW_RUN = {"rtol": 1e-8, "atol": 1e-11}


def tiny_unet(dtype=torch.float64, channels_last=False):
    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(8, 8, 8)))
    return prepare_for_training(model.to(dtype).train(), channels_last=channels_last, checkpointing="none")


def window_of_two(device=CPU):
    """One window of two micro-batches of 2 images at 64×96 (the test images tiled)."""
    (window,) = windows(DataLoader(Images(4), batch_size=2), 2)
    return [{key: value.repeat(1, 1, 8, 8)[..., :64, :96].to(device) for key, value in batch.items()}
            for batch in window]


def test_the_speedups_are_keys_of_train_off_by_default_and_checked():
    """Would catch: a candidate on by default before a GPU measured it, a key missing from
    `cloudseg config --keys`, and a misspelt value accepted."""
    speedups = load_config(None).train.speedups
    assert (speedups.cudnn_search, speedups.autotune, speedups.pad_stem) == (False, "off", False)
    keys = [line.split(" = ")[0] for line in describe().splitlines() if line.startswith("train.speedups.")]
    assert keys == ["train.speedups.cudnn_search", "train.speedups.autotune", "train.speedups.pad_stem"]
    assert load_config(None, ["train.speedups.autotune=all"]).train.speedups.autotune == "all"
    with pytest.raises(ValueError, match=r"train\.speedups\.autotune"):
        load_config(None, ["train.speedups.autotune=max"])
    with pytest.raises(ValueError, match=r"train\.speedups\.pad: unknown key"):
        load_config(None, ["train.speedups.pad=true"])


@pytest.fixture
def cudnn_restored(monkeypatch):
    for name in ("benchmark", "deterministic", "benchmark_limit"):
        monkeypatch.setattr(torch.backends.cudnn, name, getattr(torch.backends.cudnn, name))
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def test_cudnn_search_times_every_algorithm_on_cuda_and_goes_back_when_off(cudnn_restored):
    """Would catch: the full search left at PyTorch's first 10 algorithms, the limit left at 0 by
    an earlier setting once the key is off (a process that trains twice), and the switch made
    for a CPU run (nothing to search there)."""
    torch.backends.cudnn.benchmark_limit = 7
    speed_switches(CPU, cudnn_search=True)
    assert torch.backends.cudnn.benchmark_limit == 7
    speed_switches(CUDA, cudnn_search=True)
    assert torch.backends.cudnn.benchmark is True and torch.backends.cudnn.benchmark_limit == 0
    speed_switches(CUDA)
    assert torch.backends.cudnn.benchmark_limit == CUDNN_BENCHMARK_LIMIT == 10


def test_inference_lets_cudnn_s_heuristics_pick_and_training_searches(cudnn_restored, monkeypatch, tmp_path):
    """speed_switches for inference on CUDA turns cuDNN's benchmark off, for training on; and the
    commands that predict (load_ensemble: predict and segment; oof) ask for inference. Would
    catch: every new batch shape of a one-scene segment call searched again (1.3-2.1 s on an H200),
    training left without its search, or a command that predicts calling the training switches."""
    from cloudseg import oof, predict

    speed_switches(CUDA, inference=True)
    assert torch.backends.cudnn.benchmark is False
    speed_switches(CUDA)
    assert torch.backends.cudnn.benchmark is True
    asked = []
    for module in (predict, oof):
        monkeypatch.setattr(module, "speed_switches", lambda device, **switches: asked.append(switches))
    checkpoint = write_tiny_checkpoint(tmp_path / "best.pt")
    predict.load_ensemble([str(checkpoint)], "none", device="cpu")
    with pytest.raises(FileNotFoundError):  # the switches come first, then the checkpoint is looked for
        oof.oof_from_checkpoint(tmp_path / "missing.pt", device="cpu")
    assert asked == [{"inference": True}, {"inference": True}]


def test_autotune_reaches_inductor_for_this_compile_only(monkeypatch):
    """Would catch: the autotuning set in inductor's global config (it would leak into test
    prediction's compile and every later one), `all` not torch's max-autotune-no-cudagraphs (CUDA
    graphs would replay the step outside the accumulation's control), `off` passing options, and
    options handed to a backend that takes none (aot_eager raises on them)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: calls.append(kwargs) or function)
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    for autotune in ("off", "reductions", "all"):
        StepContext(torch.nn.Identity(), None, None, CPU, compile=True, autotune=autotune)
    assert [call["options"] for call in calls] == [
        None, {"coordinate_descent_tuning": True}, {"max_autotune": True, "coordinate_descent_tuning": True}]
    assert all(call["backend"] == "inductor" and call["dynamic"] is False for call in calls)
    assert not torch._inductor.config.max_autotune and not torch._inductor.config.coordinate_descent_tuning
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    StepContext(torch.nn.Identity(), None, None, CPU, compile=True, autotune="all")
    assert calls[-1]["options"] is None


def test_the_padded_stem_adds_a_zero_channel_and_a_zero_weight_whose_gradient_is_exactly_zero(monkeypatch):
    """The stem's own convolution as the padded forward calls it: a fourth input channel of zeros,
    a fourth weight slice of zeros, whose gradient is exactly 0 (each term is 0 × an output
    gradient), and the 3-channel output. Would catch: the input or the weight padded with anything
    but zeros (either alone leaves the output as it was: 1 × 0 or 0 × w), another dimension padded."""
    model = tiny_unet()
    stem = pad_stem(model)
    seen = []

    def recorded(x, weight, bias):
        weight.retain_grad()
        seen.append((x, weight))
        return type(stem)._conv_forward(stem, x, weight, bias)

    monkeypatch.setattr(stem, "_conv_forward", recorded)
    x = torch.randn(2, 3, 32, 48, dtype=torch.float64)
    out = stem(x)
    out.square().sum().backward()
    ((padded_x, weight),) = seen
    assert padded_x.shape == (2, 4, 32, 48) and weight.shape == (64, 4, 7, 7)
    assert padded_x[:, 3].abs().max() == 0 and weight[:, 3].abs().max() == 0
    assert weight.grad[:, 3].abs().max() == 0 and weight.grad[:, :3].abs().max() > 0
    torch.testing.assert_close(out, F.conv2d(x, stem.weight, None, stem.stride, stem.padding), **EXACT)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_the_padded_stem_trains_the_same_weights_as_one_graph_and_keeps_three_channels(channels_last, aot_eager):
    """Two compiled windows of AdamW with weight decay (which moves every parameter it holds),
    float64: the padded stem against the plain eager step. Would catch: a padded channel that adds
    to the sums (planted: input padded with 1, weight with 1e-3: the stem's weights 4e-3 off), a
    4-channel weight stored as
    the parameter (checkpoints and the optimizer's state would change shape, and weight decay
    would act on it), a graph break or recompile, and the padding lost by channels_last."""
    def trained(padded, compile):
        model = tiny_unet(channels_last=channels_last)
        if padded:
            pad_stem(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        ctx = StepContext(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), CPU, compile=compile)
        for _ in range(2):
            train_step(ctx, window_of_two())
        return model, optimizer

    (plain, _), (padded, optimizer) = trained(False, compile=False), trained(True, compile=True)
    assert graph_counts() == (1, 0)
    assert padded.state_dict()["unet.encoder.conv1.weight"].shape == (64, 3, 7, 7)
    assert optimizer.state[padded.unet.encoder.conv1.weight]["exp_avg"].shape == (64, 3, 7, 7)
    assert_same_state(plain.state_dict(), padded.state_dict())
    pad_stem(padded, on=False)
    assert "forward" not in vars(padded.unet.encoder.conv1)


def test_cloudseg_train_with_every_speedup_trains_the_default_run_s_checkpoint(data_copy, tmp_path, aot_eager):
    """The keys wired through `cloudseg train` (compiled, two epochs, float64, AdamW): every
    candidate on against none (within ADAMW_RUN). Would catch: a key that changes the update, a
    checkpoint whose stem is saved with 4 channels, and a key that breaks the compiled graph."""
    options = [f"data.dir={data_copy}", *SMALL]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "default")
    torch._dynamo.reset()
    train_one_process(load_config("configs/demo.yaml", [*options, "train.compile=true", "train.speedups.pad_stem=true",
                                                        "train.speedups.cudnn_search=true",
                                                        "train.speedups.autotune=reductions"]), tmp_path / "speedups")
    assert graph_counts() == (1, 0)
    default, speedups = (load_checkpoint(tmp_path / name / "last.pt") for name in ("default", "speedups"))
    assert speedups["config"]["train"]["speedups"] == {"cudnn_search": True, "autotune": "reductions", "pad_stem": True}
    assert speedups["model"]["unet.encoder.conv1.weight"].shape == (64, 3, 7, 7)
    assert_same_state(default["model"], speedups["model"], **ADAMW_RUN)


@pytest.mark.slow  # inductor generates and compiles C++ for the tiny UNet's step, twice (minutes on 2 cores)
@pytest.mark.parametrize("autotune", ["reductions", "all"])
def test_inductor_with_autotuning_trains_what_the_default_compile_trains(autotune, monkeypatch):
    """With the real backend: autotuning compiles one graph without a break, and trains what
    inductor without it trains (float64, one AdamW window with the padded stem; on the CPU max
    autotune has no convolution templates to try, so this checks the path, not the GPU's picks).
    Would catch: an option inductor refuses, a graph break under it, the options left in inductor's
    global config afterwards."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "BACKEND", "inductor")

    def trained(setting):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_unet()
        pad_stem(model)
        ctx = StepContext(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
                          torch.amp.GradScaler("cpu", enabled=False), CPU, compile=True, autotune=setting)
        train_step(ctx, window_of_two())
        return model.state_dict(), graph_counts()

    try:
        (default, _), (tuned, counts) = trained("off"), trained(autotune)
    finally:
        torch._dynamo.reset()
    assert counts == (1, 0)
    assert not torch._inductor.config.max_autotune and not torch._inductor.config.coordinate_descent_tuning
    assert_same_state(default, tuned, rtol=1e-8, atol=1e-11)


@pytest.mark.gpu  # skipped without CUDA
@pytest.mark.slow  # make test-gpu-all: inductor compiles Triton kernels for each candidate (minutes)
@pytest.mark.parametrize("candidate", ["cudnn_search", "autotune=reductions", "autotune=all", "pad_stem"])
def test_on_a_gpu_each_speedup_trains_what_the_default_compiled_step_trains(candidate, cudnn_restored):
    """float64 SGD, one window, compiled with inductor: the update with the candidate against the
    update without it, relative to its size (GPU_UPDATE_RTOL, tests/test_compile.py: other
    summation orders than the CPU's); then in bf16 the step is still one graph. cudnn_search's run
    comes first, but where an earlier test in the process ran these shapes cuDNN keeps that pick
    (for the process's life): then only the switch's path is checked, not a new algorithm.
    Would catch: a candidate that changes the update on the GPU beyond summation order (a
    template in a lower precision), a graph break or recompile only CUDA shows."""
    from torch._dynamo.utils import counters

    key, _, value = candidate.partition("=")
    setting = {key: value or True}

    def update(speedups, dtype, model_dtype):
        torch._dynamo.reset()
        counters.clear()
        speed_switches(CUDA, cudnn_search=speedups.get("cudnn_search", False))
        model = tiny_unet(model_dtype, channels_last=True).to(CUDA)
        pad_stem(model, speedups.get("pad_stem", False))
        before = {name: value.clone() for name, value in model.state_dict().items()}
        ctx = StepContext(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cuda", enabled=False),
                          CUDA, dtype, compile=True, autotune=speedups.get("autotune", "off"))
        train_step(ctx, window_of_two(CUDA))
        assert graph_counts() == (1, 0)
        return {name: value - before[name] for name, value in model.state_dict().items() if value.is_floating_point()}

    try:
        with_it, without = update(setting, None, torch.float64), update({}, None, torch.float64)
        difference = torch.cat([(with_it[name] - without[name]).flatten() for name in without]).norm()
        size = torch.cat([value.flatten() for value in without.values()]).norm()
        assert difference <= GPU_UPDATE_RTOL * size, f"{candidate}: {float(difference):.3g} of {float(size):.3g}"
        update(setting, torch.bfloat16, torch.float32)
    finally:
        torch._dynamo.reset()
