"""train.compile: each micro-batch's forward and loss as one torch.compile graph, with the same
exactness as the eager step (engine.py, compiled.py). On the CPU most tests use the aot_eager
backend (the same graph capture and AOTAutograd, no code generation); one trains with the
default inductor backend, and one runs on a CUDA GPU where there is one."""

import importlib.util
import logging
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from cloudseg import compiled, engine
from cloudseg import predict as predict_module
from cloudseg.checkpoint import load_checkpoint
from cloudseg.cli import main
from cloudseg.compiled import compile_logged, graph_counts, resolve_compile
from cloudseg.config import ModelConfig, load_config
from cloudseg.engine import StepContext, micro_batch_losses, resilient_step, train_step, windows
from cloudseg.model import build_model, prepare_for_training
from cloudseg.train import train
from tests.conftest import TINY, named
from tests.test_accumulation import CPU, Images
from tests.test_distributed import OPTIONS as DDP_OPTIONS, torchrun_train, train_one_process
from tests.test_norm_statistics import NormNet

# A shallow resnet18 UNet (encoder depth 3) compiles in seconds; it has 13 BatchNorm layers.
SMALL = [*TINY, "train.device=cpu", "model.encoder=resnet18", "model.decoder_channels=[8,8,8]"]
EXACT = {"rtol": 1e-9, "atol": 1e-12}  # float64; what differs is the order of a few sums


def assert_same_state(one: dict, other: dict, **tolerance):
    """Every parameter and buffer (BatchNorm statistics included) of two state dicts."""
    assert one.keys() == other.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(other[name], tensor, **(tolerance or EXACT), msg=named(name))


