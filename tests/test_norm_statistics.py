"""BatchNorm running statistics move once per window, as for one big batch (engine.py)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from cloudseg import engine
from cloudseg.compiled import graph_counts
from cloudseg.engine import StepContext, train_step, windows
from tests.test_accumulation import CPU, Images


class NormNet(nn.Module):
    """uint8 images -> logits, with a BatchNorm whose input the test can compute (`norm_input`)."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.norm = nn.BatchNorm2d(5, momentum=momentum)
        self.head = nn.Conv2d(5, 4, 1)

    def norm_input(self, images):
        return self.conv(images.to(torch.float64) / 255)

    def forward(self, images):
        return self.head(torch.relu(self.norm(self.norm_input(images))))


def step_once(net, micro_batch, accumulation, n_images=8, compile=False):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    ctx = StepContext(net, optimizer, torch.amp.GradScaler("cpu", enabled=False), CPU, compile=compile)
    (window,) = list(windows(DataLoader(Images(n_images), batch_size=micro_batch), accumulation))
    train_step(ctx, window)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_update_per_window_toward_the_mean_of_the_micro_batch_statistics(momentum, compile, request):
    """Would catch: PyTorch's default of one update per micro-batch (four here), a mean over
    the window's images instead of its micro-batches for the variance, a count that grows per
    micro-batch, and (compiled) statistics summed inside the graph, or from the wrong micro-batch."""
    if compile:
        request.getfixturevalue("aot_eager")
    torch.manual_seed(0)
    net = NormNet(momentum).double().train()
    net.norm.running_mean.uniform_(-1, 1), net.norm.running_var.uniform_(0.5, 2)
    net.norm.num_batches_tracked.fill_(3)
    old_mean, old_var = net.norm.running_mean.clone(), net.norm.running_var.clone()
    with torch.no_grad():  # what the BatchNorm will see: the weights change only at the step
        seen = [net.norm_input(batch["image"]) for batch in DataLoader(Images(8), batch_size=2)]
    step_once(net, micro_batch=2, accumulation=4, compile=compile)
    batch_means = torch.stack([x.mean((0, 2, 3)) for x in seen])
    batch_vars = torch.stack([x.transpose(0, 1).flatten(1).var(1, unbiased=True) for x in seen])
    factor = 0.1 if momentum is not None else 1 / 4  # cumulative average: the 4th update
    torch.testing.assert_close(net.norm.running_mean, (1 - factor) * old_mean + factor * batch_means.mean(0))
    torch.testing.assert_close(net.norm.running_var, (1 - factor) * old_var + factor * batch_vars.mean(0))
    assert int(net.norm.num_batches_tracked) == 4
    assert net.norm.momentum == momentum  # restored after the window
    if compile:
        assert graph_counts() == (1, 0)  # one graph, no graph break


def test_the_test_can_fail_pytorchs_per_micro_batch_updates_differ():
    """The comparison above is sharp: four updates of momentum 0.1 land elsewhere."""
    torch.manual_seed(0)
    net = NormNet().double().train()
    step_once(net, micro_batch=2, accumulation=4)
    torch.manual_seed(0)
    plain = NormNet().double().train()
    with torch.no_grad():
        for micro in DataLoader(Images(8), batch_size=2):
            plain(micro["image"])
    assert (plain.norm.running_mean - net.norm.running_mean).abs().max() > 1e-3


def test_frozen_layers_and_evaluation_mode_are_left_alone():
    """Would catch: resetting the statistics of a BatchNorm in eval mode (model.norm=frozen)."""
    torch.manual_seed(0)
    net = NormNet().double().train()
    net.norm.eval()
    before = {k: v.clone() for k, v in net.norm.named_buffers()}
    step_once(net, micro_batch=2, accumulation=2, n_images=4)
    for key, value in net.norm.named_buffers():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_an_error_inside_the_window_restores_the_old_statistics(compile, monkeypatch, request):
    """Would catch: a failed window (out of memory) leaving the first micro-batch's statistics
    or the window's momentum of 1 behind, eager or compiled."""
    if compile:
        request.getfixturevalue("aot_eager")
    torch.manual_seed(0)
    net = NormNet().double().train()
    before = {k: v.clone() for k, v in net.norm.state_dict().items()}
    calls = []

    def fail_second(batch, device):  # outside the compiled graph, after the first micro-batch ran
        calls.append(torch.equal(net.norm.running_mean, before["running_mean"]))
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("simulated")
        return batch

    monkeypatch.setattr(engine, "decode_batch", fail_second)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        step_once(net, micro_batch=2, accumulation=2, n_images=4, compile=compile)
    assert calls == [True, False]  # the first micro-batch did change the statistics
    for key, value in net.norm.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert net.norm.momentum == 0.1


def train_windows(net, skip=(), poisoned=()):
    """SGD steps over 12 images in windows of 2 micro-batches of 2, leaving out the windows in
    `skip` (0-based) and poisoning (NaN logits) the training forwards in `poisoned` (1-based,
    the windows not skipped counted). Returns the results of the steps."""
    net.forward = poisoned_forward(net.forward, set(poisoned))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    ctx = StepContext(net, optimizer, torch.amp.GradScaler("cpu", enabled=False), CPU)
    all_windows = windows(DataLoader(Images(12), batch_size=2), 2)
    return [train_step(ctx, window) for index, window in enumerate(all_windows) if index not in skip]


def poisoned_forward(forward, calls_to_poison: set[int]):
    calls = []

    def poisoned(images):
        out = forward(images)
        calls.append(1)
        return out * float("nan") if len(calls) in calls_to_poison else out

    return poisoned


def test_a_skipped_window_leaves_the_batchnorm_statistics_as_they_were():
    """Three windows, the second one's loss not finite (NaN logits in its second micro-batch,
    after its first moved the statistics), against a run that never saw that window, in
    float64: the same running mean, variance and count, and the same weights, bit for bit.
    Would catch: the window's statistics stepped although it made no update (so until issue
    #22), or num_batches_tracked counting it."""
    torch.manual_seed(0)
    skipped_run = NormNet().double().train()
    never_saw_it = NormNet().double().train()
    never_saw_it.load_state_dict(skipped_run.state_dict())
    results = train_windows(skipped_run, poisoned={4})
    assert [result.skipped for result in results] == [False, True, False]
    train_windows(never_saw_it, skip={1})
    for key, value in skipped_run.state_dict().items():
        assert torch.equal(value, never_saw_it.state_dict()[key]), key
    assert int(skipped_run.norm.num_batches_tracked) == 2


def test_the_test_can_fail_a_window_that_steps_moves_the_statistics():
    """The comparison above is sharp: the second window, stepped, leaves other statistics."""
    torch.manual_seed(0)
    stepped = NormNet().double().train()
    never_saw_it = NormNet().double().train()
    never_saw_it.load_state_dict(stepped.state_dict())
    train_windows(stepped)
    train_windows(never_saw_it, skip={1})
    assert (stepped.norm.running_mean - never_saw_it.norm.running_mean).abs().max() > 1e-3
