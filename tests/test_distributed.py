"""torchrun DDP: two gloo processes on the CPU train the same model as one process with the
same effective batch."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from cloudseg import distributed
from cloudseg.checkpoint import load_checkpoint
from cloudseg.config import load_config
from cloudseg.data import EpochSampler
from cloudseg.model import NORM_STATISTICS
from cloudseg.engine import windows
from cloudseg.train import train
from tests.conftest import TINY, named

# 24 images in 4 folds: 18 train in windows of 8, 8 and 2. With 2 processes each takes 2
# micro-batches of 2 per window (so no_sync runs), and in the last window one process gets
# the 2 images and the other joins with a weightless blank image.
OPTIONS = [*TINY, "data.n_folds=4", "train.device=cpu", "train.effective_batch=8"]
TORCHRUN = [sys.executable, "-m", "cloudseg.distributed", "--standalone", "--nproc_per_node", "2",
            str(Path(__file__).with_name("ddp_entry.py"))]


def torchrun_train(out, options, plant=()):
    """Two processes in float64 (see ddp_entry.py)."""
    command = [*TORCHRUN, *plant, "train", "-c", "configs/demo.yaml", "--out", str(out), *options]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def train_one_process(config, out):
    """One process in float64, as the two of `torchrun_train`."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)  # as torchrun sets for each process
    torch.set_default_dtype(torch.float64)
    try:
        train(config, out)
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


def test_each_rank_gets_whole_micro_batches_of_the_single_process_order():
    one = list(EpochSampler(11, seed=0))
    ranks = [list(EpochSampler(11, seed=0, window=4, chunk=2, rank=r, world=2)) for r in range(2)]
    micro_batches = [one[i : i + 2] for i in range(0, 11, 2)]  # windows of 4: [mb0 mb1] [mb2 mb3] [mb4 mb5]
    assert ranks[0] == micro_batches[0] + micro_batches[2] + micro_batches[4]
    assert ranks[1] == micro_batches[1] + micro_batches[3] + micro_batches[5]
    assert sorted(ranks[0] + ranks[1]) == sorted(one)


def test_a_resumed_epoch_shards_from_the_same_position():
    sampler = EpochSampler(11, seed=0, window=4, chunk=2, rank=1, world=2)
    sampler.set_epoch(3, start=4)
    full = EpochSampler(11, seed=0)
    full.set_epoch(3)
    assert list(sampler) == [list(full)[i] for i in (6, 7, 10)]


def test_every_rank_takes_part_in_every_window():
    assert list(windows([1, 2, 3], 2, count=3)) == [[1, 2], [3], []]
    assert list(windows([1, 2, 3], 2)) == [[1, 2], [3]]


def test_accumulation_keeps_the_effective_batch_across_processes():
    config = load_config("configs/demo.yaml", ["train.micro_batch=2", "train.effective_batch=8"])
    assert [config.train.accumulation_for(world) for world in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match=r"effective_batch \(8\) must be a multiple of train.micro_batch x processes \(2 x 3\)"):
        config.train.accumulation_for(3)