def test_auto_compiles_with_cuda_only(monkeypatch, caplog):
    """Would catch: auto compiling on a CPU (minutes of compiling for a demo) or on a GPU without
    Triton (inductor would fail in the first window), true/false ignored, a message that names
    the wrong key, and predict.compile taking values train.compile refuses."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [resolve_compile(setting, cpu) for setting in ("auto", True, False)] == [False, True, False]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert [resolve_compile(setting, cuda) for setting in ("auto", True, False)] == [True, True, False]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert [resolve_compile(setting, cuda) for setting in ("auto", True, False)] == [False, True, False]
    with caplog.at_level(logging.INFO, logger="cloudseg"):
        assert resolve_compile("auto", cuda, "predict.compile") is False
    assert "predict.compile=auto: not compiling, Triton is not installed" in caplog.text
    for key in ("train.compile", "predict.compile"):
        assert getattr(load_config(None, [f"{key}=true"]), key.split(".")[0]).compile is True
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}=sometimes"])


def test_a_compiled_run_is_one_graph_without_breaks_and_trains_what_eager_trains(data_copy, tmp_path, aot_eager,
                                                                               caplog):
    """Would catch: a graph break (a Python float of a tensor in BatchNorm, as momentum=None
    gives), a recompile after the first window (validation's eval mode, a new epoch), the
    compile time logged more than once, and compiled windows that train other weights or
    BatchNorm statistics than eager ones (float64, 2 epochs of 4 windows)."""
    caplog.set_level(logging.INFO, logger="cloudseg")
    options = [f"data.dir={data_copy}", *SMALL]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "eager")
    assert graph_counts() == (0, 0)
    train_one_process(load_config("configs/demo.yaml", [*options, "train.compile=true"]), tmp_path / "compiled")
    assert graph_counts() == (1, 0)  # one micro-batch shape: one graph, in the first window
    assert caplog.text.count("torch.compile: micro-batches of shape [2, 3, 64, 96]: 1 graph(s) compiled, "
                             "0 graph break(s)") == 1
    eager, compiled_run = (load_checkpoint(tmp_path / name / "last.pt") for name in ("eager", "compiled"))
    assert eager["step"] == compiled_run["step"] == 8
    assert_same_state(eager["model"], compiled_run["model"])


def test_the_test_can_fail_momentum_none_breaks_the_graph_and_the_log_says_so(aot_eager, caplog):
    """The counter above sees graph breaks: BatchNorm with momentum=None (the engine's old
    cumulative average) computes 1 / float(num_batches_tracked) in the model. Would also catch
    a graph break that one process does not warn about."""
    net = NormNet(momentum=None).double().train()
    batch = next(iter(DataLoader(Images(2), batch_size=2)))
    with compile_logged(True, batch["image"].shape):
        compiled.compiled(micro_batch_losses)(net, batch["image"], batch["mask"], None, 1.0)
    assert graph_counts()[1] > 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "cloudseg" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "graph breaks in the micro-batches" in warnings[0] and "item()" in warnings[0]


@pytest.mark.parametrize("mode", ["encoder", "full"])
def test_compiled_checkpointing_gives_the_eager_step_without_it(mode, aot_eager):
    """Would catch: torch.compile refusing the checkpoint's context_fn, BatchNorm statistics
    taken twice (the compiled recomputation writes them again) or not at all, and gradients
    that differ once blocks are recomputed inside a graph (float64, one AdamW step)."""
    def stepped(checkpointing, compile):
        torch.manual_seed(0)
        model = build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(8, 8, 8)))
        model = prepare_for_training(model.double().train(), channels_last=False, checkpointing=checkpointing)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx = StepContext(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), CPU, compile=compile)
        (window,) = windows(DataLoader(Images(4), batch_size=2), 2)
        train_step(ctx, [{key: value.repeat(1, 1, 8, 8)[..., :64, :96] for key, value in batch.items()}
                         for batch in window])
        return model.state_dict()

    assert_same_state(stepped("none", compile=False), stepped(mode, compile=True))
    assert graph_counts() == (1, 0)


def test_out_of_memory_retry_compiles_the_halved_micro_batch_and_redoes_the_window_exactly(aot_eager, monkeypatch,
                                                                                        caplog):
    """Would catch: a compiled retry that keeps the failed attempt's gradients or BatchNorm
    statistics, or that does not compile the new shape (one graph per micro-batch shape)."""
    caplog.set_level(logging.INFO, logger="cloudseg")

    def stepped(micro_batch, compile):
        torch.manual_seed(0)
        net = NormNet().double().train()
        ctx = StepContext(net, torch.optim.SGD(net.parameters(), lr=0.5), torch.amp.GradScaler("cpu", enabled=False),
                          CPU, compile=compile)
        for window in windows(DataLoader(Images(8), batch_size=4), 2):
            micro_batch = resilient_step(ctx, window, micro_batch)[1]
        return net.state_dict(), micro_batch

    reference, _ = stepped(1, compile=False)
    real_decode, calls = engine.decode_batch, []

    def out_of_memory_once(batch, device):  # the second micro-batch of 2 fails, after the first one ran
        calls.append(len(batch["image"]))
        if calls == [2, 2]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_decode(batch, device)

    monkeypatch.setattr(engine, "decode_batch", out_of_memory_once)
    recovered, micro_batch = stepped(2, compile=True)
    assert micro_batch == 1
    assert_same_state(reference, recovered)
    assert graph_counts() == (2, 0)  # micro-batches of 2, then of 1
    assert "micro-batches of shape [1, 3, 8, 10]: 1 graph(s) compiled" in caplog.text


def modules_inlined() -> bool:
    """Whether dynamo traces nn.Modules' forward as plain code, so that models of one architecture
    share a graph: the default of recent torch, where the flag is deprecated because it always
    holds; older torch guarded on each module's identity."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True)


def test_predict_compiles_one_graph_for_every_batch_and_predicts_what_eager_predicts(data_copy, tmp_path, aot_eager,
                                                                                    monkeypatch, caplog):
    """6 test images in batches of 4, an ensemble of one checkpoint twice: the short last batch is
    padded, and both models share the graph. Would catch: a second graph for the short batch (no
    padding) or for the second model, the padding's probabilities reaching the submission, a
    compiled forward that predicts otherwise than eager, and predict.compile ignored."""
    caplog.set_level(logging.INFO, logger="cloudseg")
    run = tmp_path / "run"
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data_copy}", *SMALL,
                 "train.epochs=1"]) == 0
    real_apply_rule, probabilities = predict_module.apply_rule, []
    monkeypatch.setattr(predict_module, "apply_rule",
                        lambda probs, *args: probabilities.append(probs) or real_apply_rule(probs, *args))

    def predicted(compile):
        probabilities.clear()
        out = tmp_path / f"compile-{compile}.csv"
        assert main(["predict", "--checkpoint", str(run / "best.pt"), "--checkpoint", str(run / "best.pt"),
                     "--out", str(out), "--device", "cpu", "--postprocess", "none", "predict.batch_size=4",
                     f"predict.compile={compile}"]) == 0
        return pd.read_csv(out), [len(probs) for probs in probabilities], np.concatenate(probabilities)

    eager, compiled_run = predicted(False), predicted(True)
    graphs = 1 if modules_inlined() else 2  # else a graph per model
    assert graph_counts() == (graphs, 0)
    assert f"prediction batches of shape [4, 3, 64, 96]: {graphs} graph(s) compiled" in caplog.text
    assert eager[1] == compiled_run[1] == [4, 2]
    np.testing.assert_allclose(compiled_run[2], eager[2], rtol=0, atol=1e-6)
    assert list(compiled_run[0]["Image_Label"]) == list(eager[0]["Image_Label"])


