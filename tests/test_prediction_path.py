"""predict end to end with models whose outputs are known: a perfect model scores exactly 1,
an ensemble is the average of its members.

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


def test_an_ensemble_is_the_average_of_its_members(submission_sized_data, tmp_path, monkeypatch):
    """Would catch: predict using only the first (or last) checkpoint, or combining the
    members by anything but the mean of their probabilities (max, mean of masks, logits).
    On the CPU: the expected masks are thresholded from CPU sums, and a GPU's TF32 convolutions
    could move a pixel across the threshold."""
    members = [Noise(1), Noise(2)]
    path = predict_with(members, monkeypatch, submission_sized_data, tmp_path / "both.csv", "cpu")
    got = read_label_csv(path)
    dataset = CloudDataset(submission_sized_data, "test")
    rule = CONFIG.predict
    for i in range(len(dataset)):
        item = dataset[i]
        with torch.no_grad():
            probs = [member(item["image"][None]).sigmoid() for member in members]
        expected = postprocess(resize_probs(((probs[0] + probs[1]) / 2)).numpy(), rule.threshold, rule.min_area,
                               rule.gate)[0]
        alone = postprocess(resize_probs(probs[0]).numpy(), rule.threshold, rule.min_area, rule.gate)[0]
        decoded = np.stack(decode_masks(got, item["image_id"], SUBMISSION_SHAPE, path))
        assert np.array_equal(decoded, expected), item["image_id"]
        assert not np.array_equal(alone, expected)  # the members differ: the test can tell


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
