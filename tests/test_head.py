"""The classification head (model.cls_head): its loss accumulates exactly, it travels through
checkpoints and out-of-fold files, and the tuned rule's gates read it. All on the CPU."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cloudseg import engine
from cloudseg import loss as loss_module
from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint, save_checkpoint
from cloudseg.config import ModelConfig, load_config
from cloudseg.data import CloudDataset
from cloudseg.engine import StepContext, train_step, windows
from cloudseg.loss import per_image_loss
from cloudseg.model import build_model
from cloudseg.oof import read_oof
from cloudseg.postprocess import quantize
from cloudseg.predict import batch_probabilities, load_model, predict
from tests.conftest import TINY, assert_same_parameters
from tests.test_accumulation import Images

CPU = torch.device("cpu")
HEAD_NET = ModelConfig(arch="unet", encoder="resnet18", encoder_weights=None, decoder_channels=(8, 8, 8, 8, 8),
                       norm="group", cls_head=True)  # GroupNorm: the big batch and its micro-batches normalize alike


class SizedImages(Images):
    """tests/test_accumulation.py's images at 32x32 (the smp network needs a multiple of 32)."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.masks = (torch.rand(n, 4, 1, 1, generator=g) < 0.5).to(torch.uint8).expand(n, 4, 32, 32).clone()
        self.masks[0] = 0  # one image with no labels at all


def head_step(micro_batch, n_images, accumulation, cls_weight=0.1):
    torch.manual_seed(0)
    model = build_model(HEAD_NET, pretrained=False).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    (window,) = list(windows(DataLoader(SizedImages(n_images), batch_size=micro_batch), accumulation))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(StepContext(model, optimizer, scaler, CPU, None, None, 1.0, cls_weight=cls_weight), window)
    return model


@pytest.mark.parametrize("micro_batch, n_images, accumulation", [(2, 8, 4), (2, 5, 3)], ids=["4x2", "2-2-1"])
def test_the_head_s_loss_accumulates_like_one_big_batch(micro_batch, n_images, accumulation):
    """float64: micro-batches (an uneven 2, 2, 1 window too) give the parameters of one batch,
    the head's included, and the head did learn (its weights moved, differently with another
    cls_weight). Would catch: the head's BCE left out of the accumulated loss, or weighted per
    micro-batch instead of per image."""
    big = head_step(n_images, n_images, 1)
    assert_same_parameters(head_step(micro_batch, n_images, accumulation), big)
    torch.manual_seed(0)
    untrained = build_model(HEAD_NET, pretrained=False).double()
    head = "unet.classification_head.3.weight"
    moved = (big.state_dict()[head] - untrained.state_dict()[head]).abs().max()
    assert moved > 1e-6
    assert (head_step(n_images, n_images, 1, cls_weight=1.0).state_dict()[head] - big.state_dict()[head]).abs().max() > 1e-6


def test_the_test_can_fail_a_head_loss_taken_as_the_micro_batch_mean(monkeypatch):
    """A control: the head's BCE as one mean per micro-batch (the textbook loss / accumulation
    steps), not per image, weighs the 1-image micro-batch of a 2, 2, 1 window like a 2-image one;
    the comparison above sees it."""
    real, big = loss_module.per_image_loss, head_step(5, 5, 1)

    def batch_mean_head(logits, masks, dice_weight=1.0, class_logits=None, cls_weight=0.0):
        head = F.binary_cross_entropy_with_logits(class_logits.double(), masks.double().amax((2, 3)))
        return real(logits, masks, dice_weight) + cls_weight * head * 5 / 3 / len(logits)  # 5/3 images per micro-batch

    monkeypatch.setattr(engine, "per_image_loss", batch_mean_head)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_parameters(head_step(2, 5, 3), big)


def test_per_image_loss_adds_the_head_s_bce_by_hand():
    """Image 0 has only Fish, image 1 nothing. Head logits 0 give BCE ln 2 on every class, so
    the head adds 0.1 * ln 2 to each image; logits +20 on Fish alone (image 0) add 0.1 * 3/4 ln 2.
    Would catch: the target taken from another class or image, or the head's term summed over classes."""
    logits = torch.zeros(2, 4, 3, 3)
    masks = torch.zeros(2, 4, 3, 3, dtype=torch.uint8)
    masks[0, 0, 1, 1] = 1
    plain = per_image_loss(logits, masks)
    with_head = per_image_loss(logits, masks, class_logits=torch.zeros(2, 4), cls_weight=0.1)
    torch.testing.assert_close(with_head - plain, torch.full((2,), 0.1 * np.log(2)))
    sure = torch.tensor([[20.0, 0, 0, 0], [0, 0, 0, 0]])
    got = per_image_loss(logits, masks, class_logits=sure, cls_weight=0.1) - plain
    torch.testing.assert_close(got, torch.tensor([0.1 * 0.75 * np.log(2), 0.1 * np.log(2)], dtype=torch.float32), atol=1e-7, rtol=0)


def test_checkpoints_with_and_without_a_head_load_and_a_mismatch_is_one_line(data_copy, tmp_path):
    """Two tiny runs, one with a head: each best.pt loads as its own network, and its OOF file holds
    the head's probabilities (each row best.pt's head on that image) or none. A checkpoint whose
    config says no head over weights with one is refused in one line naming the file. Would
    catch: a head missing from the out-of-fold file, rows of another image's head, and a
    mismatched checkpoint that loads with missing or unexpected keys."""
    for head in (True, False):
        run = tmp_path / f"head-{head}"
        train_module.train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.epochs=1",
                                                             f"model.cls_head={str(head).lower()}"]), run)
        model, config = load_model(run / "best.pt", CPU)
        assert model.has_head is head
        ids, _, _, classes8 = read_oof(run / "oof.npz", with_classes=True)
        if not head:
            assert classes8 is None
            continue
        dataset = CloudDataset(data_copy, "train", list(ids))
        for row in range(len(ids)):
            expected = batch_probabilities([model], dataset[row]["image"][None], None, config.predict).classes
            assert np.abs(classes8[row].astype(int) - quantize(expected.numpy())[0]).max() <= 1
        state = load_checkpoint(run / "best.pt")
        state["config"]["model"]["cls_head"] = False
        save_checkpoint(tmp_path / "mismatch.pt", state)
        with pytest.raises(ValueError, match=r"mismatch.pt: the weights have classification head but the config says "
                                             r"model.cls_head=false") as error:
            load_model(tmp_path / "mismatch.pt", CPU)
        assert "\n" not in str(error.value)


def test_a_rule_that_gates_on_the_head_is_refused_for_a_model_without_one(data_copy, tmp_path):
    """predict with a postprocess.json whose gate_on names the head, for a run without a head:
    one line naming the file, and no submission written."""
    run = tmp_path / "run"
    train_module.train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.epochs=1"]), run)
    rule = (run / "postprocess.json").read_text().replace('"top_k", "top_k"', '"head", "top_k"')
    rule = rule.replace('"gate_on": [\n  "top_k"', '"gate_on": [\n  "head"')
    (tmp_path / "head.json").write_text(rule)
    assert '"head"' in rule
    with pytest.raises(ValueError, match=r"head.json: the rule gates on the classification head .* the model has none"):
        predict([str(run / "best.pt")], None, str(tmp_path / "sub.csv"), postprocess_file=str(tmp_path / "head.json"),
                device="cpu")
    assert not (tmp_path / "sub.csv").exists()
