"""Every fold in one run on small data (cloudseg/every_fold.py, issue #61), on the CPU: what auto
decides, the run's folders and pooled rule, prediction with every fold, a resume mid-fold."""

import json
import logging
import shutil
import signal

import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg import every_fold as every_fold_module
from cloudseg.checkpoint import FOLDS, fold_checkpoints, load_checkpoint
from cloudseg.cli import main
from cloudseg.config import load_config
from cloudseg.data import CloudDataset
from cloudseg.every_fold import every_fold, is_every_fold_run
from cloudseg.metrics import resize_masks, resize_probs
from cloudseg.oof import read_oof
from cloudseg.postprocess import quantize
from cloudseg.predict import load_model, predict_probs
from tests.conftest import TINY, signal_during

# The tests' tiny training, left to decide its folds itself: 24 images in 3 folds, 1 epoch each.
AUTO = [option for option in TINY if not option.startswith("train.every_fold")] + ["train.epochs=1"]


@pytest.fixture
def data(tiny_data, tmp_path):
    return shutil.copytree(tiny_data, tmp_path / "data")


def train_cli(run, data, *more) -> int:
    return main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *AUTO, *more])


def test_auto_trains_every_fold_up_to_the_small_dataset_size_and_says_why(data, monkeypatch):
    """Hand-counted: the tiny dataset has 24 training images, 3 folds of 8. Would catch: auto
    always one fold or always every fold, the threshold's edge on the wrong side (24 at a
    threshold of 24 is small), the config's forced values ignored, and a reason that does not
    say the counts it decided by."""
    config = load_config("configs/demo.yaml", [f"data.dir={data}", *AUTO])
    chosen, why = every_fold(config)
    assert chosen and "24 training images, at most 400" in why and "8 out-of-fold images" in why
    monkeypatch.setattr(every_fold_module, "SMALL_DATASET", 24)
    assert every_fold(config)[0]
    monkeypatch.setattr(every_fold_module, "SMALL_DATASET", 23)
    chosen, why = every_fold(config)
    assert not chosen and "24 training images, more than 23" in why and "train.every_fold=true" in why
    config.train.every_fold = True
    assert every_fold(config) == (True, "train.every_fold=true")
    monkeypatch.setattr(every_fold_module, "SMALL_DATASET", 400)
    config.train.every_fold = False
    assert every_fold(config) == (False, "train.every_fold=false")


def test_a_small_dataset_trains_every_fold_and_tunes_one_rule_on_every_image(data, tmp_path, caplog, capsys):
    """Would catch: one fold trained (the old default), a fold trained twice or validated on the
    wrong fold, the rule tuned on one fold's 8 images rather than all 24, best.pt that does not name
    every fold, a run that does not say loudly which path it took, and `cloudseg tune RUN` failing
    on such a run (it has no oof.npz of its own: its folds have)."""
    caplog.set_level(logging.INFO, logger="cloudseg")
    run = tmp_path / "run"
    assert train_cli(run, data) == 0
    assert "# every fold: 24 training images" in caplog.text
    folds = [run / f"fold{k}" for k in range(3)]
    for k, fold in enumerate(folds):
        assert load_config(fold / "config.yaml").data.fold == k and (fold / "oof.npz").is_file()
        assert len(pd.read_csv(fold / "metrics.csv")) == 1
    held_out = [set(np.load(fold / "oof.npz")["image_ids"]) for fold in folds]
    assert sum(map(len, held_out)) == 24 and len(set().union(*held_out)) == 24  # each image out of fold once
    rule = json.loads((run / "postprocess.json").read_text())
    assert rule["images"] == 48 and rule["in_sample_images"] == 24 and rule["runs"] == [str(fold) for fold in folds]
    assert sorted(np.load(run / "insample.npz")["image_ids"]) == sorted(set().union(*held_out))
    assert fold_checkpoints(run / "best.pt") == [fold / "best.pt" for fold in folds]
    assert is_every_fold_run(run) and load_config(run / "config.yaml").train.every_fold is True
    assert "3 folds; CV Dice" in capsys.readouterr().out
    assert main(["tune", str(run), "--out", str(tmp_path / "again.json")]) == 0  # the run stands for its folds
    assert json.loads((tmp_path / "again.json").read_text())["threshold"] == rule["threshold"]


