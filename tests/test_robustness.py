"""The robustness study (benchmarks/robustness.py) and its data generator (benchmarks/kaggle_like.py)."""

import json
import subprocess
import sys
from dataclasses import replace

import cv2
import numpy as np
import pytest

from benchmarks.kaggle_like import (BOX_ORACLE_CSV, VARIANTS, Labellers, bounding_box, generate, expected_frequencies,
                                    label_set, merged, sample, sample_with_oracle)
from benchmarks.robustness import captured
from cloudseg import rle
from cloudseg.check import check_dataset
from cloudseg.config import load_config
from cloudseg.data import read_label_csv, read_train_csv
from cloudseg.metrics import dice, resize_masks
from cloudseg.task import LABELS, SUBMISSION_SHAPE

SMALL = (40, 60)  # not a multiple of 32, like the study's sizes


def test_dataset_layout_is_valid_and_masks_decode_at_their_size(tmp_path):
    """Catches: a layout `cloudseg check` rejects (CSV header, image size or mode), test truth
    encoded at the image size instead of 350x525, masks that differ from the drawn ones, and
    ids that differ between sample_submission.csv and test_solution.csv."""
    variant = replace(VARIANTS["blobs-union"], size=SMALL)
    data = generate(variant, tmp_path / "d", n_train=6, n_test=3)
    problems, summary = check_dataset(data, workers=1)
    assert problems == [] and f"expected image size {SMALL[0]}x{SMALL[1]}" in summary[0]
    rng = np.random.default_rng(variant.seed)  # the generator's draws, replayed
    drawn = [sample(rng, variant)[1] for _ in range(9)]
    train = read_train_csv(data)
    for masks, (_, row) in zip(drawn[:6], train.iterrows()):
        assert np.array_equal(np.stack([rle.decode(row[label], SMALL) for label in LABELS]), masks)
    solution = read_label_csv(data / "test_solution.csv")
    assert solution.index.equals(read_label_csv(data / "sample_submission.csv").index)
    for masks, (_, row) in zip(drawn[6:], solution.iterrows()):
        decoded = np.stack([rle.decode(row[label], SUBMISSION_SHAPE) for label in LABELS])
        assert np.array_equal(decoded, resize_masks(masks))


def test_expected_label_frequencies_by_hand():
    """P(no label) = 0.3 * 0.85 * 0.55 * 0.7 = 0.098175 is shared in proportion to the frequencies
    (sum 1.6). Catches a formula that forgets the at-least-one-label rule or shares it evenly."""
    expected = [0.7 + 0.098175 * 0.7 / 1.6, 0.15 + 0.098175 * 0.15 / 1.6,
                0.45 + 0.098175 * 0.45 / 1.6, 0.3 + 0.098175 * 0.3 / 1.6]
    assert np.allclose(expected_frequencies((0.7, 0.15, 0.45, 0.3)), expected)


@pytest.mark.parametrize("name", ["noise-ellipses", "mixed-rare"])
def test_label_draws_follow_the_requested_frequencies(name):
    """2,000 label sets (no images): every one has a label and each class's share is within
    3.5 standard errors of the expected share. Catches frequencies ignored (a fixed 0.45 as in
    cloudseg synth), shuffled between classes, or an empty draw always filled with one class."""
    frequencies = VARIANTS[name].frequencies
    rng = np.random.default_rng(0)
    draws = np.array([label_set(rng, frequencies) for _ in range(2000)])
    assert draws.any(axis=1).all()
    expected = expected_frequencies(frequencies)
    tolerance = 3.5 * np.sqrt(expected * (1 - expected) / len(draws))
    assert np.all(np.abs(draws.mean(axis=0) - expected) < tolerance), (draws.mean(axis=0), expected)


def test_drawn_images_keep_every_label_out_of_the_no_data_area():
    """Whole samples: each drawn class keeps a region outside the black wedge, none inside it.
    Catches labels under the wedge and classes the wedge erased (an image with no label)."""
    variant = replace(VARIANTS["blobs-union"], size=(48, 72), wedge_probability=1.0)
    rng = np.random.default_rng(1)
    for _ in range(20):
        image, masks = sample(rng, variant)
        black = (image == 0).all(axis=-1)
        assert black.sum() > 0.02 * black.size and masks.any()
        assert not masks[:, black].any()


