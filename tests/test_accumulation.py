"""Accumulation must equal the big batch: float64, no BatchNorm, plain SGD (update = lr x grad)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cloudseg.engine import StepContext, train_step, windows
from cloudseg.loss import per_image_loss
from cloudseg.train import lr_schedule
from tests.conftest import assert_same_parameters
from cloudseg.config import TrainConfig

CPU = torch.device("cpu")


class TinyNet(nn.Module):
    """uint8 images in, 4-channel logits out, like CloudNet, in float64 and without BatchNorm."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 4, 3, padding=1))

    def forward(self, images):
        return self.body(images.to(self.body[0].weight.dtype) / 255)


class Images(Dataset):
    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, 8, 10), dtype=torch.uint8, generator=g)
        self.masks = (torch.rand(n, 4, 8, 10, generator=g) < 0.4).to(torch.uint8)
        self.masks[0] = 0  # one image with no labels at all

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"image": self.images[i], "mask": self.masks[i]}


def model_and_sgd(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = TinyNet().to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def one_step(micro_batch, n_images, accumulation, grad_clip=None, compile=False):
    model, optimizer = model_and_sgd()
    loader = DataLoader(Images(n_images), batch_size=micro_batch, shuffle=False)
    (window,) = list(windows(loader, accumulation))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(StepContext(model, optimizer, scaler, CPU, None, grad_clip, dice_weight=1.0, compile=compile), window)
    return model


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compile(request):
    """Each accumulated step eager and under train.compile (the big batch it must equal: eager)."""
    if request.param:
        request.getfixturevalue("aot_eager")
    return request.param


def test_four_micro_batches_of_two_equal_one_batch_of_eight(compile):
    assert_same_parameters(one_step(2, 8, accumulation=4, compile=compile), one_step(8, 8, accumulation=1))


def test_uneven_window_2_2_1_equals_one_batch_of_five(compile):
    """Compiled, the short micro-batch is a second graph (one per shape)."""
    assert_same_parameters(one_step(2, 5, accumulation=3, compile=compile), one_step(5, 5, accumulation=1))


def test_the_test_can_fail_loss_over_accumulation_steps_is_not_the_big_batch():
    """The textbook `loss / accumulation_steps` differs from the big batch on a 2, 2, 1 window."""
    model, optimizer = model_and_sgd()
    for batch in DataLoader(Images(5), batch_size=2):
        (per_image_loss(model(batch["image"]), batch["mask"]).mean() / 3).backward()
    optimizer.step()
    with pytest.raises(AssertionError, match="differs"):
        assert_same_parameters(model, one_step(5, 5, accumulation=1))


def test_clipping_applies_to_the_window_gradient(compile):
    assert_same_parameters(one_step(2, 5, 3, grad_clip=0.05, compile=compile), one_step(5, 5, 1, grad_clip=0.05))


def test_short_last_window_is_its_own_step_and_the_next_epoch_starts_fresh():
    loader = DataLoader(Images(5), batch_size=2, shuffle=False)
    sizes = [[len(b["image"]) for b in w] for epoch in range(2) for w in windows(loader, 2)]
    assert sizes == [[2, 2], [1], [2, 2], [1]]
    # the short window is weighted by its real size: its step equals a batch of that one image
    model, optimizer = model_and_sgd()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    last_window = list(windows(loader, 2))[-1]
    train_step(StepContext(model, optimizer, scaler, CPU, None, None, 1.0), last_window)
    reference, ref_optimizer = model_and_sgd()
    batch = Images(5)[4]
    loss = per_image_loss(reference(batch["image"][None]), batch["mask"][None]).mean()
    loss.backward()
    ref_optimizer.step()
    assert_same_parameters(model, reference)


def test_per_image_loss_is_the_mean_of_single_image_losses():
    data = Images(6)
    model, _ = model_and_sgd()
    batch = DataLoader(data, batch_size=6).__iter__().__next__()
    together = per_image_loss(model(batch["image"]), batch["mask"])
    alone = torch.stack([per_image_loss(model(data[i]["image"][None]), data[i]["mask"][None])[0] for i in range(6)])
    assert torch.allclose(together, alone, atol=1e-12)


def test_the_loss_of_float64_logits_is_float64_with_its_gradient():
    """Against the same loss written here in float64 (BCE through logsigmoid, the soft Dice by
    hand). Would catch: a float32 target beside float64 logits (masks.float(), so until issue
    30): part of the loss and of its gradient in float32, the loss 1.6e-8 off here, and under torch 2.11
    eager and compiled float64 steps 1e-10 apart (the exactness tests could not hold there)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 8, 10, dtype=torch.float64, generator=g, requires_grad=True)
    masks = (torch.rand(2, 4, 8, 10, generator=g) < 0.4).to(torch.uint8)
    target, probs = masks.double(), logits.sigmoid()
    bce = -(target * F.logsigmoid(logits) + (1 - target) * F.logsigmoid(-logits)).mean((1, 2, 3))
    dice = 1 - (2 * (probs * target).sum((2, 3)) + 1) / ((probs + target).sum((2, 3)) + 1)
    expected = bce + dice.mean(1)
    got = per_image_loss(logits, masks)
    assert got.dtype == torch.float64
    (got_grad,), (expected_grad,) = (torch.autograd.grad(loss.sum(), logits) for loss in (got, expected))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-15)


def test_fp16_clipping_sees_unscaled_gradients():
    """With a GradScaler at 2**12, the clipped step must match an fp32 step, not a 4096x larger one."""
    loader = DataLoader(Images(6), batch_size=2)
    results = {}
    for name, dtype in (("fp32", None), ("fp16", torch.float16)):
        model, optimizer = model_and_sgd(dtype=torch.float32)
        before = copy.deepcopy(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=dtype is not None)
        (window,) = list(windows(loader, 3))
        norm = train_step(StepContext(model, optimizer, scaler, CPU, dtype, grad_clip=0.01, dice_weight=1.0), window).grad_norm
        step = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), before.parameters())])
        results[name] = (norm, step)
    (norm32, step32), (norm16, step16) = results["fp32"], results["fp16"]
    assert norm16 == pytest.approx(norm32, rel=2e-2)  # the reported pre-clip norm is unscaled
    assert norm32 > 0.01  # so clipping was active
    assert step16.norm().item() == pytest.approx(0.5 * 0.01, rel=1e-3)  # lr x clip norm
    assert torch.allclose(step16, step32, atol=2e-4)


def test_schedule_warms_up_then_decays_per_step():
    model, optimizer = model_and_sgd()
    scheduler = lr_schedule(optimizer, TrainConfig(lr=0.5, warmup_steps=2, micro_batch=1, effective_batch=1), 10)
    lrs = []
    for _ in range(10):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[:2] == [0.25, 0.5] and lrs[2] == pytest.approx(0.5)
    assert lrs[2:] == sorted(lrs[2:], reverse=True) and lrs[-1] < 0.05
