"""Weight averaging (train.swa, cloudseg swa): parameters averaged, BatchNorm statistics measured
again over the training images. On the CPU."""

import logging

import pytest
import torch

from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint, save_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.data import fold_ids
from cloudseg.model import build_model
from cloudseg.swa import chosen_epochs, epoch_path, recompute_norm_statistics
from tests.conftest import TINY, stem_norm_statistics, named


def test_swa_averages_the_weights_and_measures_batchnorm_again(data_copy, tmp_path):
    """A tiny run with train.swa=2 of 2 epochs: best.pt's parameters are the mean of the two
    epochs' weights; its first BatchNorm's running mean is the mean of that layer's input over
    the training images (computed here with a hook), not the mean of the epochs' running means.
    `cloudseg swa` over the same two files writes the same weights. Would catch: BatchNorm
    buffers averaged instead of recomputed, statistics left from the last epoch, or the EMA's
    weights averaged instead of the training ones."""
    run = tmp_path / "run"
    config = load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.swa=2", "train.ema=0.5"])
    train_module.train(config, run)
    epochs = [load_checkpoint(epoch_path(run, e))["model"] for e in (1, 2)]
    best = load_checkpoint(run / "best.pt")
    assert best["swa"]["epochs"] == [1, 2]
    model = build_model(config.model, pretrained=False)
    model.load_state_dict(best["model"])
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), (epochs[0][name] + epochs[1][name]) / 2, rtol=1e-6, atol=1e-7)

    name, bn, expected = stem_norm_statistics(model, data_copy, config)
    torch.testing.assert_close(bn.running_mean, expected, rtol=1e-4, atol=1e-5)
    averaged_buffers = (epochs[0][f"{name}.running_mean"] + epochs[1][f"{name}.running_mean"]) / 2
    assert (averaged_buffers - expected).abs().max() > 1e-3

    assert main(["swa", str(epoch_path(run, 1)), str(epoch_path(run, 2)), "--out", str(tmp_path / "swa.pt"),
                 "--device", "cpu"]) == 0
    written = load_checkpoint(tmp_path / "swa.pt")["model"]
    for name, value in best["model"].items():
        torch.testing.assert_close(written[name], value, msg=named(name))


def test_batchnorm_is_measured_without_an_unreadable_training_image(data_copy, caplog):
    """data.on_bad_sample=skip, micro-batches of 1, one training image spoiled: the statistics are
    the readable images' alone, the count leaves the spoiled one out, and a warning names it.
    Would catch: the pass reading the loader's batches as they come (a batch of only unreadable
    images has no "image": KeyError, which ended `cloudseg swa`, train.swa and every EMA
    validation), or the spoiled image counted as seen."""
    config = load_config("configs/demo.yaml", [f"data.dir={data_copy}", *TINY, "train.micro_batch=1",
                                                "data.on_bad_sample=skip"])
    train_ids = fold_ids(config.data, config.seed)[0]
    spoiled = train_ids[3]
    (data_copy / "train_images" / spoiled).write_bytes(b"not a jpeg")
    model = build_model(config.model, pretrained=False)
    with caplog.at_level(logging.WARNING, logger="cloudseg"):
        assert recompute_norm_statistics(model, config, torch.device("cpu")) == len(train_ids) - 1
    assert f"without 1 unreadable training image(s): {spoiled}" in caplog.text
    readable_ids = [image for image in train_ids if image != spoiled]
    _, bn, expected = stem_norm_statistics(model, data_copy, config, readable_ids)
    torch.testing.assert_close(bn.running_mean, expected, rtol=1e-4, atol=1e-5)


def test_more_epochs_to_average_than_the_run_has_is_one_line():
    """train.swa above train.epochs fails when the config loads; chosen_epochs says the same of a
    shorter history, and picks the best K by dice_tuned with swa_from=best."""
    with pytest.raises(ValueError, match=r"train.swa=5 averages 5 epochs' weights, more than train.epochs=3"):
        load_config("configs/demo.yaml", ["train.epochs=3", "train.swa=5"])
    history = [{"epoch": e, "dice": 0.0, "dice_tuned": d} for e, d in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.6))]
    assert chosen_epochs(history, 2, "last") == [3, 4]
    assert chosen_epochs(history, 2, "best") == [2, 3]
    with pytest.raises(ValueError, match="train.swa=5 asks for 5 epochs' weights and the run has 4"):
        chosen_epochs(history, 5, "last")


def test_swa_of_different_networks_writes_nothing(tmp_path):
    """Checkpoints of a UNet and an FPN: one line naming the second file, and no output file."""
    for name, arch in (("a.pt", "unet"), ("b.pt", "fpn")):
        config = load_config("configs/demo.yaml", [f"model.arch={arch}", "model.decoder_channels=null"])
        model = build_model(config.model, pretrained=False)
        save_checkpoint(tmp_path / name, {"model": model.state_dict(), "config": config.model_dump(mode="json"),
                                          "epoch": 1, "step": 1})
    assert main(["swa", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--out", str(tmp_path / "out.pt")]) == 2
    assert not (tmp_path / "out.pt").exists()
