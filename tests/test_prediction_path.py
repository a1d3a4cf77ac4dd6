"""predict end to end with models whose outputs are known: a perfect model scores exactly 1,
an ensemble combines its members as predict.ensemble says.

The perfect model's logits are ±20, far from any threshold, and it finds each image by its pixels
within a GPU decode's differences: its tests hold on any device and run on the `device` fixture's
(the GPU when there is one). The ensemble is compared bit for bit with sums done on the CPU, so it
runs on the CPU."""

import logging

import numpy as np
import pytest
import torch
from torch import nn

from cloudseg import oof as oof_module
from cloudseg import predict as predict_module
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.data import CloudDataset, decode_masks, read_label_csv
from cloudseg.metrics import evaluate_submission, resize_probs
from cloudseg.postprocess import postprocess
from cloudseg.synth import TEST_SOLUTION_CSV, synthesize
from cloudseg.task import LABELS, SUBMISSION_SHAPE
from tests.fake_cuda import H100

# Eager even on a GPU: the models here look their masks up by each image's pixels on the host, which
# torch.compile cannot trace, and compiled prediction's padding images are near no known image.
CONFIG = load_config("configs/demo.yaml", ["data.num_workers=0", "data.image_size=[350,525]", "predict.compile=false"])


@pytest.fixture(scope="module")
def submission_sized_data(tmp_path_factory):
    """Test images at exactly 350×525, so the truth is the model's own output size."""
    return synthesize(tmp_path_factory.mktemp("sub"), n_train=4, n_test=5, height=350, width=525, seed=7)


class TruthModel(nn.Module):
    """Logits ±20 from the masks of the known image nearest to each input: a perfect model, on any
    device. Nearest by the mean absolute difference of the pixels, which must stay under NEAR: a
    GPU decode of a JPEG differs from OpenCV's by up to 6 levels a pixel (H100), the two closest
    test images here by 24 on average."""

    NEAR = 8.0

    def __init__(self, images: torch.Tensor, masks: np.ndarray):
        super().__init__()
        self.images, self.masks = images.short(), masks

    def forward(self, images):
        distance = (images.cpu().short()[:, None] - self.images[None]).abs().float().mean((2, 3, 4))
        nearest = distance.argmin(1)
        assert (distance.gather(1, nearest[:, None]) < self.NEAR).all(), f"no known image this near: {distance}"
        return torch.from_numpy(self.masks[nearest.numpy()]).to(images.device).float() * 40 - 20


def truth_model(data_dir, shuffle_ids=False):
    """A TruthModel for the test images; with `shuffle_ids`, each image gets its neighbour's masks."""
    truth = read_label_csv(data_dir / TEST_SOLUTION_CSV)
    dataset = CloudDataset(data_dir, "test")
    ids = [dataset[i]["image_id"] for i in range(len(dataset))]
    owners = ids[1:] + ids[:1] if shuffle_ids else ids
    return TruthModel(torch.stack([dataset[i]["image"] for i in range(len(dataset))]),
                      np.stack([np.stack(decode_masks(truth, owner, SUBMISSION_SHAPE, "t")) for owner in owners]))


def predict_with(models, monkeypatch, data_dir, out, device, overrides=()):
    """`predict` on `device` with these models as its checkpoints (each moved where predict puts it)."""
    loaded = iter(models)
    monkeypatch.setattr(predict_module, "load_model",
                        lambda path, device: (next(loaded).to(device).eval(), CONFIG))
    return predict_module.predict([f"model{i}.pt" for i in range(len(models))], str(data_dir), str(out),
                                  list(overrides), postprocess_file="none", device=device)


def test_a_model_that_returns_the_true_masks_scores_exactly_one(submission_sized_data, tmp_path, monkeypatch, device):
    """Would catch: rows written under the wrong image or label, a transposed RLE, masks
    resized or thresholded off by a pixel, and a scorer that forgives any of these."""
    path = predict_with([truth_model(submission_sized_data)], monkeypatch, submission_sized_data, tmp_path / "s.csv",
                        device)
    assert evaluate_submission(path, submission_sized_data / TEST_SOLUTION_CSV)["dice"] == 1.0