def test_merged_boxes_by_hand():
    """Two boxes 5 px apart with a gap of 6 become the box around both; a third 20 px away stays.
    Catches merging by overlap only (5 px apart never overlap) or merging everything."""
    boxes = [(0, 0, 10, 10), (15, 2, 30, 8), (50, 0, 60, 10)]
    assert sorted(merged(boxes, gap=6)) == [(0, 0, 30, 10), (50, 0, 60, 10)]
    assert sorted(merged(boxes, gap=4)) == sorted(boxes)


def test_a_perfect_crowd_draws_exactly_the_box_oracle():
    """One labeller who misses nothing, never mistakes a class, pads by 0 and merges nothing draws
    each region's bounding box: the labels equal the box oracle, and the oracle's boxes are the
    regions' bounding boxes (checked against OpenCV on the painted image's regions). Catches an
    oracle built from other regions than the labels' or boxes that are not the bounding boxes."""
    crowd = Labellers(count=(1, 1), miss=0.0, wrong_class=0.0, padding=(0.0, 0.0), merge_gap=-1.0, clutter=(0, 0),
                      regions=(1, 1))
    variant = replace(VARIANTS["noisy-noise-ellipses"], labellers=crowd, size=(60, 90), wedge_probability=0.0)
    rng = np.random.default_rng(3)
    for _ in range(10):
        _, labels, oracle = sample_with_oracle(rng, variant)
        assert np.array_equal(labels, oracle) and labels.any()
        for mask in oracle[oracle.any(axis=(1, 2))]:
            x0, y0, x1, y1 = bounding_box(mask)
            assert mask[y0:y1, x0:x1].all() and mask.sum() == (x1 - x0) * (y1 - y0)


