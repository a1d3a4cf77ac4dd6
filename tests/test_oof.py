"""oof.npz comes from best.pt, row by row under its own image ids."""

import numpy as np
import pytest
import torch

from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint
from cloudseg.config import load_config
from cloudseg.data import CloudDataset
from cloudseg.metrics import resize_masks
from cloudseg.oof import read_oof, write_oof
from cloudseg.postprocess import quantize
from cloudseg.predict import batch_probabilities, load_model
from tests.conftest import TINY


def test_oof_is_best_pt_s_and_each_row_is_its_image(data_copy, tmp_path, monkeypatch):
    """A run whose best epoch is the first of two. Would catch: OOF from the last epoch's
    weights, rows in another order than their ids, and truth masks of other images."""
    real_validate, calls = train_module.validate, []

    def first_epoch_best(*args, **kwargs):
        calls.append(1)
        return {**real_validate(*args, **kwargs), "dice_tuned": 1.0 / len(calls)}

    monkeypatch.setattr(train_module, "validate", first_epoch_best)
    run = tmp_path / "run"
    train_module.train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY]), run)
    assert load_checkpoint(run / "best.pt")["epoch"] == 1 and load_checkpoint(run / "last.pt")["epoch"] == 2

    ids, probs, truth = read_oof(run / "oof.npz")
    best, config = load_model(run / "best.pt", torch.device("cpu"))
    last, _ = load_model(run / "last.pt", torch.device("cpu"))
    dataset = CloudDataset(data_copy, "train", list(ids))
    for row, image_id in enumerate(ids):
        item = dataset[row]
        assert item["image_id"] == image_id
        expected = {name: quantize(batch_probabilities([model], item["image"][None], None, config.predict)
                                   .submission.numpy())[0].astype(int) for name, model in (("best", best), ("last", last))}
        assert np.abs(probs[row].astype(int) - expected["best"]).max() <= 1  # batch size 1 vs 8: rounding only
        assert np.abs(probs[row].astype(int) - expected["last"]).max() > 1
        assert np.array_equal(truth[row], resize_masks(item["mask"]).numpy().astype(bool))


def test_an_empty_cut_or_damaged_oof_file_is_one_line_naming_it(tmp_path):
    """oof.npz empty, cut in half, or with one byte of its probabilities changed (the zip's CRC):
    each a ValueError naming the file, which the CLI prints as one line. Would catch NumPy's and
    zipfile's own errors (EOFError, BadZipFile) escaping as a traceback that names no file."""
    whole = tmp_path / "whole.npz"
    probs = np.random.default_rng(0).integers(0, 256, (1, 4, 350, 525), dtype=np.uint8)
    write_oof(whole, ["a.jpg"], probs, probs > 127)
    assert np.array_equal(read_oof(whole)[1], probs)  # the control reads
    data = whole.read_bytes()
    damaged = bytearray(data)
    damaged[data.index(b"probs.npy") + 4096] ^= 1  # inside the stored probabilities
    for name, content in (("empty", b""), ("cut", data[:len(data) // 2]), ("damaged", bytes(damaged))):
        path = tmp_path / f"{name}.npz"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}.npz: not a cloudseg OOF file"):
            read_oof(path)
