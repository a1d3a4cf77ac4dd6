"""The CPU's memory estimate (memory.estimate): a training step run on fake tensors, its live
bytes counted. Checked by hand on small cases and against a real GPU's measurements."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cloudseg import model as model_module
from cloudseg.config import load_config
from cloudseg.memory import LiveBytes, counted_step, estimate
from cloudseg.model import build_model, prepare_for_training

GiB = 2**30


def test_live_bytes_counts_storages_once_and_releases_them_when_freed():
    """Would catch: a view counted as new memory, a storage counted before its last view dies,
    freed memory never subtracted, or the peak taken as the final total."""
    with FakeTensorMode(), LiveBytes() as live:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = a[::2]
        b = torch.empty(500, dtype=torch.bfloat16)  # 1000: 5000 alive, the peak
        del a  # its view keeps the storage
        assert live.live == 5000
        del view
        c = torch.empty(2000, dtype=torch.uint8)
        assert (live.live, live.peak, live.largest) == (3000, 5000, 4000)
        del b, c


def test_live_bytes_sees_what_autograd_saves_and_the_backward_transients():
    """x (4000 bytes); y = exp(x), 4000, saved for backward; y·y, 4000, and its sum (4 bytes)
    live together before y·y goes: 12004. Backward adds the seed (4), mul's two products y·g
    (4000 each) while they are summed into y's gradient (4000): 20008; x.grad (4000) remains.
    Would catch: saved tensors or the backward's transients missed, a total taken at the end."""
    with FakeTensorMode(), LiveBytes() as live:
        x = torch.empty(1000, requires_grad=True)
        y = x.exp()
        loss = (y * y).sum()
        assert (live.peak, live.live) == (12004, 8004)
        loss.backward()
        assert (live.peak, live.live) == (20008, 12004)  # x, y, x.grad and the loss remain


def test_the_backward_peak_counts_from_the_model_s_first_convolution_backward():
    """A convolution, then a loss whose backward peaks before the convolution's (mul's products,
    2044 bytes, as in the test above). Would catch: the backward's peak taken from the loss's
    backward (where a GPU adds nothing to the count), or never taken. From the convolution backward
    on, x (400), w (36), y (400) and y's gradient (400) live: at least 1236, under the loss's 2044."""
    with FakeTensorMode(), LiveBytes() as live:
        x, w = torch.empty(1, 1, 10, 10), torch.empty(1, 1, 3, 3, requires_grad=True)
        y = torch.nn.functional.conv2d(x, w, padding=1)
        loss = (y * y).sum()
        assert live.backward_peak is None
        loss.backward()
        assert 1236 <= live.backward_peak < live.peak == 2044 and live.largest == 400


@pytest.fixture(scope="module")
def fullres_estimate():
    return estimate(load_config("configs/fullres.yaml", ["model.encoder_weights=null"]))


def blocks_measured_on_the_h100(model, mode):
    """The blocks that `checkpointing` wrapped when the H100 figures were taken (2026-11-23):
    encoder blocks one by one, plus decoder blocks for full."""
    encoder = list(model_module._blocks(model.unet.encoder))
    return {"none": [], "encoder": encoder, "full": encoder + list(model_module._blocks(model.unet.decoder))}[mode]


def test_the_estimate_lands_within_10_percent_of_the_h100_measurements(monkeypatch):
    """`cloudseg memory -c configs/fullres.yaml` measured on one NVIDIA H100 (torch 2.11, bf16,
    micro-batch 4, 2026-11-23) 9.70, 7.72 and 5.91 GiB for none, encoder and full, with the
    blocks of that day. Would catch: the estimate that preceded this one (8.73, 7.25, 4.65 GiB:
    saved tensors only, scaled by 0.5 for bf16; 21% low for full), a step without its loss or
    backward, autocast not applied."""
    monkeypatch.setattr(model_module, "checkpoint_blocks", blocks_measured_on_the_h100)
    steps = estimate(load_config("configs/fullres.yaml", ["model.encoder_weights=null"]))
    for mode, measured in {"none": 9.70, "encoder": 7.72, "full": 5.91}.items():
        assert steps[mode].peak(4) / GiB == pytest.approx(measured, rel=0.10), mode


# `cloudseg memory`'s allocator peaks on one NVIDIA H100 (torch 2.11, bf16, micro-batch 4,
# 2026-11-25, today's blocks), GiB: three runs of `full`.
MEASURED_ON_THE_H100 = {"none": [9.73], "encoder": [6.71], "full": [4.60, 4.76, 4.94]}


def test_the_estimate_is_within_10_percent_of_every_h100_run_of_today_s_modes(fullres_estimate):
    """Would catch: the estimate without the GPU's transient (4.18 GiB for full: 9 to 15% below
    the three runs, so a plan that fits on paper and not on the card), and one that overshoots
    by more than 10% (a card's worth of micro-batch lost)."""
    for mode, runs in MEASURED_ON_THE_H100.items():
        estimate_gib = fullres_estimate[mode].peak(4) / GiB
        assert all(0.9 * run <= estimate_gib <= 1.1 * run for run in runs), (mode, estimate_gib, runs)


def test_the_table_never_fits_four_images_into_11_gb_without_checkpointing(fullres_estimate):
    """Capped at 11 GB on the H100, micro-batch 4 without checkpointing ran out of memory (fp16 and
    bf16), and with encoder or full it trained. Would catch: the old table, which said 4 fit."""
    assert fullres_estimate["none"].largest_micro_batch(11e9) < 4
    assert fullres_estimate["encoder"].largest_micro_batch(11e9) >= 4
    assert fullres_estimate["full"].largest_micro_batch(11e9) >= 4


def test_checkpointing_modes_now_save_what_they_promise(fullres_estimate):
    """encoder checkpoints the whole encoder in one region and full nests its blocks: both lower
    than per-block checkpointing (7.85 and 5.52 GiB estimated), full under 5.5 GiB with 10% to
    spare. Would catch: a mode that wraps nothing more than before."""
    peaks = {mode: step.peak(4) / GiB for mode, step in fullres_estimate.items()}
    assert peaks["full"] < peaks["encoder"] < peaks["none"]
    assert peaks["encoder"] < 0.9 * 7.85 and peaks["full"] < 0.9 * 5.5


def test_bf16_halves_the_activations_but_not_the_fp32_loss():
    """Would catch: autocast not applied (ratio 1), or every tensor halved, the loss's float32
    logits and masks included (ratio 0.5, what the old estimate assumed)."""
    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.encoder=resnet18",
                                               "model.decoder_channels=[64,32,16,16,16]"])

    def per_image(dtype):
        peaks = [counted_step(prepare_for_training(build_model(config.model, pretrained=False).train(), True, "none"),
                              n, (256, 384), dtype).peak for n in (1, 2)]
        return peaks[1] - peaks[0]

    assert 0.5 < per_image(torch.bfloat16) / per_image(None) < 0.65


def test_a_probe_step_leaves_the_random_generator_as_it_found_it():
    """On the CPU (the CUDA branch forks that device's generator the same way): after a probe
    step the generator draws what it would have drawn without it. Would catch probes that move
    the stream, which on a GPU made the saved random states differ from the seeded ones, so a
    resume on another number of GPUs was always refused (blamed on dropout)."""
    from cloudseg.memory import probe_step

    config = load_config("configs/demo.yaml", ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]"])
    model = build_model(config.model, pretrained=False).train()
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    probe_step(model, 1, (32, 48), torch.device("cpu"), None)
    assert torch.equal(torch.rand(4), expected)