def test_predict_boxes_the_classes_its_rule_says(submission_sized_data, tmp_path, monkeypatch, device):
    """predict.box for Fish only, with the perfect model: each Fish mask written is the truth's
    boxed, the other classes the truth itself. Would catch: predict ignoring the rule's boxes,
    or boxing another class."""
    from cloudseg.postprocess import bounding_boxes

    path = predict_with([truth_model(submission_sized_data)], monkeypatch, submission_sized_data, tmp_path / "s.csv",
                        device, ["predict.box=[true,false,false,false]"])
    written, truth = read_label_csv(path), read_label_csv(submission_sized_data / TEST_SOLUTION_CSV)
    changed = 0
    for image_id in truth.index:
        expected = decode_masks(truth, image_id, SUBMISSION_SHAPE, "truth")
        got = decode_masks(written, image_id, SUBMISSION_SHAPE, "submission")
        boxed = bounding_boxes(expected[0].astype(np.uint8))
        np.testing.assert_array_equal(got[0], boxed)
        for c in range(1, len(LABELS)):
            np.testing.assert_array_equal(got[c], expected[c])
        changed += int((boxed != expected[0]).any())
    assert changed  # the synthetic Fish regions are not all rectangles already


def test_the_true_masks_under_the_wrong_ids_do_not(submission_sized_data, tmp_path, monkeypatch, device):
    model = truth_model(submission_sized_data, shuffle_ids=True)
    path = predict_with([model], monkeypatch, submission_sized_data, tmp_path / "s.csv", device)
    assert evaluate_submission(path, submission_sized_data / TEST_SOLUTION_CSV)["dice"] < 0.9


class Noise(nn.Module):
    """Smooth random logits, a function of the image alone (fixed by `seed`)."""

    def __init__(self, seed):
        super().__init__()
        self.conv = nn.Conv2d(3, len(LABELS), 9, padding=4)
        torch.manual_seed(seed)
        nn.init.normal_(self.conv.weight, std=0.05)

    def forward(self, images):
        return self.conv(images.float() / 255 - 0.5) * 8


@pytest.mark.parametrize("combine", ["logits", "probabilities"])
def test_an_ensemble_combines_its_members_as_predict_ensemble_says(submission_sized_data, tmp_path, monkeypatch,
                                                                      combine):
    """predict.ensemble=logits: the sigmoid of the members' mean logit, each probability clamped
    to [1e-4, 1 - 1e-4]; =probabilities: their mean. Would catch: predict using only the first
    (or last) checkpoint, combining by anything else (max, mean of masks, the other of the two),
    or ignoring the key. On the CPU: the expected masks are thresholded from CPU sums, and a
    GPU's TF32 convolutions could move a pixel across the threshold."""
    members = [Noise(1), Noise(2)]
    path = predict_with(members, monkeypatch, submission_sized_data, tmp_path / "both.csv", "cpu",
                        [f"predict.ensemble={combine}", "predict.threshold=0.3"])
    got = read_label_csv(path)
    dataset = CloudDataset(submission_sized_data, "test")
    # not 0.5: there the two ways agree for two members (p + q > 1 exactly where a + b > 0)
    rule = CONFIG.predict.model_copy(update={"threshold": (0.3,) * 4})
    differ = False
    for i in range(len(dataset)):
        item = dataset[i]
        with torch.no_grad():
            probs = [member(item["image"][None]).sigmoid() for member in members]
        combined = {"logits": torch.stack([p.logit(eps=1e-4) for p in probs]).mean(0).sigmoid(),
                    "probabilities": (probs[0] + probs[1]) / 2}
        masks = {name: postprocess(resize_probs(p).numpy(), rule.threshold, rule.min_area, rule.gate)[0]
                 for name, p in combined.items()}
        decoded = np.stack(decode_masks(got, item["image_id"], SUBMISSION_SHAPE, path))
        assert np.array_equal(decoded, masks[combine]), item["image_id"]
        alone = postprocess(resize_probs(probs[0]).numpy(), rule.threshold, rule.min_area, rule.gate)[0]
        assert not np.array_equal(alone, masks[combine])  # the members differ: the test can tell
        differ = differ or not np.array_equal(masks["logits"], masks["probabilities"])
    assert differ  # and so can the two ways


class Constant(nn.Module):
    """An smp-like network with a classification head: every mask logit `mask`, every class logit `label`."""

    def __init__(self, mask: float, label: float):
        super().__init__()
        self.mask, self.label = mask, label
        self.classification_head = nn.Identity()  # what CloudNet.has_head looks for

    def forward(self, x):
        n, _, h, w = x.shape
        return x.new_full((n, len(LABELS), h, w), self.mask), x.new_full((n, len(LABELS)), self.label)


