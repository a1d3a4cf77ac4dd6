"""Out-of-fold files, the post-processing search, ensembles and no-data bands."""

import copy
import json
import logging
import re
import shutil
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg.cli import main
from cloudseg.config import Config, dump, from_dict
from cloudseg.data import build_transform
from cloudseg.metrics import dice
from cloudseg.oof import read_oof, write_oof
from cloudseg.postprocess import GATES, MIN_AREAS, RULE_KEYS, THRESHOLDS, grid_scores, postprocess, quantize, top_k_mean
from cloudseg.predict import BLACK_LEVEL, no_data, predict_probs, tuned_rule
from cloudseg.task import LABELS
from cloudseg.tune import RuleSearch, search_rule, tune

SHAPE = (350, 525)
ON_CPU = ["--device", "cpu"]  # the runs below trained on the CPU (TINY); predict compares their submissions


def smooth_probs(n, seed):
    rng = np.random.default_rng(seed)
    fields = [cv2.GaussianBlur(rng.random(SHAPE).astype(np.float32), (0, 0), 10) for _ in range(n)]
    return np.stack([(f - f.min()) / (f.max() - f.min()) for f in fields])


def test_grid_scores_equal_postprocess_then_dice_on_every_cell():
    rng = np.random.default_rng(0)
    probs8 = quantize(smooth_probs(6, seed=1))
    truth = smooth_probs(6, seed=2) > 0.55
    truth[0] = False  # an image without this label
    thresholds, areas, gates = (0.3, 0.5, 0.7), (0, 800, 4000), (0.0, 0.6, 0.9)
    scores = grid_scores(probs8, truth, thresholds, areas, gates)
    for t, a, g in np.ndindex(scores.shape):
        masks = postprocess(probs8[:, None].repeat(4, 1), (thresholds[t],) * 4, (areas[a],) * 4, (gates[g],) * 4)
        assert scores[t, a, g] == pytest.approx(dice(masks[:, 0], truth).mean(), abs=1e-12), (t, a, g)
    assert len({round(v, 6) for v in scores.ravel()}) > 5  # the grid is not flat


def fake_run(folder, ids, probs8, truth, **predict):
    folder.mkdir(parents=True)
    config = Config().model_dump(mode="json")
    config["predict"].update(predict)
    (folder / "config.yaml").write_text(dump(from_dict(config)))
    write_oof(folder / "oof.npz", ids, probs8, truth)
    return folder


def planted(n, threshold, seed=0):
    """Probabilities whose truth is exactly `p > threshold` for Fish and Gravel in the first half of
    the images (the second half's probabilities stay below it: no truth); Flower has confident
    probabilities but is absent from every image; Sugar is present in every image."""
    probs8 = np.zeros((n, 4, *SHAPE), np.uint8)
    for c in range(4):
        probs8[:, c] = quantize(smooth_probs(n, seed + 100 * c))
    half = n // 2
    probs8[half:, (0, 2)] = quantize(0.95 * threshold * smooth_probs(n - half, seed + 7)[:, None].repeat(2, 1))
    truth = probs8 > threshold * 255
    truth[:, 1] = False
    return probs8, truth


RUN_RULE = {"threshold": [0.5] * 4, "min_area": [0] * 4, "gate": [0.0] * 4}  # Config's defaults


