"""The head and score gates and the at-least-one-label rule, by hand and against `postprocess`
itself. NumPy only (no device)."""

import numpy as np
import pytest

from cloudseg.metrics import dice
from cloudseg.postprocess import force_one_label, grid_scores, postprocess, top_k_mean
from cloudseg.tune import RuleSearch, search_force_label, search_rule

ALL = [0.5] * 4
NONE = [0] * 4


def uniform(values, shape=(6, 8)):
    """(1, 4, H, W) uint8 probabilities, each class one constant value."""
    return np.stack([np.full(shape, v, np.uint8) for v in values])[None]


def test_the_head_gate_reads_each_class_s_own_head_probability():
    """Every pixel of every class is above the threshold; head probabilities 250, 10, 250, 10
    (≈ 0.98, 0.04) against a gate of 0.5: only Fish and Gravel keep their masks. The score gate,
    by hand: (top-k mean 200/255 + head)/2 is 0.88 and 0.41 for the two kinds. Would catch: the
    head read for another class (e.g. reversed), or the score not the mean of the two."""
    probs8, heads = uniform([200] * 4), np.array([[250, 10, 250, 10]], np.uint8)
    head = postprocess(probs8, ALL, NONE, [0.5] * 4, top_k=48, gate_on=["head"] * 4, classes8=heads)
    assert head[0].any(axis=(1, 2)).tolist() == [True, False, True, False]
    score = (200 / 255 + np.array([250, 10, 250, 10]) / 255) / 2  # 0.882, 0.412
    for gate, kept in ((0.41, [True] * 4), (0.42, [True, False, True, False]), (0.89, [False] * 4)):
        masks = postprocess(probs8, ALL, NONE, [gate] * 4, top_k=48, gate_on=["score"] * 4, classes8=heads)
        assert masks[0].any(axis=(1, 2)).tolist() == kept, (gate, score)
    mixed = postprocess(probs8, ALL, NONE, [0.5] * 4, top_k=48, gate_on=["top_k", "head", "top_k", "head"], classes8=heads)
    assert mixed[0].any(axis=(1, 2)).tolist() == [True, False, True, False]


def test_a_head_gate_without_head_probabilities_is_refused_in_one_line():
    with pytest.raises(ValueError, match="need the classification head's probabilities"):
        postprocess(uniform([200] * 4), ALL, NONE, [0.5] * 4, top_k=48, gate_on=["head"] * 4, classes8=None)
    with pytest.raises(ValueError, match="names the classification head's gate, and this model has no head"):
        RuleSearch({"threshold": ALL, "min_area": NONE, "gate": NONE, "gate_on": ["score"] * 4})


def test_the_grid_with_gate_scores_equals_postprocess_cell_by_cell():
    """grid_scores over (threshold, area, gate, gate kind) against postprocess + dice, each cell:
    random images with random head probabilities. Would catch kinds or gates crossed in the grid."""
    rng = np.random.default_rng(0)
    probs8 = rng.integers(0, 256, (5, 12, 16)).astype(np.uint8)
    probs8[:2] //= 3  # some faint images that a gate removes
    truth = rng.random((5, 12, 16)) < 0.3
    truth[3] = False
    heads = rng.integers(0, 256, 5).astype(np.uint8)
    top = top_k_mean(probs8, 20)
    kinds = np.stack([top, heads / 255, (top + heads / 255) / 2], axis=1)
    thresholds, areas, gates = (0.3, 0.6), (0, 10), (0.0, 0.4, 0.6)
    grid = grid_scores(probs8, truth, thresholds, areas, gates, top_k=20, gate_values=kinds)
    assert grid.shape == (2, 2, 3, 3)
    for (t, a, g, k), value in np.ndenumerate(grid):
        stacked = np.zeros((5, 4, 12, 16), np.uint8)
        stacked[:, 1] = probs8
        classes8 = np.zeros((5, 4), np.uint8)
        classes8[:, 1] = heads
        kind = ("top_k", "head", "score")[k]
        masks = postprocess(stacked, [thresholds[t]] * 4, [areas[a]] * 4, [gates[g]] * 4, top_k=20, gate_on=[kind] * 4,
                            classes8=classes8)
        assert value == pytest.approx(np.mean(dice(masks[:, 1], truth)), abs=1e-12), (t, a, g, kind)