# with the head: 77 s on 2 cores, make test-all (make test keeps the comparison without it)
@pytest.mark.parametrize("head", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no-head", "cls-head"])
def test_two_processes_train_the_same_parameters_and_statistics_as_one(data_copy, tmp_path, head):
    """Would catch: gradients summed instead of averaged, a window cut differently on the
    ranks, BatchNorm statistics left per rank (each rank's own micro-batches) or copied from
    rank 0, and validation scoring each shard with a different model; with model.cls_head, the
    head's loss weighted otherwise on several processes (the last window's blank image
    included). Both sides run in float64: in float32 the other order of summing four
    micro-batch gradients flips the sign of Adam's first step on near-zero gradients, and the
    runs drift apart by about 1%."""
    options = [f"data.dir={data_copy}", *OPTIONS, f"model.cls_head={str(head).lower()}"]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "one")
    torchrun_train(tmp_path / "two", options)
    assert "2 process(es) x 2 micro-batches of 2 per step" in (tmp_path / "two/train.log").read_text()

    one, two = load_checkpoint(tmp_path / "one/last.pt"), load_checkpoint(tmp_path / "two/last.pt")
    assert one["step"] == two["step"] == 6  # 2 epochs of ceil(18 / 8) windows
    assert set(one["model"]) == set(two["model"])
    assert any(name.startswith("unet.classification_head.") for name in one["model"]) is head
    statistics = [name for name in one["model"] if name.rsplit(".", 1)[-1] in NORM_STATISTICS]
    assert statistics  # the demo model has BatchNorm: its buffers are compared too
    for name, tensor in one["model"].items():
        assert tensor.dtype in (torch.float64, torch.int64), name
        # With the head, running means near 0 come out ~1e-11 apart (float64 sums in another
        # order); the planted bugs below move parameters by more than 1e-4.
        torch.testing.assert_close(two["model"][name], tensor, rtol=1e-9, atol=1e-10 if head else 1e-12, msg=named(name))
    a, b = pd.read_csv(tmp_path / "one/metrics.csv"), pd.read_csv(tmp_path / "two/metrics.csv")
    assert b["train_loss"].tolist() == pytest.approx(a["train_loss"].tolist(), rel=1e-9)
    assert b["dice"].tolist() == pytest.approx(a["dice"].tolist(), abs=1e-9)  # validation saw one model
    assert b["valid_loss"].tolist() == pytest.approx(a["valid_loss"].tolist(), rel=1e-6)
    assert {"best.pt", "oof.npz", "config.yaml"} <= {p.name for p in (tmp_path / "two").iterdir()}


@pytest.mark.slow  # 65 s on 2 cores, as the SWA test below: make test-all (make test keeps the main comparison)
def test_two_processes_measure_the_ema_s_batchnorm_statistics_as_one(data_copy, tmp_path):
    """train.ema measures the average's statistics again before each validation, its 9 training
    micro-batches shared by two processes (5 and 4) and pooled. Would catch: each rank keeping
    the statistics of its own micro-batches, the ranks' means pooled unweighted (5 against 4
    micro-batches), or the images dealt one by one (other micro-batches than one process's)."""
    options = [f"data.dir={data_copy}", *OPTIONS, "train.epochs=1", "train.ema=0.5"]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "one")
    torchrun_train(tmp_path / "two", options)
    one, two = load_checkpoint(tmp_path / "one/last.pt")["model"], load_checkpoint(tmp_path / "two/last.pt")["model"]
    statistics = [name for name in one if name.rsplit(".", 1)[-1] in NORM_STATISTICS]
    assert statistics
    for name in statistics:
        torch.testing.assert_close(two[name], one[name], rtol=1e-9, atol=1e-12, msg=named(name))


@pytest.mark.slow
def test_swa_after_two_processes_is_the_swa_after_one(data_copy, tmp_path):
    """train.swa=2 under torchrun: rank 0 averages the epochs the processes trained together and
    measures BatchNorm again in one process, so best.pt equals the one-process run's. Would
    catch: the average taken from one rank's unsynchronized weights, statistics left per rank,
    or a rank that waits on another while rank 0 averages (the launch would hang)."""
    options = [f"data.dir={data_copy}", *OPTIONS, "train.swa=2"]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "one")
    torchrun_train(tmp_path / "two", options)
    one, two = load_checkpoint(tmp_path / "one/best.pt"), load_checkpoint(tmp_path / "two/best.pt")
    assert one["swa"]["epochs"] == two["swa"]["epochs"] == [1, 2]
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, rtol=1e-9, atol=1e-12, msg=named(name))


@pytest.mark.parametrize("rank, expected", [(0, [0, 1, 2, 6, 7, 8]), (1, [3, 4, 5, 9])])
def test_whole_batches_are_dealt_to_the_processes_in_turn(monkeypatch, rank, expected):
    """10 items in batches of 3 over 2 processes: batches [0-2], [3-5], [6-8], [9] go to ranks
    0, 1, 0, 1. Would catch: items dealt one by one, or a last short batch lost."""
    monkeypatch.setattr(distributed, "rank", lambda: rank)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert distributed.shard_batches(10, 3) == expected


