import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg import rle
from cloudseg.cli import main
from cloudseg.metrics import dice, evaluate_submission, resize_masks, resize_probs, score, summarize
from cloudseg.task import LABELS


def test_both_empty_is_one_and_disjoint_is_zero():
    empty = np.zeros((4, 4))
    left, right = empty.copy(), empty.copy()
    left[:, :2], right[:, 2:] = 1, 1
    assert dice(empty, empty) == 1.0
    assert dice(left, right) == 0.0
    assert dice(left, empty) == 0.0


def test_hand_computed_two_thirds():
    # 2|A∩B| / (|A|+|B|) = 2*2 / (4+2)
    assert dice(np.array([[1, 1, 1, 1]]), np.array([[1, 1, 0, 0]])) == pytest.approx(2 / 3)


def test_vectorized_over_batches_numpy_and_torch_agree():
    rng = np.random.default_rng(0)
    pred = rng.random((5, 4, 6, 7)) < 0.3
    truth = rng.random((5, 4, 6, 7)) < 0.3
    pred[0, 0] = truth[0, 0] = False  # one both-empty pair
    per_pair = dice(pred, truth)
    assert per_pair.shape == (5, 4) and per_pair[0, 0] == 1.0
    for i, j in [(1, 2), (4, 3)]:  # against the formula on one pair
        a, b = pred[i, j], truth[i, j]
        assert per_pair[i, j] == pytest.approx(2 * (a & b).sum() / (a.sum() + b.sum()))
    torch_pair = dice(torch.from_numpy(pred), torch.from_numpy(truth))
    assert isinstance(torch_pair, torch.Tensor)
    np.testing.assert_allclose(torch_pair.numpy(), per_pair)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="equal shape"):
        dice(np.zeros((2, 3)), np.zeros((3, 2)))


def test_summary_is_mean_over_pairs_and_per_class():
    pair_dice = np.array([[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.5, 1.0]])
    summary = summarize(pair_dice)
    assert summary["dice"] == pytest.approx(4 / 8)
    assert [summary[label] for label in LABELS] == [0.5, 0.0, 0.5, 1.0]


def test_score_of_masks():
    truth = np.zeros((2, 4, 3, 3), np.uint8)
    truth[0, 0, 0, 0] = 1
    pred = truth.copy()
    pred[1, 1, 1, 1] = 1  # one false positive on an empty pair
    assert score(pred, truth)["dice"] == pytest.approx(7 / 8)
    assert score(pred, truth)["Flower"] == pytest.approx(0.5)


def test_mask_resize_is_nearest_and_does_not_dilate():
    mask = np.zeros((1400, 2100), np.uint8)
    mask[400:800, 800:1600] = 1
    small = resize_masks(mask)
    assert small.shape == (350, 525) and small.dtype == np.uint8
    assert set(np.unique(small)) == {0, 1}
    assert small.sum() == 100 * 200  # exactly a quarter per side, no dilation
    # a mask made of isolated pixels away from block centres vanishes instead of growing
    sparse = np.zeros((8, 8), np.uint8)
    sparse[0::4, 0::4] = 1
    assert resize_masks(sparse, (2, 2)).sum() == 0


def test_probability_resize_averages_before_thresholding():
    probs = np.zeros((1, 8, 8), np.float32)
    probs[0, :, :4] = 1.0
    small = resize_probs(probs, (2, 2))
    assert small.dtype == np.float32 and small.shape == (1, 2, 2)
    np.testing.assert_allclose(small[0], [[1, 0], [1, 0]])  # no bleeding across blocks
    checker = np.random.default_rng(0).random((8, 12)).astype(np.float32)
    expected = checker.reshape(2, 4, 3, 4).mean(axis=(1, 3))  # each output = mean of its 4x4 block
    np.testing.assert_allclose(resize_probs(checker, (2, 3)), expected, rtol=1e-6)
    enlarged = resize_probs(np.array([[0.0, 1.0]], np.float32), (1, 4))
    np.testing.assert_allclose(enlarged, [[0, 0.25, 0.75, 1]])  # bilinear when enlarging
    tensor = resize_probs(torch.from_numpy(probs), (2, 2))
    assert isinstance(tensor, torch.Tensor)