def test_the_forced_label_fills_only_images_the_rule_left_empty():
    """Image 0 keeps Flower (a present class): untouched. Image 1 was emptied: its class of highest
    presence score, Gravel (head 240 against 30-60), comes back above the forced threshold; a pixel
    at 100 stays out. Without a head the top-k mean chooses: Sugar. Would catch: forcing an image
    that has a label, forcing the wrong class, or ignoring the forced threshold."""
    probs8 = np.zeros((2, 4, 4, 4), np.uint8)
    probs8[:, 2, :2] = 200  # Gravel: 8 pixels at 200 ...
    probs8[:, 2, 3, 3] = 100  # ... and one at 100
    probs8[:, 3] = 150  # Sugar: every pixel at 150 (the higher top-k mean)
    heads = np.array([[30, 60, 240, 30]] * 2, np.uint8)
    masks = np.zeros((2, 4, 4, 4), np.uint8)
    masks[0, 1, 0, 0] = 1
    forced = force_one_label(masks.copy(), probs8, heads, 0.5, top_k=4)
    assert np.array_equal(forced[0], masks[0])
    assert forced[1].any(axis=(1, 2)).tolist() == [False, False, True, False]
    assert forced[1, 2].sum() == 8 and forced[1, 2, 3, 3] == 0
    assert force_one_label(masks.copy(), probs8, None, 0.5, top_k=16)[1].any(axis=(1, 2)).tolist() == [0, 0, 0, 1]


def test_the_forced_label_is_kept_only_where_it_raises_the_score():
    """Every gate closed (0.99) empties all images. Where each image's one true class is its
    likeliest, forcing recovers them all (CV 1.0) and the search keeps it; where the true class is
    another, forcing only adds false positives and the search leaves it off. A rule that keeps the
    masks itself leaves nothing to force. Would catch an option kept whatever it scores."""
    probs8 = np.zeros((6, 4, 8, 8), np.uint8)
    probs8[:, 0, :4] = 180
    rule = {"threshold": ALL, "min_area": NONE, "gate": [0.99] * 4, "gate_on": ["top_k"] * 4}
    right = np.zeros(probs8.shape, bool)
    right[:, 0, :4] = True
    threshold, figures = search_force_label(probs8, right, rule)
    assert threshold is not None and figures["mean"] == pytest.approx(1.0)
    wrong = np.zeros(probs8.shape, bool)
    wrong[:, 1, 4:] = True
    assert search_force_label(probs8, wrong, rule)[0] is None
    result = search_rule(probs8, right, {**rule, "gate": NONE, "force_label_search": True})
    assert result["force_label"] is None  # the tuned rule keeps the masks already: nothing left to force


def test_a_forced_label_of_the_config_outlives_the_tuning_unsearched():
    """predict.force_label=0.4 with force_label_search off: the tuned rule (postprocess.json, which
    predict applies over the config) keeps 0.4 and reports the Dice with it, postprocess's by hand.
    Would catch: the tuned rule's force_label always null unless searched, which silently dropped
    the user's option at prediction."""
    probs8 = np.zeros((6, 4, 8, 8), np.uint8)
    probs8[:, 0, :4] = 180
    truth = np.zeros(probs8.shape, bool)
    truth[:3, 0, :4] = True  # half the images have class 0; the others are empty
    rule = {"threshold": ALL, "min_area": NONE, "gate": NONE, "gate_on": ["top_k"] * 4, "force_label": 0.4,
            "force_label_search": False}
    result = search_rule(probs8, truth, rule)
    assert result["force_label"] == 0.4
    masks = postprocess(probs8, result["threshold"], result["min_area"], result["gate"], gate_on=result["gate_on"],
                        force_label=0.4)
    assert result["cv_dice"]["forced"]["mean"] == pytest.approx(np.asarray(dice(masks, truth)).mean())


def test_a_rule_file_with_an_unknown_gate_score_is_one_line(tmp_path):
    """postprocess.json with gate_on naming no gate score: refused naming the file."""
    from cloudseg.postprocess import read_rule_file

    path = tmp_path / "postprocess.json"
    path.write_text('{"threshold": [0.5, 0.5, 0.5, 0.5], "min_area": [0, 0, 0, 0], "gate": [0, 0, 0, 0], '
                    '"gate_on": ["top_k", "heads", "top_k", "top_k"]}')
    with pytest.raises(ValueError, match=r"postprocess.json: gate_on must name one of top_k, head, score per class"):
        read_rule_file(path)
    path.write_text('{"threshold": [0.5, 0.5, 0.5, 0.5], "min_area": [0, 0, 0, 0], "gate": [0, 0, 0, 0]}')
    assert read_rule_file(path)["gate_on"] == ["top_k"] * 4 and read_rule_file(path)["force_label"] is None