def test_predict_loads_the_model_in_the_memory_format_it_trained_in(data_copy, tmp_path):
    """Would catch: prediction ignoring train.channels_last (NCHW convolutions on a GPU whose
    fast kernels are NHWC), or forcing it on a model trained without it."""
    for channels_last in (True, False):
        run = tmp_path / f"channels_last-{channels_last}"
        train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *SMALL, "train.epochs=1",
                                                f"train.channels_last={channels_last}"]), run)
        model, _ = predict_module.load_model(run / "best.pt", torch.device("cpu"))
        weight = model.unet.encoder.conv1.weight
        assert weight.is_contiguous(memory_format=torch.channels_last) is channels_last
        assert model.channels_last is channels_last


@pytest.mark.slow  # two torchrun processes compiling, and one process training in float64 (~3 min here)
def test_two_compiled_processes_train_what_one_eager_process_trains(data_copy, tmp_path):
    """Would catch: under DDP, a compiled step that syncs on the wrong micro-batch or not at all,
    BatchNorm statistics not pooled over the ranks, or the blank batch's statistics counted."""
    options = [f"data.dir={data_copy}", *DDP_OPTIONS, "model.encoder=resnet18", "model.decoder_channels=[8,8,8,8,8]"]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "one")
    torchrun_train(tmp_path / "two", [*options, "train.compile=true"], plant=["--compile-backend", "aot_eager"])
    log = (tmp_path / "two/train.log").read_text()
    assert "torch.compile: micro-batches of shape [2, 3, 64, 96]" in log
    one, two = load_checkpoint(tmp_path / "one/last.pt"), load_checkpoint(tmp_path / "two/last.pt")
    assert one["step"] == two["step"] == 6
    assert_same_state(one["model"], two["model"])