def test_the_in_sample_file_is_the_folds_ensemble_on_every_training_image(data, tmp_path):
    """RUN/insample.npz against the three folds' predict_probs combined by hand (the sigmoid of
    their mean clamped logit, resized to 350×525), image by image under its id, and `cloudseg oof
    --checkpoint RUN/best.pt` against it. Would catch: one fold's model standing for the ensemble,
    rows in another order than their ids, truth of other images, and the
    command and training writing different files. (These barely trained models' logits are near
    0: their mean and their probabilities' mean round alike; tests/test_prediction_path.py tells
    the two ensembles apart.)"""
    run = tmp_path / "run"
    assert train_cli(run, data) == 0
    ids, probs, truth = read_oof(run / "insample.npz")
    models = [load_model(run / f"fold{k}/best.pt", torch.device("cpu"))[0] for k in range(3)]
    dataset = CloudDataset(data, "train", list(ids))
    one_model_differs = False
    for row, image_id in enumerate(ids):
        item = dataset[row]
        assert item["image_id"] == image_id
        each = [predict_probs(model, item["image"][None]) for model in models]
        by_logits = resize_probs(torch.stack([p.clamp(1e-4, 1 - 1e-4).logit() for p in each]).mean(0).sigmoid())
        assert np.abs(probs[row].astype(int) - quantize(by_logits.numpy())[0]).max() <= 1
        assert np.array_equal(truth[row], resize_masks(item["mask"]).numpy().astype(bool))
        one_model_differs |= np.abs(probs[row].astype(int) - quantize(resize_probs(each[0]).numpy())[0]).max() > 1
    assert one_model_differs  # the comparison above can tell the ensemble from one fold
    (run / "insample.npz").rename(tmp_path / "trained.npz")
    assert main(["oof", "--checkpoint", str(run / "best.pt"), "--device", "cpu"]) == 0
    for key in ("image_ids", "probs", "truth"):
        assert np.array_equal(np.load(run / "insample.npz")[key], np.load(tmp_path / "trained.npz")[key])


def test_the_in_sample_file_follows_the_setting_and_the_folds_it_comes_from(data, tmp_path, monkeypatch):
    """train.in_sample_rule=false: no RUN/insample.npz, the rule tuned on the 24 out-of-fold images
    alone; a resume with it true writes one and tunes on 48; a fold trained again on a resume makes
    it again (a damaged file stands for a stale one here: it is read only if it was kept). Would
    catch: the setting ignored either way, and the in-sample file of the folds' earlier models
    kept after one of them changed."""
    run = tmp_path / "run"
    assert train_cli(run, data, "train.in_sample_rule=false") == 0
    assert not (run / "insample.npz").exists()
    rule = json.loads((run / "postprocess.json").read_text())
    assert rule["images"] == 24 and rule["in_sample_images"] == 0
    assert main(["train", "--resume", str(run), "train.in_sample_rule=true"]) == 0
    assert json.loads((run / "postprocess.json").read_text())["in_sample_images"] == 24
    (run / "insample.npz").write_bytes(b"stale")
    kept = (run / "fold2/oof.npz").read_bytes()
    (run / "fold2/oof.npz").unlink()
    monkeypatch.setattr(every_fold_module, "train_fold",
                        lambda config, fold, k, overrides: (fold / "oof.npz").write_bytes(kept))  # "trained again"
    assert main(["train", "--resume", str(run)]) == 0
    assert len(read_oof(run / "insample.npz")[0]) == 24


def test_predict_uses_every_fold_and_the_pooled_rule_and_names_a_missing_fold(data, tmp_path, caplog):
    """`predict --checkpoint RUN/best.pt` against the same prediction with the three folds' best.pt
    and the pooled rule named by hand: the same submission. Would catch: best.pt predicting with
    one fold's model, or with a fold's own rule (tuned on 8 images), and a missing fold either
    silently left out or told without its name."""
    run = tmp_path / "run"
    assert train_cli(run, data) == 0
    caplog.set_level(logging.INFO, logger="cloudseg")
    assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(tmp_path / "a.csv"), "--device", "cpu"]) == 0
    assert "from 3 checkpoint(s)" in caplog.text and f"the pooled rule of {(run / 'postprocess.json').resolve()}" in caplog.text
    by_hand = [arg for k in range(3) for arg in ("--checkpoint", str(run / f"fold{k}/best.pt"))]
    assert main(["predict", *by_hand, "--postprocess", str(run / "postprocess.json"), "--out", str(tmp_path / "b.csv"),
                 "--device", "cpu"]) == 0
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
    assert main(["predict", "--checkpoint", str(run / "fold0/best.pt"), "--out", str(tmp_path / "c.csv"),
                 "--device", "cpu"]) == 0  # one fold alone, with its own rule: predicts too
    (run / "fold2/best.pt").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{run / 'fold2/best.pt'} is missing"):
        main(["--debug", "predict", "--checkpoint", str(run / "best.pt"), "--out", str(tmp_path / "d.csv"),
              "--device", "cpu"])