def test_tune_recovers_a_planted_threshold_and_reports_each_class_s_pooled_share(tmp_path, capsys):
    """Catches a search that misses the planted rule, a pooled share not computed from the smaller
    of each class's image counts (Fish: 6 with, 6 without -> 5/11; Flower: none with it -> 1;
    Sugar: in every image -> 1), and a table that does not say which classes lean on the pool."""
    probs8, truth = planted(12, threshold=0.59)
    ids = [f"{i}.jpg" for i in range(12)]
    order = np.random.default_rng(0).permutation(12)  # both folds hold images with and without the class
    runs = [fake_run(tmp_path / "fold0", [ids[i] for i in order[:6]], probs8[order[:6]], truth[order[:6]]),
            fake_run(tmp_path / "fold1", [ids[i] for i in order[6:]], probs8[order[6:]], truth[order[6:]])]
    assert main(["tune", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    assert "CV before" in out and "12 out-of-fold images from 2 run(s)" in out
    assert "Flower: 0 image(s) with it and 12 without, so its rule is 100% the four classes' pooled Dice" in out
    result = json.loads((tmp_path / "postprocess.json").read_text())
    assert result["threshold"] == [0.59] * 4  # Fish and Gravel by their own images, Flower and Sugar by the pool
    assert result["cv_dice"]["after"]["Fish"] == pytest.approx(1.0)
    for label in ("Fish", "Gravel"):
        assert result["cv_dice"]["after"][label] >= result["cv_dice"]["before"][label]
    assert result["pooled_weight"] == pytest.approx({"Fish": 5 / 11, "Flower": 1.0, "Gravel": 5 / 11, "Sugar": 1.0})


def test_tune_run_from_inside_the_first_run_writes_beside_it(tmp_path, monkeypatch, capsys):
    """`cloudseg tune . ../fold1` from inside fold0: the pooled rule goes beside fold0, as for
    `cloudseg tune fold0 fold1`, and fold0's own postprocess.json stays. Would catch the default
    output taken as `Path(".").parent`, which is "." itself: the run's own rule overwritten."""
    probs8, truth = planted(12, threshold=0.59)
    ids = [f"{i}.jpg" for i in range(12)]
    runs = [fake_run(tmp_path / "cv" / f"fold{k}", ids[6 * k:6 * k + 6], probs8[6 * k:6 * k + 6],
                     truth[6 * k:6 * k + 6]) for k in (0, 1)]
    own = runs[0] / "postprocess.json"
    own.write_text("{}")
    monkeypatch.chdir(runs[0])
    assert main(["tune", ".", "../fold1"]) == 0
    assert own.read_text() == "{}"
    assert json.loads((tmp_path / "cv" / "postprocess.json").read_text())["images"] == 12


def test_tune_on_one_run_writes_its_rule_where_predict_looks_for_it(tmp_path, capsys):
    """`cloudseg tune RUN`: the rule goes in RUN, beside best.pt, where prediction looks for a
    single checkpoint's (predict.tuned_rule). Would catch the rule written beside RUN, as for
    several runs' pooled rule, where predict never finds it and says "run cloudseg tune"."""
    probs8, truth = planted(12, threshold=0.59)
    run = fake_run(tmp_path / "runs" / "one", [f"{i}.jpg" for i in range(12)], probs8, truth)
    assert main(["tune", str(run)]) == 0
    assert json.loads((run / "postprocess.json").read_text())["threshold"] == [0.59] * 4
    assert not (tmp_path / "runs" / "postprocess.json").exists()
    assert tuned_rule([str(run / "best.pt")], None) == (run / "postprocess.json").resolve()


def test_a_folder_the_system_refuses_to_write_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """CPU; the temporary file's creation refused as on a read-only folder (EROFS: this may run as
    root, whom a chmod does not stop). Would catch: an OSError outside the CLI's user errors (a
    traceback, exit status 1), or its message naming the hidden temporary, not --out."""
    import errno
    import os

    from cloudseg import files

    probs8, truth = planted(4, threshold=0.5)
    run = fake_run(tmp_path / "run", [f"{i}.jpg" for i in range(4)], probs8, truth)

    real_open = os.open

    def read_only(path, *args):  # os.open is every module's: only the folder of --out refuses
        if Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args)

    monkeypatch.setattr(files.os, "open", read_only)
    assert main(["tune", str(run), "--out", str(tmp_path / "rule.json")]) == 2
    assert capsys.readouterr().err.strip() == f"cloudseg: error: {tmp_path / 'rule.json'}: Read-only file system"
    from cloudseg.cli import one_line  # an error of a file descriptor: its number, not a path, kept as Python says it

    assert one_line(OSError(errno.EBADF, os.strerror(errno.EBADF), 999)) == "[Errno 9] Bad file descriptor: 999"


def test_untuned_rule_is_part_of_the_grid(tmp_path):
    """A run whose own rule is off the grid is still scored exactly, so it can win where it is best."""
    probs8, truth = planted(12, threshold=0.5)
    run = fake_run(tmp_path / "run", [f"{i}.jpg" for i in range(12)], probs8, truth, threshold=[0.501] * 4)
    result = tune([run], tmp_path / "p.json")
    masks = postprocess(probs8, [0.501] * 4, [0] * 4)
    expected = dice(masks, truth).mean(0)
    assert [result["cv_dice"]["before"][k] for k in ("Fish", "Flower", "Gravel", "Sugar")] == pytest.approx(expected)


def test_tune_reads_the_rule_from_config_yaml_and_names_it_when_missing(tmp_path):
    """Catches tune ignoring the run's config (scoring the defaults instead) and an unhelpful error."""
    probs8, truth = planted(4, threshold=0.5)
    run = fake_run(tmp_path / "run", [f"{i}.jpg" for i in range(4)], probs8, truth, threshold=[0.7] * 4)
    result = tune([run], tmp_path / "p.json")
    expected = dice(postprocess(probs8, [0.7] * 4, [0] * 4), truth).mean(0)
    assert [result["cv_dice"]["before"][k] for k in ("Fish", "Flower", "Gravel", "Sugar")] == pytest.approx(expected)
    assert expected[0] != pytest.approx(dice(postprocess(probs8, [0.5] * 4, [0] * 4), truth).mean(0)[0])
    (run / "config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="run/config.yaml"):
        tune([run], tmp_path / "p.json")


def sparse_positives(n_with, n_without, seed=0):
    """One class: images with a large box of probability 1 (in the truth) and images with only a
    small false blob at 0.3, which a threshold of 0.32, a minimum area or a gate all remove."""
    probs8 = np.zeros((n_with + n_without, 4, *SHAPE), np.uint8)
    truth = np.zeros(probs8.shape, bool)
    probs8[:n_with, :, 50:250, 100:300] = 255  # 40,000 pixels: above every minimum area
    truth[:n_with, :, 50:250, 100:300] = True
    probs8[n_with:, :, 10:30, 10:35] = quantize(0.3)  # 500 pixels of 76: 0.29 keeps them, 0.32 does not
    return probs8, truth


GRID = [sorted(set(values) | {current}) for values, current in zip((THRESHOLDS, MIN_AREAS, GATES), (0.5, 0, 0.0))]


def rule_at(index):
    return [values[i] for values, i in zip(GRID, index)]


def test_a_class_absent_from_the_fold_takes_the_pooled_rule_not_always_empty():
    """Catches a search without the guard: where the class never occurs, any rule that empties every
    mask scores a perfect 1, and the plain argmax picks one ("always empty"). Flower has no images
    with it, so its rule is the best of the four classes' mean Dice, computed here from grid_scores."""
    probs8, truth = planted(12, threshold=0.59)  # Flower: confident probabilities, never in the truth
    unguarded = search_rule(probs8, truth, RUN_RULE, prior_images=0)
    flower = [unguarded[key][1] for key in RULE_KEYS]
    assert unguarded["cv_dice"]["after"]["Flower"] == 1.0  # the unguarded rule ...
    assert not postprocess(probs8[:, 1:2].repeat(4, 1), *([v] * 4 for v in flower))[:, 0].any()  # ... empties all
    guarded = search_rule(probs8, truth, RUN_RULE)
    pooled = np.mean([grid_scores(probs8[:, c], truth[:, c], *GRID) for c in range(4)], axis=0)
    assert [guarded[key][1] for key in RULE_KEYS] == rule_at(np.unravel_index(np.argmax(pooled), pooled.shape))
    assert [guarded[key][1] for key in RULE_KEYS] == [0.59, 0, 0.0]  # the other classes' planted rule
    assert guarded["pooled_weight"]["Flower"] == 1.0


def planted_per_class(n, thresholds, seed=0):
    """Each class c: truth is exactly `p > thresholds[c]` in the first half of the images, none in
    the second (probabilities below the threshold): class c's own best rule is thresholds[c]."""
    probs8 = np.zeros((n, 4, *SHAPE), np.uint8)
    half = n // 2
    for c, threshold in enumerate(thresholds):
        probs8[:half, c] = quantize(smooth_probs(half, seed + c))
        probs8[half:, c] = quantize(0.95 * threshold * smooth_probs(n - half, seed + 10 + c))
    truth = probs8 > np.array(thresholds)[None, :, None, None] * 255
    truth[half:] = False
    return probs8, truth


def test_each_class_leans_on_the_pool_by_its_evidence_and_follows_its_own_data_given_many_images():
    """Fish planted at 0.32, the other classes at 0.59; 2 images with and 2 without each class. The
    choice must be the argmax of (2·own + 5·pooled), computed here from grid_scores, which takes
    Fish to the pool's 0.59; with the same images 40 times over (evidence 80, pooled share 5/85)
    Fish takes its own 0.32. Catches a pooled share that ignores the evidence (or counts all
    images instead of the rarer kind), a blend with the wrong sign, and a guard that still
    overrides many images."""
    thresholds = (0.32, 0.59, 0.59, 0.59)
    probs8, truth = planted_per_class(4, thresholds)
    search = RuleSearch(RUN_RULE)
    search.add(probs8, truth)
    few = search.result()
    own = np.stack([grid_scores(probs8[:, c], truth[:, c], *GRID) for c in range(4)])
    pooled = own.mean(axis=0)
    for c in range(4):
        blended = (2 * own[c] + 5 * pooled) / 7
        expected = rule_at(np.unravel_index(np.argmax(blended), blended.shape))
        assert [few[key][c] for key in RULE_KEYS] == expected
        assert few["pooled_weight"][LABELS[c]] == pytest.approx(5 / 7)
    assert few["threshold"] == [0.59] * 4  # the pool moved Fish off its own best
    search.merge([copy.deepcopy(search) for _ in range(39)])
    many = search.result()
    assert many["images"] == 160 and many["pooled_weight"]["Fish"] == pytest.approx(5 / 85)
    assert many["threshold"] == list(thresholds)  # (the pool still breaks Fish's ties: a gate it does not need)
    assert many["cv_dice"]["after"] == pytest.approx({"mean": 1.0, **dict.fromkeys(LABELS, 1.0)})


def test_ties_go_to_the_rule_that_removes_least():
    """Catches the plain argmax's tie-break (first in grid order: lowest threshold, then any gate or
    minimum area that happens to work): here threshold 0.2 with gate 0.3 ties with threshold 0.32
    and no gate; the guard prefers no gate, no minimum area, then the lowest threshold."""
    probs8, truth = sparse_positives(5, 5)
    result = search_rule(probs8, truth, RUN_RULE)
    assert [result[key][0] for key in RULE_KEYS] == [0.32, 0, 0.0]
    assert result["cv_dice"]["after"]["Fish"] == 1.0
    scores = grid_scores(probs8[:, 0], truth[:, 0], *GRID)
    assert rule_at(np.unravel_index(np.argmax(scores), scores.shape)) != [0.32, 0, 0.0]  # the argmax would not


def every_fold_run(run, ids, probs8, truth, folds=2):
    """An every-fold run's files, as training leaves them: the folds' OOF files of `ids` in equal
    parts, RUN/config.yaml and RUN/best.pt naming the folds' (empty) best.pt."""
    from cloudseg.checkpoint import FOLDS, save_checkpoint

    size = len(ids) // folds
    for k in range(folds):
        part = slice(k * size, (k + 1) * size)
        fake_run(run / f"fold{k}", ids[part], probs8[part], truth[part])
        (run / f"fold{k}" / "best.pt").touch()
    shutil.copy(run / "fold0" / "config.yaml", run / "config.yaml")
    save_checkpoint(run / "best.pt", {FOLDS: [f"fold{k}/best.pt" for k in range(folds)], "config": {}})
    return run


def test_an_every_fold_run_s_rule_is_tuned_on_its_in_sample_images_too_and_scored_on_the_out_of_fold_ones(tmp_path):
    """Six out-of-fold images planted at threshold 0.32, four in-sample ones (RUN/insample.npz) at
    0.59: alone each gives its own threshold, together (0.32 with a 0.6 gate) neither. `tune RUN`
    must choose the rule of the ten images together, and report the CV figures of the six out-of-fold
    images under it (computed here by postprocess and dice). Would catch: the in-sample file ignored
    (0.32, no gate) or used alone (0.59), CV figures that count the in-sample images (too high: they
    fit), and the folds named one by one picking it up (it belongs to the run, not to a fold)."""
    oof_probs, oof_truth = planted_per_class(6, (0.32,) * 4, seed=0)
    in_probs, in_truth = planted_per_class(4, (0.59,) * 4, seed=50)
    ids = [f"{i}.jpg" for i in range(6)]
    run = every_fold_run(tmp_path / "run", ids, oof_probs, oof_truth)
    write_oof(run / "insample.npz", ids[:4], in_probs, in_truth)
    keys = ("threshold", "min_area", "gate", "box")
    rule_of = lambda result: [result[key][0] for key in keys]  # noqa: E731 (Fish's)
    alone, in_sample_alone = search_rule(oof_probs, oof_truth, RUN_RULE), search_rule(in_probs, in_truth, RUN_RULE)
    together = search_rule(np.concatenate([oof_probs, in_probs]), np.concatenate([oof_truth, in_truth]), RUN_RULE)
    assert len({str(rule_of(r)) for r in (alone, in_sample_alone, together)}) == 3  # the planting tells them apart

    result = tune([run])
    assert rule_of(result) == rule_of(together) and result["images"] == 10 and result["in_sample_images"] == 4
    plain = postprocess(oof_probs, result["threshold"], result["min_area"], result["gate"])
    assert result["cv_dice"]["after"]["mean"] == pytest.approx(np.asarray(dice(plain, oof_truth)).mean())
    untuned = postprocess(oof_probs, (0.5,) * 4, (0,) * 4)
    assert result["cv_dice"]["before"]["mean"] == pytest.approx(np.asarray(dice(untuned, oof_truth)).mean())
    assert json.loads((run / "postprocess.json").read_text())["in_sample_images"] == 4
    by_fold = tune([run / "fold0", run / "fold1"], tmp_path / "by_fold.json")
    assert rule_of(by_fold) == rule_of(alone) and by_fold["in_sample_images"] == 0


def test_an_in_sample_file_of_other_images_is_one_line_saying_how_to_make_it_again(tmp_path):
    """An in-sample file left from an earlier data folder (an image no fold holds out). Would catch
    it pooled in silence, a rule tuned on images that are not the run's."""
    probs8, truth = planted(4, threshold=0.5)
    run = every_fold_run(tmp_path / "run", ["a.jpg", "b.jpg", "c.jpg", "d.jpg"], probs8, truth)
    write_oof(run / "insample.npz", ["a.jpg", "e.jpg"], probs8[:2], truth[:2])
    with pytest.raises(ValueError, match=rf"{re.escape(str(run / 'insample.npz'))}: its images are not the "
                                         rf"out-of-fold images.*cloudseg oof --checkpoint {re.escape(str(run))}"):
        tune([run])


def test_runs_sharing_an_image_cannot_be_pooled(tmp_path):
    """The error names the image and both runs. Would catch an error that leaves the user to find them."""
    probs8, truth = planted(2, threshold=0.5)
    runs = [fake_run(tmp_path / f"r{i}", ["a.jpg", "b.jpg"], probs8, truth) for i in range(2)]
    with pytest.raises(ValueError, match=rf"image a.jpg is out-of-fold in more than one run "
                                         rf"\({re.escape(str(runs[0]))}, {re.escape(str(runs[1]))}\)"):
        tune(runs)


def test_runs_of_which_only_some_have_a_head_are_pooled_without_it_saying_which(tmp_path, caplog):
    """Two runs, the first with the head's probabilities: pooled without them, and a warning names
    the run that has none. Would catch the head dropped in silence (a gate on the head then says
    the model has no head, naming no run)."""
    probs8, truth = planted(4, threshold=0.5)
    with_head = fake_run(tmp_path / "r0", ["a.jpg", "b.jpg"], probs8[:2], truth[:2])
    write_oof(with_head / "oof.npz", ["a.jpg", "b.jpg"], probs8[:2], truth[:2], np.full((2, 4), 200, np.uint8))
    without = fake_run(tmp_path / "r1", ["c.jpg", "d.jpg"], probs8[2:], truth[2:])
    with caplog.at_level(logging.WARNING, logger="cloudseg"):
        tune([with_head, without], tmp_path / "p.json")
    assert f"the head's probabilities are left out of the tuning: {without} has none" in caplog.text


def test_oof_files_round_trip(tmp_path):
    probs8, truth = planted(3, threshold=0.4)
    write_oof(tmp_path / "oof.npz", ["x.jpg", "y.jpg", "z.jpg"], probs8, truth)
    ids, probs_back, truth_back = read_oof(tmp_path / "oof.npz")
    assert ids.tolist() == ["x.jpg", "y.jpg", "z.jpg"]
    assert np.array_equal(probs_back, probs8) and np.array_equal(truth_back, truth)
    with pytest.raises(ValueError, match="uint8"):
        write_oof(tmp_path / "bad.npz", ["x.jpg"], probs8[:1].astype(np.float32), truth[:1])
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a cloudseg OOF file"):
        read_oof(tmp_path / "junk.npz")


def test_gate_empties_masks_whose_top_probabilities_are_low():
    probs = np.zeros((2, 4, 40, 40), np.float32)
    probs[0, :, :10, :10] = 0.55  # weak
    probs[1, :, :10, :10] = 0.95  # confident
    masks = postprocess(probs, (0.5,) * 4, (0,) * 4, gates=(0.7,) * 4, top_k=50)
    assert masks[0].sum() == 0 and masks[1, 0].sum() == 100
    assert top_k_mean(quantize(probs), 50)[1, 0] == pytest.approx(242 / 255)


# ---------------------------------------------------------------- no-data bands


def test_no_data_mask_is_exactly_the_black_pixels():
    images = torch.full((2, 3, 5, 6), 120, dtype=torch.uint8)
    images[0, :, 1, 2] = BLACK_LEVEL  # black in every channel
    images[0, :2, 3, 4] = 0  # black in two channels only: not no-data
    images[1, :, :, 0] = 0
    expected = torch.zeros(2, 1, 5, 6, dtype=torch.bool)
    expected[0, 0, 1, 2] = True
    expected[1, 0, :, 0] = True
    assert torch.equal(no_data(images), expected)
    constant = lambda x: torch.full((len(x), 4, *x.shape[-2:]), 3.0)  # sigmoid(3) everywhere
    probs = predict_probs(constant, images, zero_black=True)
    assert torch.equal(probs == 0, expected.expand(-1, 4, -1, -1))
    assert torch.allclose(predict_probs(constant, images)[0, :, 1, 2], torch.sigmoid(torch.tensor(3.0)))


def test_nodata_band_augmentation_blacks_out_a_band_and_its_labels():
    transform = build_transform(hflip=0, vflip=0, nodata_band=1.0, image_size=(40, 100))
    for seed in range(20):  # with probability 1, every draw has exactly one band
        transform.set_random_seed(seed)
        out = transform(image=np.full((40, 100, 3), 200, np.uint8), mask=np.ones((40, 100, 4), np.uint8))
        black_columns = (out["image"] == 0).all(axis=(0, 2))
        assert 5 <= black_columns.sum() <= 15, seed  # 5-15% of the width
        assert (out["mask"][:, black_columns] == 0).all() and (out["mask"][:, ~black_columns] == 1).all()


# ---------------------------------------------------------------- ensembles and tuned prediction


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    from cloudseg.config import load_config
    from cloudseg.train import train
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("ensemble")
    data = shutil.copytree(tiny_data, root / "data")
    runs = []
    for fold in (0, 1):
        train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY, "train.epochs=1", f"data.fold={fold}"]),
              root / f"fold{fold}")
        runs.append(root / f"fold{fold}")
    return data, runs