def test_the_logit_mean_clamps_each_member_and_leaves_one_model_alone():
    """Hand-computed: members of logits +20 and -2. The logit mean clamps sigmoid(20) to 1 - 1e-4
    (logit ln 9999 = 9.2102), so (9.2102 - 2) / 2 = 3.6051, sigmoid 0.97353; the probability mean
    is (1 + 0.11920) / 2 = 0.55960; heads combine alike. One model's probabilities are its own,
    unclamped. Would catch: no clamp (sigmoid(9) = 0.99988), the mean of probabilities, the heads
    left as the mean of probabilities, and a single model clamped (its OOF would no longer be
    what it predicts)."""
    from cloudseg.model import CloudNet
    from cloudseg.predict import ensemble_probs

    images = torch.zeros(1, 3, 40, 60, dtype=torch.uint8)
    members = [CloudNet(Constant(20.0, 20.0)).eval(), CloudNet(Constant(-2.0, -2.0)).eval()]
    for combine, expected in (("logits", 0.97353), ("probabilities", 0.55960)):
        probs, heads = ensemble_probs(members, images, None, combine=combine)
        assert probs.shape == (1, len(LABELS), 40, 60)
        torch.testing.assert_close(probs, torch.full_like(probs, expected), atol=2e-5, rtol=0)
        torch.testing.assert_close(heads, torch.full_like(heads, expected), atol=2e-5, rtol=0)
    alone, head = ensemble_probs(members[:1], images, None, combine="logits")
    assert (alone == torch.sigmoid(torch.tensor(20.0))).all() and (alone > 1 - 1e-4).all()
    assert (head > 1 - 1e-4).all()


def test_which_rule_predict_applies(tmp_path, caplog):
    """Would catch: ignoring the run's own postprocess.json, using it after `--postprocess none`,
    taking one fold's rule for an ensemble of folds instead of the pooled one, and silently
    picking some rule for checkpoints of unrelated runs."""
    from cloudseg.predict import RULE_FILE, tuned_rule

    caplog.set_level(logging.INFO, logger="cloudseg")
    for run in ("cv/fold0", "cv/fold1", "alone", "untuned"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "best.pt").touch()
    for place in ("cv", "cv/fold0", "cv/fold1", "alone"):
        (tmp_path / place / RULE_FILE).write_text("{}")
    folds = [str(tmp_path / "cv/fold0/best.pt"), str(tmp_path / "cv/fold1/best.pt")]
    assert tuned_rule([str(tmp_path / "alone/best.pt")], None) == (tmp_path / "alone" / RULE_FILE).resolve()
    assert "the tuned rule of" in caplog.text and "--postprocess none turns it off" in caplog.text
    assert tuned_rule([str(tmp_path / "alone/best.pt")], "none") is None
    assert str(tuned_rule([str(tmp_path / "alone/best.pt")], "my.json")) == "my.json"
    assert tuned_rule(folds, None) == (tmp_path / "cv" / RULE_FILE).resolve()  # the pooled rule of make cv
    assert tuned_rule([str(tmp_path / "untuned/best.pt")], None) is None  # with a warning: not tuned
    assert "not tuned" in caplog.text
    (tmp_path / "cv" / RULE_FILE).unlink()
    with pytest.raises(ValueError, match="folds of .*cv, which has no pooled postprocess.json: run cloudseg tune"):
        tuned_rule(folds, None)
    with pytest.raises(ValueError, match="checkpoints from different runs and no --postprocess"):
        tuned_rule([str(tmp_path / "alone/best.pt"), str(tmp_path / "untuned/best.pt")], None)


class Loaded(Exception):
    """Raised by a planted load_model: the command has chosen its device, nothing more is needed."""


@pytest.mark.parametrize("command", ["predict", "oof"])
def test_predict_and_oof_run_where_device_says_beside_a_gpu(fake_cuda, monkeypatch, command):
    """A (fake) H100 is visible. Would catch: --device not reaching the command (auto would take
    the GPU), auto no longer taking it, and a cuda device without its index."""
    fake_cuda(H100)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # speed_switches sets it
    chosen = []

    def load_model(path, device):
        chosen.append(device)
        raise Loaded

    monkeypatch.setattr(predict_module if command == "predict" else oof_module, "load_model", load_model)
    argv = [command, "--checkpoint", "best.pt", *(["--postprocess", "none"] if command == "predict" else [])]
    for option in ([], ["--device", "cpu"], ["--device", "cuda"]):
        with pytest.raises(Loaded):
            main([*argv, *option])
    assert chosen == [torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda", 0)]