def test_a_large_dataset_still_trains_one_fold(data, tmp_path, monkeypatch):
    """Above the threshold (lowered here to 20 images), auto trains data.fold alone, as before:
    best.pt is a model's checkpoint in the run itself. Would catch: every fold trained whatever
    the data's size (five times a Kaggle-size training)."""
    monkeypatch.setattr(every_fold_module, "SMALL_DATASET", 20)
    run = tmp_path / "run"
    assert train_cli(run, data) == 0
    assert not list(run.glob("fold*")) and "model" in load_checkpoint(run / "best.pt")
    assert fold_checkpoints(run / "best.pt") is None and not is_every_fold_run(run)


def test_a_resumed_run_finishes_the_fold_it_was_in_then_the_rest_only(data, tmp_path, wrap_built_models, capsys,
                                                                     caplog):
    """SIGTERM in fold 1's second window; `--resume RUN` resumes fold 1 from its last.pt, leaves
    fold 0 as it was and trains fold 2. Would catch: a resume that starts again from fold 0 (its
    files rewritten), fold 1 started over (its epoch's first window trained twice: the saved
    progress says 2 windows done), a stop that tells the user to resume the fold rather than the run,
    a resume's override lost for the folds after it (RUN/config.yaml not rewritten), and the run's
    best.pt and pooled rule missing at the end."""
    built = []

    def stop_in_fold_1(model):
        built.append(model)
        return signal_during(model, 3, signal.SIGTERM) if len(built) == 2 else model

    wrap_built_models(stop_in_fold_1)
    run = tmp_path / "run"
    assert train_cli(run, data) == 130
    assert f"fold 1: stopped after window 2 of epoch 1; continue with: cloudseg train --resume {run}" in \
        capsys.readouterr().err
    fold0 = {path.name: path.stat().st_mtime_ns for path in (run / "fold0").iterdir()}
    assert load_checkpoint(run / "fold1/last.pt")["progress"]["windows"] == 2 and not (run / "fold2").exists()
    wrap_built_models(None)
    caplog.set_level(logging.INFO, logger="cloudseg")
    assert main(["train", "--resume", str(run), "data.num_workers=1"]) == 0
    assert load_config(run / "config.yaml").data.num_workers == 1  # the resume's override, kept for the next resume
    assert load_config(run / "fold2/config.yaml").data.num_workers == 1  # and trained with
    assert "fold 0 of 3: done" in caplog.text and "fold 1 of 3: resuming" in caplog.text
    assert "fold 2 of 3: training into" in caplog.text
    assert {path.name: path.stat().st_mtime_ns for path in (run / "fold0").iterdir()} == fold0
    assert all((run / f"fold{k}/oof.npz").is_file() for k in range(3))
    assert json.loads((run / "postprocess.json").read_text())["images"] == 48  # 24 out-of-fold, 24 in-sample
    assert len(fold_checkpoints(run / "best.pt")) == 3
    assert train_cli(run, data) == 2  # a new run into it is refused: it holds one
    assert "continue it with --resume" in capsys.readouterr().err


def test_an_every_fold_best_pt_is_refused_where_one_model_is_needed(tmp_path):
    """Would catch: the manifest read as a model's checkpoint (a KeyError on 'model', or a run
    of oof/swa on nothing), or an error that does not say what to give instead."""
    from cloudseg.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "best.pt", {FOLDS: ["fold0/best.pt"], "config": {}})
    with pytest.raises(ValueError, match="an every-fold run's best.pt.*give its folder's foldK/best.pt"):
        load_checkpoint(tmp_path / "best.pt")
    with pytest.raises(FileNotFoundError, match="fold0/best.pt is missing"):
        fold_checkpoints(tmp_path / "best.pt")
    torch.save({"model": {}, "config": {}, "epoch": 1, "step": 1}, tmp_path / "model.pt")
    assert fold_checkpoints(tmp_path / "model.pt") is None
