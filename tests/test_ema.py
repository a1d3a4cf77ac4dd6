"""train.ema: an exponential moving average of the weights, once per optimizer step."""

import signal

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from cloudseg.checkpoint import load_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.model import build_model
from cloudseg.train import Interrupted, train
from tests.conftest import TINY, signal_during, stem_norm_statistics, named

DECAY = 0.6
OPTIONS = [*TINY, f"train.ema={DECAY}"]  # 16 training images, windows of 2 micro-batches of 2: 4 steps an epoch


def test_the_average_is_of_the_weights_after_each_step_and_is_what_best_pt_holds(data_copy, tmp_path, monkeypatch):
    """Would catch: an update per micro-batch (8 an epoch instead of 4), another decay or
    formula, saving the training weights as the model, and losing the training weights."""
    seen = []
    real_update = AveragedModel.update_parameters

    def recording(self, model):
        seen.append({k: v.detach().clone() for k, v in model.named_parameters()})
        real_update(self, model)

    monkeypatch.setattr(AveragedModel, "update_parameters", recording)
    train(load_config("configs/demo.yaml", [f"data.dir={data_copy}", *OPTIONS]), tmp_path / "run")
    last = load_checkpoint(tmp_path / "run/last.pt")
    assert len(seen) == last["step"] == last["ema_updates"] == 2 * 4
    expected = dict(seen[0])
    for weights in seen[1:]:
        expected = {k: DECAY * expected[k] + (1 - DECAY) * weights[k] for k in expected}
    for name, value in expected.items():
        torch.testing.assert_close(last["model"][name], value, rtol=1e-5, atol=1e-6, msg=named(name))
        torch.testing.assert_close(last["training_model"][name], seen[-1][name], rtol=0, atol=0, msg=named(name))
    head = "unet.segmentation_head.0.weight"
    assert not torch.equal(last["model"][head], last["training_model"][head])


def test_the_average_s_batchnorm_statistics_are_measured_with_its_own_weights(data_copy, tmp_path):
    """The saved average's first BatchNorm running mean is the mean of that layer's input over
    the training images under the averaged weights (a hook computes it here), not the average of
    the running means nor the training model's. Would catch: statistics averaged with the
    weights (`use_buffers=True`: on the demo's noisy datasets such a model scored at the
    all-empty level), copied from the weights that train, or measured before the last update."""
    config = load_config("configs/demo.yaml", [f"data.dir={data_copy}", *OPTIONS])
    train(config, tmp_path / "run")
    last = load_checkpoint(tmp_path / "run/last.pt")
    model = build_model(config.model, pretrained=False)
    model.load_state_dict(last["model"])
    name, norm, expected = stem_norm_statistics(model, data_copy, config)
    torch.testing.assert_close(norm.running_mean, expected, rtol=1e-4, atol=1e-5)
    assert (last["training_model"][f"{name}.running_mean"] - expected).abs().max() > 1e-3


def test_resume_mid_epoch_restores_the_average_exactly(data_copy, tmp_path, wrap_built_models):
    """Would catch: a resume that restarts the average (n_averaged 0 copies the weights), or
    loads the average into the weights that train."""
    options = [f"data.dir={data_copy}", *OPTIONS]
    train(load_config("configs/demo.yaml", options), tmp_path / "straight")
    wrap_built_models(lambda model: signal_during(model, 11, signal.SIGTERM))
    with pytest.raises(Interrupted, match="after window 2 of epoch 2"):
        train(load_config("configs/demo.yaml", options), tmp_path / "stopped")
    wrap_built_models(None)
    assert main(["train", "--resume", str(tmp_path / "stopped")]) == 0
    straight, resumed = load_checkpoint(tmp_path / "straight/last.pt"), load_checkpoint(tmp_path / "stopped/last.pt")
    assert straight["ema_updates"] == resumed["ema_updates"]
    bad = [(part, name) for part in ("model", "training_model") for name, tensor in straight[part].items()
           if not torch.equal(tensor, resumed[part][name])]
    assert not bad, bad[:3] + bad[-3:] + [len(bad)]