@pytest.mark.slow  # the control of the test above (65 s on 2 cores): it proves that test can fail, not the code
def test_the_test_can_fail_syncing_the_first_micro_batch_instead_of_the_last(data_copy, tmp_path):
    """A control: with the all-reduce on the window's first micro-batch, the last micro-batch's
    gradient stays on its rank, and the comparison above sees it."""
    options = [f"data.dir={data_copy}", *OPTIONS, "train.epochs=1"]
    train_one_process(load_config("configs/demo.yaml", options), tmp_path / "one")
    torchrun_train(tmp_path / "two", options, plant=["--plant-first-sync"])
    one, two = load_checkpoint(tmp_path / "one/last.pt")["model"], load_checkpoint(tmp_path / "two/last.pt")["model"]
    name = "unet.segmentation_head.0.weight"
    assert (one[name] - two[name]).abs().max() > 1e-4  # far beyond the 1e-9 of the comparison above


def test_the_test_can_fail_a_different_effective_batch_trains_other_parameters(data_copy, tmp_path):
    """The comparison above is sharp: one process with half the effective batch differs."""
    options = [f"data.dir={data_copy}", *OPTIONS, "train.epochs=1"]
    train(load_config("configs/demo.yaml", options), tmp_path / "four")
    train(load_config("configs/demo.yaml", [*options, "train.effective_batch=2"]), tmp_path / "two")
    four, two = load_checkpoint(tmp_path / "four/last.pt")["model"], load_checkpoint(tmp_path / "two/last.pt")["model"]
    name = "unet.segmentation_head.0.weight"
    assert (four[name] - two[name]).abs().max() > 1e-3


def test_a_failing_process_ends_the_launch_in_one_line_without_torchrun_s_traceback(tmp_path):
    """CPU, two processes of a script that prints its error and exits 3 (as cloudseg does with a
    user error). Would catch: torchrun's ChildFailedError traceback reaching the user after the
    error (`make train NPROC=2` on a machine without GPUs printed one), or the exit code lost."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('cloudseg: error: the reason', file=sys.stderr)\nsys.exit(3)\n")
    result = subprocess.run([*TORCHRUN[:-1], str(script)], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 3
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    # Each rank prints it, unless torchrun stops the second when the first has failed before it got
    # there (seen once in a fresh clone's CI, 2026-11-26: one line, "2 process(es) failed").
    assert result.stderr.count("cloudseg: error: the reason") in (1, 2)
    assert result.stderr.strip().splitlines()[-1].startswith("torchrun: 2 process(es) failed, first rank ")
    assert result.stderr.strip().endswith("with exit code 3: its error is above")


@pytest.mark.parametrize("cards, local_rank, share, expected", [
    (1, 1, True, ("cuda:0", "gloo")),  # segment: two processes on one GPU
    (2, 1, True, ("cuda:1", "gloo")),
    (2, 2, True, ("cuda:0", "gloo")),  # the third of three on two GPUs: they take the GPUs in turn
    (2, 1, False, ("cuda:1", "nccl")),  # training: one process per GPU
    (1, 1, False, RuntimeError),  # training: a second process on one GPU fails, as torch fails it
])
def test_processes_take_the_gpus_in_turn_where_they_share_them(fake_cuda, monkeypatch, cards, local_rank, share,
                                                                expected):
    """CPU, a fake machine of one or two H100s, the process group not started (its backend
    recorded). Would catch: segment's second process on a one-GPU machine given GPU 1 (torch
    refuses it), NCCL for processes sharing a GPU (it refuses two on one), the GPU not made
    current, and training's one process per GPU changed."""
    from tests.fake_cuda import H100

    fake_cuda(*[H100] * cards)
    backends = []
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend: backends.append(backend))
    if expected is RuntimeError:
        with pytest.raises(RuntimeError):
            distributed.start(torch.device("cuda", 0), share_gpus=share)
        return
    device = distributed.start(torch.device("cuda", 0), share_gpus=share)
    assert (str(device), backends[0]) == expected and torch.cuda.current_device() == device.index


def test_segment_s_processes_share_the_gpus(fake_cuda, monkeypatch):
    """CPU, a fake one-GPU machine, segment's process 1 of 2. Would catch: segment joining as
    training does (one process per GPU: GPU 1, which is not there)."""
    from cloudseg.segment import process_device
    from tests.fake_cuda import H100

    fake_cuda(H100)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend: None)
    assert process_device("cuda") == torch.device("cuda", 0)