@pytest.mark.parametrize("name", ["noisy-noise-ellipses", "noisy-blobs-union"])
def test_noisy_labels_look_like_kaggles(name):
    """300 drawn images (small): every image has a label, none under the no-data wedge; about 2.1
    labels per image (1.9-2.35) and 42-55% of pairs empty, as on Kaggle; the box oracle scores
    well below 1 against them (the labels are noisy) and above all-empty. Catches a crowd that
    copies the true regions, labels nothing, or labels the wedge."""
    variant = replace(VARIANTS[name], size=(56, 84))
    rng = np.random.default_rng(0)
    counts, oracle_dice, empty_dice = [], [], []
    for _ in range(300):
        image, labels, oracle = sample_with_oracle(rng, variant)
        black = (image == 0).all(axis=-1)
        # No label under the wedge (eroded: single pixels of dark texture clip to black too).
        wedge = cv2.erode(black.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
        assert labels.any() and not labels[:, wedge].any()
        counts.append(labels.any(axis=(1, 2)).sum())
        oracle_dice.append(np.asarray(dice(oracle, labels)).mean())
        empty_dice.append(np.asarray(dice(np.zeros_like(labels), labels)).mean())
    assert 1.9 <= np.mean(counts) <= 2.35 and 0.42 <= 1 - np.mean(counts) / 4 <= 0.55
    assert np.mean(empty_dice) + 0.1 < np.mean(oracle_dice) < 0.85


def test_box_oracle_file_and_captured_share(tmp_path):
    """A noisy variant's folder holds box_oracle.csv with a row per test (image, label) in the
    order of sample_submission.csv, each decoding at 350x525; the captured share by hand:
    (0.6 - 0.5) / (0.7 - 0.5) = 0.5, NaN without an oracle. Catches an oracle of the train images
    or one missing rows, and a share over the wrong baseline."""
    data = generate(replace(VARIANTS["noisy-mixed-rare"], size=SMALL), tmp_path / "d", n_train=4, n_test=3)
    oracle = read_label_csv(data / BOX_ORACLE_CSV)
    assert oracle.index.equals(read_label_csv(data / "sample_submission.csv").index)
    assert all(rle.decode(value, SUBMISSION_SHAPE).shape == SUBMISSION_SHAPE for value in oracle.to_numpy().ravel())
    assert not (tmp_path / "clean").exists() and not (generate(replace(VARIANTS["mixed-rare"], size=SMALL),
                                                             tmp_path / "clean", 2, 1) / BOX_ORACLE_CSV).exists()
    scores = {"all-empty": {"dice": 0.5}, "box oracle": {"dice": 0.7}}
    assert captured(0.6, scores) == pytest.approx(0.5)
    assert np.isnan(captured(0.6, {"all-empty": {"dice": 0.5}}))


@pytest.mark.slow  # a training, three predictions and a tune: run with make test-all
def test_script_prints_the_table_with_every_column(tmp_path):
    """One variant at a tiny size through the real commands (slow: five cloudseg processes), on
    the CPU: on a GPU machine each process would start CUDA and search cuDNN's algorithms for
    every shape, on a GPU that every test worker shares. Catches a missing column or summary row,
    and an all-empty submission that is not empty: its Dice must be the share of empty
    (image, label) pairs in the test truth."""
    out = subprocess.run(
        [sys.executable, "benchmarks/robustness.py", "--variants", "blobs-union", "--n-train", "12", "--n-test", "4",
         "--epochs", "1", "--set", "train.min_steps=0", "--size", *map(str, SMALL), "--device", "cpu",
         "--out", str(tmp_path / "study"),
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=900, check=True).stdout
    header = next(line for line in out.splitlines() if line.startswith("variant") and "margin" in line)
    for column in ("size", "labels", "all-empty", "untuned", "one fold", "default", "explicit tune", "margin", "seconds"):
        assert column in header
    assert any(line.startswith("blobs-union") and f"{SMALL[0]}x{SMALL[1]}" in line for line in out.splitlines())
    assert any(line.startswith("mean") for line in out.splitlines())
    assert any(line.startswith("worst case") for line in out.splitlines())
    study = tmp_path / "study/blobs-union"
    assert load_config(study / "run/config.yaml").train.device == "cpu"  # --device reaches every command
    commands = (study / "commands.log").read_text().splitlines()
    predicts = [line for line in commands if line.startswith("$ cloudseg predict")]
    assert len(predicts) == 4 and all(line.endswith("--device cpu") for line in predicts)
    folds = [study / f"run/fold{k}" for k in range(5)]  # 12 images: every fold (train.every_fold: auto)
    assert f"$ cloudseg predict --checkpoint {folds[0] / 'best.pt'} --out {study / 'one_fold.csv'} --device cpu" in commands
    result = json.loads((tmp_path / "r.json").read_text())["results"][0]
    truth = read_label_csv(tmp_path / "study/blobs-union/data/test_solution.csv")
    assert result["scores"]["all-empty"]["dice"] == pytest.approx(truth.eq("").to_numpy().mean())
    assert result["margin"] == pytest.approx(result["scores"]["default"]["dice"] - truth.eq("").to_numpy().mean())

    # --retune on the same folder: the run tuned again into its own postprocess.json, no training.
    again = subprocess.run(
        [sys.executable, "benchmarks/robustness.py", "--variants", "blobs-union", "--device", "cpu",
         "--out", str(tmp_path / "study"), "--retune"], capture_output=True, text=True, timeout=900, check=True).stdout
    assert any(line.startswith("blobs-union") for line in again.splitlines())
    commands = (study / "commands.log").read_text().splitlines()
    assert sum(line.startswith("$ cloudseg train") for line in commands) == 1
    assert f"$ cloudseg tune {' '.join(map(str, folds))} --out {study / 'run/postprocess.json'}" in commands
    assert sum(line.startswith("$ cloudseg predict") for line in commands) == 8


def test_variant_groups_name_the_clean_and_the_noisy_variants():
    """--variants clean (the default) keeps the study as it was; noisy names the five crowd-labelled
    ones. Catches a default that silently adds five trainings, or a group that mixes the two."""
    from benchmarks.robustness import parse_args

    clean, noisy = parse_args([]).variants, parse_args(["--variants", "noisy"]).variants
    assert clean == ["noise-ellipses", "ripples-rotated", "blobs-union", "mixed-rare", "faint-small"]
    assert noisy == [f"noisy-{name}" for name in clean]
    assert all(VARIANTS[name].labellers is not None for name in noisy)
