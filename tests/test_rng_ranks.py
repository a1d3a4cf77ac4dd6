"""Each process's CUDA random state in the checkpoint, and resuming on another number of GPUs.

All on the CPU, through the strict fake of tests/fake_cuda.py: its cards keep one generator
state each (16 bytes, as CUDA's Philox generator), refuse an index past the last card with the
IndexError torch raises, and `torch.manual_seed` seeds them all. The devices meant are fake
GPUs (cuda:0, cuda:1); no tensor leaves the CPU.
"""

import pytest
import torch

from cloudseg import distributed
from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint, restore_rng_states, rng_states, save_checkpoint
from tests.fake_cuda import H100, philox_state

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def saved_by_two_ranks(tmp_path, fake_cuda, moved: bool):
    """A checkpoint as a two-process run on cuda:0 and cuda:1 saves it: each rank's own GPU's
    state (moved on by dropout when `moved`), gathered in rank order. Returns its "rng"."""
    cuda = fake_cuda(H100, H100)
    torch.manual_seed(7)
    if moved:
        cuda.cards[0].rng, cuda.cards[1].rng = philox_state(7, 40), philox_state(7, 56)
    states = {rank: torch.cuda.get_rng_state(device) for rank, device in enumerate((GPU0, GPU1))}
    save_checkpoint(tmp_path / "last.pt", {"model": {}, "config": {}, "epoch": 1, "step": 4,
                                           "rng": rng_states([states[0], states[1]])})
    return load_checkpoint(tmp_path / "last.pt")["rng"]


def test_every_rank_saves_its_own_gpu_s_state_in_rank_order(fake_cuda, monkeypatch):
    """What train saves at an epoch's end, as rank 1 of 2 on cuda:1 sees it (the gather faked:
    rank 0's state first). Would catch: rank 0's get_rng_state_all() saved for every GPU (so
    until issue #22), or this rank's state saved in rank 0's place."""
    cuda = fake_cuda(H100, H100)
    cuda.cards[0].rng, cuda.cards[1].rng = philox_state(1, 8), philox_state(1, 24)
    rank0_state = philox_state(1, 16)  # rank 0's own GPU, cuda:0 of its machine
    monkeypatch.setattr(distributed, "gathered", lambda items: [rank0_state, *items])
    saved = train_module.every_rank_rng_states(GPU1)
    assert "cuda" not in saved
    assert [state.tolist() for state in saved["cuda_by_rank"]] == [rank0_state.tolist(), philox_state(1, 24).tolist()]


def test_each_rank_restores_its_own_state_onto_its_own_gpu(tmp_path, fake_cuda):
    """Resumed with the same two processes: rank 1 on cuda:1 continues rank 1's stream, and no
    other GPU's generator is touched. Would catch: set_rng_state_all of rank 0's list on every
    rank (rank 1 would get rank 0's generator 1), or rank 0's state given to rank 1."""
    rng = saved_by_two_ranks(tmp_path, fake_cuda, moved=True)
    cuda = fake_cuda(H100, H100)
    torch.manual_seed(7)
    restore_rng_states(rng, GPU1, rank=1, world=2, fresh_cuda=torch.cuda.get_rng_state(GPU1))
    assert torch.equal(cuda.cards[1].rng, philox_state(7, 56))
    assert torch.equal(cuda.cards[0].rng, philox_state(7))  # untouched
    assert [call for call in cuda.calls if call[0] == "set_rng_state"] == [("set_rng_state", 1)]


def test_resuming_on_fewer_gpus_continues_from_the_seed_where_no_stream_moved(tmp_path, fake_cuda):
    """Saved by two processes whose GPU streams never moved (no dropout), resumed by one on a
    machine with one GPU: exact, from the seeded state. Would catch: the IndexError of
    set_rng_state_all with two states and one card (so until issue #22)."""
    rng = saved_by_two_ranks(tmp_path, fake_cuda, moved=False)
    cuda = fake_cuda(H100)
    torch.manual_seed(7)
    cuda.cards[0].rng = philox_state(99)  # whatever it holds now: the restore must set the seeded one
    restore_rng_states(rng, GPU0, rank=0, world=1, fresh_cuda=philox_state(7))
    assert torch.equal(cuda.cards[0].rng, philox_state(7))


def test_resuming_moved_streams_on_another_number_of_gpus_is_refused_in_one_line(tmp_path, fake_cuda):
    """Saved by two processes whose streams moved, resumed by one: the streams cannot be dealt
    out again, so it refuses, naming the file and the number to resume with, before any
    state is set. Would catch: rank 0's stream continued silently (dropout masks differ from an
    uninterrupted run) or an IndexError."""
    rng = saved_by_two_ranks(tmp_path, fake_cuda, moved=True)
    cuda = fake_cuda(H100)
    torch.manual_seed(7)
    python_before = rng_states()["python"]
    with pytest.raises(ValueError, match=r"runs/x/last.pt: saved by 2 process\(es\).*NPROC=2") as error:
        restore_rng_states(rng, GPU0, rank=0, world=1, fresh_cuda=philox_state(7), where="runs/x/last.pt")
    assert "\n" not in str(error.value)
    assert rng_states()["python"] == python_before and torch.equal(cuda.cards[0].rng, philox_state(7))


def test_a_checkpoint_from_before_per_rank_states_resumes_on_one_gpu(tmp_path, fake_cuda):
    """An older checkpoint holds rank 0's states of every visible GPU under "cuda" (two here),
    resumed on a machine with one: cuda:0 takes its own entry. Would catch: the IndexError of
    set_rng_state_all past the last card."""
    cuda = fake_cuda(H100, H100)
    torch.manual_seed(5)
    old = rng_states()
    old["cuda"] = [philox_state(5, 32), philox_state(5, 48)]
    cuda = fake_cuda(H100)
    restore_rng_states(old, GPU0, rank=0, world=1, fresh_cuda=philox_state(5))
    assert torch.equal(cuda.cards[0].rng, philox_state(5, 32))


def test_a_cpu_run_saves_and_restores_no_cuda_state(fake_cuda):
    """On the CPU nothing of CUDA is read or set, even where a GPU is visible. Would catch:
    the CUDA states saved whenever torch.cuda.is_available() (so until issue #22)."""
    cuda = fake_cuda(H100)
    saved = train_module.every_rank_rng_states(torch.device("cpu"))
    assert "cuda" not in saved and "cuda_by_rank" not in saved
    restore_rng_states(saved, torch.device("cpu"))
    assert not [call for call in cuda.calls if call[0] == "set_rng_state"]
