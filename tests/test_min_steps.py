"""train.min_steps: a small dataset trains at least that many optimizer steps (CPU tests)."""

import logging
import shutil

import pandas as pd
import pytest

from cloudseg.config import load_config
from cloudseg.train import epochs_for, train
from tests.conftest import TINY


@pytest.fixture
def data(tiny_data, tmp_path):
    return shutil.copytree(tiny_data, tmp_path / "data")


def train_config(epochs: int, effective_batch: int, min_steps: int):
    return load_config("configs/demo.yaml", [f"train.epochs={epochs}", f"train.effective_batch={effective_batch}",
                                             "train.micro_batch=2", f"train.min_steps={min_steps}"]).train


@pytest.mark.parametrize("images, effective_batch, epochs, min_steps, expected", [
    (51, 4, 8, 200, 16),  # 13 steps an epoch (the last one of 3 images): 15 epochs would be 195
    (52, 4, 8, 208, 16),  # 13 steps an epoch exactly: 16 epochs are 208, enough
    (52, 4, 8, 209, 17),
    (51, 4, 20, 200, 20),  # train.epochs already makes more steps: kept
    (51, 4, 8, 0, 8),  # off
    (51, 16, 8, 200, 50),  # 4 steps an epoch at an effective batch of 16, not 26 at the micro-batch of 2
])
def test_epochs_are_raised_to_the_fewest_that_make_min_steps(images, effective_batch, epochs, min_steps, expected):
    """Hand-computed: steps an epoch = ceil(images / effective batch), as training counts them.
    Would catch a floor (51 images making 12 steps, so 17 epochs), steps counted by micro-batch,
    one epoch too few at an exact multiple, and train.epochs lowered where it already suffices."""
    assert epochs_for(train_config(epochs, effective_batch, min_steps), images) == expected


def test_the_demo_keeps_its_epochs():
    """make train's demo (160 synthetic images, fold 0's 128 in training: 32 steps an epoch, 256 in
    8 epochs) trains as long as before: would catch a default raised past it, which would lengthen
    the demo."""
    demo = load_config("configs/demo.yaml").train
    assert epochs_for(demo, 128) == demo.epochs == 8


def test_a_run_short_of_min_steps_trains_as_the_run_of_that_many_epochs(data, tmp_path, caplog):
    """16 training images make 4 steps an epoch: 2 epochs are 8 steps, train.min_steps=10 asks for
    3 epochs. The run must equal, row for row, the one asked for 3 epochs (its cosine schedule over
    12 steps, not 8), write epochs 3 in config.yaml so a resume trains as many, and say so. Would
    catch epochs raised after the schedule was built, a count that never reaches the loop, and a
    config.yaml with the epochs asked for."""
    caplog.set_level(logging.INFO, logger="cloudseg")
    config = [f"data.dir={data}", *TINY]
    train(load_config("configs/demo.yaml", [*config, "train.epochs=2", "train.min_steps=10"]), tmp_path / "raised")
    assert "train.min_steps=10: 16 training images make 4 optimizer step(s) an epoch" in caplog.text
    assert "training 3 epochs (12 steps" in caplog.text
    train(load_config("configs/demo.yaml", [*config, "train.epochs=3", "train.min_steps=0"]), tmp_path / "asked")
    raised, asked = (pd.read_csv(tmp_path / run / "metrics.csv") for run in ("raised", "asked"))
    columns = ["epoch", "step", "lr", "train_loss", "valid_loss", "dice", "dice_tuned"]
    pd.testing.assert_frame_equal(raised[columns], asked[columns])
    assert load_config(tmp_path / "raised" / "config.yaml").train.epochs == 3