def submission(path):
    return pd.read_csv(path, keep_default_na=False)


def test_training_writes_the_held_out_fold_as_oof(trained):
    data, runs = trained
    folds = pd.read_csv(data / "folds.csv")
    ids, probs8, truth = read_oof(runs[1] / "oof.npz")
    assert sorted(ids.tolist()) == sorted(folds.loc[folds.fold == 1, "image_id"])
    assert probs8.shape == (len(ids), 4, 350, 525) and truth.any()


def test_ensemble_of_one_checkpoint_equals_the_checkpoint(trained, tmp_path):
    _, runs = trained
    best = str(runs[0] / "best.pt")
    main(["predict", *ON_CPU, "--checkpoint", best, "--out", str(tmp_path / "one.csv")])
    main(["predict", *ON_CPU, "--checkpoint", best, "--checkpoint", best, "--out", str(tmp_path / "twice.csv")])
    two = ["predict", *ON_CPU, "--checkpoint", best, "--checkpoint", str(runs[1] / "best.pt"),
           "--out", str(tmp_path / "two.csv")]
    assert main(two) == 2  # two runs and no pooled rule beside them: the user must name one
    assert main([*two, "--postprocess", "none"]) == 0
    assert submission(tmp_path / "one.csv").equals(submission(tmp_path / "twice.csv"))
    assert len(submission(tmp_path / "two.csv")) == len(submission(tmp_path / "one.csv"))


def test_predict_applies_the_tuned_rule(trained, tmp_path):
    _, runs = trained
    rule = {"threshold": [1.0] * 4, "min_area": [0] * 4, "gate": [0.0] * 4}  # nothing clears a threshold of 1
    (tmp_path / "p.json").write_text(json.dumps(rule))
    assert main(["predict", *ON_CPU, "--checkpoint", str(runs[0] / "best.pt"), "--postprocess", str(tmp_path / "p.json"),
                 "--out", str(tmp_path / "s.csv")]) == 0
    assert (submission(tmp_path / "s.csv")["EncodedPixels"] == "").all()
    (tmp_path / "bad.json").write_text("{}")
    assert main(["predict", *ON_CPU, "--checkpoint", str(runs[0] / "best.pt"), "--postprocess",
                 str(tmp_path / "bad.json")]) == 2


def test_tune_on_trained_folds_then_submit(trained, tmp_path):
    data, runs = trained
    result = tune(runs, tmp_path / "postprocess.json")
    assert result["images"] == len(pd.read_csv(data / "folds.csv").query("fold in (0, 1)"))
    assert result["cv_dice"]["after"]["mean"] >= result["cv_dice"]["before"]["mean"]