# ---------------------------------------------------------------- cloudseg evaluate


def test_perfect_submission_scores_one(tiny_data, capsys):
    truth = tiny_data / "test_solution.csv"
    assert main(["evaluate", "--submission", str(truth), "--truth", str(truth)]) == 0
    assert "mean Dice 1.0000" in capsys.readouterr().out


def test_all_empty_submission_scores_the_share_of_empty_pairs(tiny_data, tmp_path, capsys):
    truth = pd.read_csv(tiny_data / "test_solution.csv", keep_default_na=False)
    empty_share = (truth["EncodedPixels"] == "").mean()
    assert 0 < empty_share < 1
    truth.assign(EncodedPixels="").to_csv(tmp_path / "empty.csv", index=False)
    summary = evaluate_submission(tmp_path / "empty.csv", tiny_data / "test_solution.csv")
    assert summary["dice"] == pytest.approx(empty_share)
    main(["evaluate", "--submission", str(tmp_path / "empty.csv"), "--truth", str(tiny_data / "test_solution.csv")])
    assert f"mean Dice {empty_share:.4f}" in capsys.readouterr().out


def test_partial_overlap_is_scored_at_submission_size(tmp_path):
    a, b = np.zeros((350, 525), np.uint8), np.zeros((350, 525), np.uint8)
    a[:100], b[50:150] = 1, 1  # overlap 50 rows of 100: Dice 0.5
    rows = lambda m: [("x.jpg_Fish", rle.encode(m))] + [(f"x.jpg_{lab}", "") for lab in LABELS[1:]]
    pd.DataFrame(rows(a), columns=["Image_Label", "EncodedPixels"]).to_csv(tmp_path / "s.csv", index=False)
    pd.DataFrame(rows(b), columns=["Image_Label", "EncodedPixels"]).to_csv(tmp_path / "t.csv", index=False)
    summary = evaluate_submission(tmp_path / "s.csv", tmp_path / "t.csv")
    assert summary["Fish"] == pytest.approx(0.5) and summary["dice"] == pytest.approx(3.5 / 4)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f.iloc[4:], "1 image\\(s\\) missing"),
        (lambda f: pd.concat([f, f.iloc[:4].assign(Image_Label=lambda d: "zz.jpg_" + d.Image_Label.str.split("_").str[1])]), "1 not in the truth file"),
        (lambda f: f.rename(columns={"EncodedPixels": "Pixels"}), "missing column"),
        (lambda f: f.assign(EncodedPixels=["3 x"] + [""] * (len(f) - 1)), "non-integer value 'x'"),
        (lambda f: f.assign(EncodedPixels=["183000 2000"] + [""] * (len(f) - 1)), "past the last pixel 183750"),
    ],
)
def test_bad_submissions_get_clear_errors(tiny_data, tmp_path, capsys, edit, message):
    truth = tiny_data / "test_solution.csv"
    edit(pd.read_csv(truth, keep_default_na=False)).to_csv(tmp_path / "bad.csv", index=False)
    assert main(["evaluate", "--submission", str(tmp_path / "bad.csv"), "--truth", str(truth)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cloudseg: error:") and "bad.csv" in err
    assert __import__("re").search(message, err), err


def test_resize_accepts_flipped_views():
    mask = np.zeros((8, 8), np.uint8)
    mask[:4, :2] = 1
    np.testing.assert_array_equal(resize_masks(mask[::-1, ::-1], (2, 2)), [[0, 0], [0, 1]])
    np.testing.assert_allclose(resize_probs(mask[::-1].astype(np.float32), (2, 2)), [[0, 0], [0.5, 0]])