@pytest.mark.slow  # inductor generates and compiles C++ for the forward and the backward (minutes on 2 cores)
def test_cloudseg_train_compiles_with_inductor_on_the_cpu_without_a_graph_break(data_copy, tmp_path, caplog):
    """Would catch: code that only aot_eager accepts, a graph break under the real backend, and
    generated kernels whose sums drift from eager beyond 1e-8 relative in float64 after an epoch
    (measured here: 2.6e-13 absolute, 4.5e-10 relative at worst; the vector width of the CPU
    changes inductor's summation order, hence the margin)."""
    assert compiled.BACKEND == "inductor"
    caplog.set_level(logging.INFO, logger="cloudseg")
    options = [f"data.dir={data_copy}", *SMALL, "train.epochs=1", "model.decoder_channels=[8,8]"]
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "eager"), *options]) == 0
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(tmp_path / "compiled"), *options,
                     "train.compile=true"]) == 0
    finally:
        torch.set_default_dtype(dtype)
        torch._dynamo.reset()
    assert "1 graph(s) compiled, 0 graph break(s)" in caplog.text and "graph breaks" not in caplog.text
    eager, compiled_run = (load_checkpoint(tmp_path / name / "last.pt")["model"] for name in ("eager", "compiled"))
    assert_same_state(eager, compiled_run, rtol=1e-8, atol=1e-11)


# Compiled against eager on a GPU, float64: the update (new weights less old ones, over all tensors)
# may differ by this share of its own size. Measured on an H100 (torch 2.11, 2026-11-25, before the
# loss's float64 target): with SGD, whose update is lr x gradient, 1.4e-9 at most in absolute terms;
# eager against eager 1e-14. AdamW is left out: it divides by each gradient's root mean square, so
# gradients near 0 turn summation-order noise into differences of lr itself (3.9e-8, 8 of 132
# tensors). A defect (a micro-batch weighted wrongly, a gradient lost) moves the update by 1e-3 of
# its size or more: 1e-6 sits three orders of magnitude from each.
GPU_UPDATE_RTOL = 1e-6


@pytest.mark.gpu  # skipped without CUDA
@pytest.mark.slow  # make test-gpu-all: inductor compiles Triton kernels, a minute or two
def test_on_a_gpu_the_compiled_step_has_no_graph_break_and_trains_what_eager_trains():
    """Would catch: a graph break or a recompile that only CUDA shows (cuDNN, autocast,
    channels_last), and inductor's GPU kernels training other weights than eager (float64 SGD,
    two windows of two micro-batches; the update compared relative to its size, as
    GPU_UPDATE_RTOL explains: other summation orders than the CPU's)."""
    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    batches = [{key: value.repeat(1, 1, 8, 8)[..., :64, :96].to(device) for key, value in batch.items()}
               for batch in DataLoader(Images(8), batch_size=2)]

    def trained(compile, dtype, model_dtype):
        torch.manual_seed(0)
        model = build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(8, 8, 8)))
        model = prepare_for_training(model.to(device, model_dtype).train(), channels_last=True, checkpointing="none")
        before = {name: value.clone() for name, value in model.state_dict().items()}
        ctx = StepContext(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.amp.GradScaler("cuda", enabled=dtype == torch.float16), device, dtype, compile=compile)
        for window in (batches[:2], batches[2:]):
            train_step(ctx, window)
        return {name: value - before[name] for name, value in model.state_dict().items() if value.is_floating_point()}

    torch._dynamo.reset()
    counters.clear()
    try:
        eager, compiled_run = trained(False, None, torch.float64), trained(True, None, torch.float64)
        assert graph_counts() == (1, 0)
        difference = torch.cat([(eager[name] - compiled_run[name]).flatten() for name in eager]).norm()
        size = torch.cat([update.flatten() for update in eager.values()]).norm()
        worst = max(eager, key=lambda name: float((eager[name] - compiled_run[name]).abs().max()))
        assert difference <= GPU_UPDATE_RTOL * size, (
            f"compiled update {float(difference):.3g} from eager's of size {float(size):.3g} (allowed "
            f"{GPU_UPDATE_RTOL:g} of it); most in {worst}: {float((eager[worst] - compiled_run[worst]).abs().max()):.3g}")
        counters.clear()
        trained(True, torch.bfloat16, torch.float32)
        assert graph_counts() == (1, 0)
    finally:
        torch._dynamo.reset()
