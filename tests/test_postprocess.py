"""The post-processing rule and the fast search's scores, against brute force and hand-computed masks."""

import itertools
import json

import cv2
import numpy as np
import pytest

from cloudseg.postprocess import CHUNK, TOP_K, _is_textured, grid_scores, postprocess, read_rule_file

# Unsorted, a duplicate, one exactly on a uint8 level (100/255), 0 (ties with empty pixels),
# below 0 (every pixel) and 1 (no pixel).
THRESHOLDS = (0.5, 0.2, 0.23, 0.5, 100 / 255, 0.0, -0.1, 1.0, 0.77)
MIN_AREAS = (0, 3, 1, 40, 7, 10**6)
GATES = (0.0, 0.5, 0.9)
TOP_K_SMALL = 30


def reference_scores(probs8, truth, thresholds, min_areas, gates, top_k):
    """Brute force, one rule at a time: threshold, drop small 8-connected components with cv2, gate, Dice."""
    scores = np.zeros((len(thresholds), len(min_areas), len(gates)))
    for image, true in zip(probs8, np.asarray(truth) != 0):
        top_mean = np.sort(image, axis=None)[-top_k:].mean() / 255
        for (t, threshold), (a, min_area) in itertools.product(enumerate(thresholds), enumerate(min_areas)):
            mask = image > threshold * 255
            _, labels, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
            mask &= stats[labels, cv2.CC_STAT_AREA] >= min_area
            for g, gate in enumerate(gates):
                kept = mask if top_mean >= gate else np.zeros_like(mask)
                total = kept.sum() + true.sum()
                scores[t, a, g] += 1.0 if total == 0 else 2 * (kept & true).sum() / total
    return scores / len(probs8)


def tricky_maps(n, shape=(23, 31), seed=0):
    """uint8 probabilities and boolean truths: empty and full maps, blobs touching the borders,
    values exactly on the thresholds' levels, diagonal chains, runs at both ends of adjacent rows."""
    rng = np.random.default_rng(seed)
    levels = np.floor(np.array(THRESHOLDS) * 255).clip(0, 255)
    palette = np.unique(np.concatenate([levels, levels + 1, levels - 1, [0, 255]]).clip(0, 255)).astype(np.uint8)
    probs8 = np.zeros((n, *shape), np.uint8)
    truth = np.zeros((n, *shape), bool)
    for i in range(n):
        kind = i % 5
        if kind == 1:  # overlapping boxes, often at a border or a corner
            for _ in range(rng.integers(1, 6)):
                y, x = rng.integers(-3, shape[0]), rng.integers(-3, shape[1])
                h, w = rng.integers(1, 12, size=2)
                probs8[i, max(y, 0) : y + h, max(x, 0) : x + w] = rng.choice(palette)
        elif kind == 2:  # every pixel drawn from the palette
            probs8[i] = rng.choice(palette, size=shape)
        elif kind == 3:  # chains joined only at corners, and runs at the ends of adjacent rows
            probs8[i][np.arange(min(shape)), np.arange(min(shape))] = 200
            probs8[i, 1::2, -1] = probs8[i, 2::2, 0] = 180
            probs8[i, 0] = probs8[i, -1] = 150  # first and last row: touch the next image of a chunk
        elif kind == 4:
            probs8[i] = 255
        truth[i] = rng.random(shape) < rng.choice([0.0, 0.3, 0.7])  # kind 0 stays an empty map
    return probs8, truth


def test_grid_scores_equal_brute_force_on_tricky_maps_and_any_truth_type():
    """Catches: `>=` instead of `>` at a level, unsorted or repeated thresholds mishandled, components
    joined across row ends or across images of a chunk (more than CHUNK images here), 4-connectivity,
    overlap counted on the wrong runs, and a uint8 truth used as an index (`object too deep`)."""
    probs8, truth = tricky_maps(2 * CHUNK + 5)
    levels = np.unique(np.clip(np.floor(np.array(THRESHOLDS) * 255), -1, 255))
    textured = _is_textured(np.searchsorted(levels, probs8).astype(np.uint8), len(levels))
    assert textured.any() and not textured.all()  # both ways of finding components are checked
    expected = reference_scores(probs8, truth, THRESHOLDS, MIN_AREAS, GATES, TOP_K_SMALL)
    assert len(np.unique(expected.round(9))) > 20  # the brute force does tell rules apart
    for as_type in (lambda t: t, lambda t: t.astype(np.uint8), lambda t: t.astype(np.uint8) * 255,
                    lambda t: t.astype(np.int64)):
        scores = grid_scores(probs8, as_type(truth), THRESHOLDS, MIN_AREAS, GATES, top_k=TOP_K_SMALL)
        np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-12)


def test_grid_scores_equal_brute_force_on_smooth_maps_with_blobs():
    """Catches the same faults as above on model-like maps (smooth fields, many components per level)."""
    rng = np.random.default_rng(4)
    fields = [cv2.GaussianBlur(rng.random((60, 90), np.float32), (0, 0), 3) for _ in range(12)]
    probs8 = np.stack([np.rint(255 * (f - f.min()) / (f.max() - f.min())) for f in fields]).astype(np.uint8)
    truth = probs8 > 140
    truth[::3] = False
    thresholds, areas = (0.2, 0.35, 0.5, 0.55, 0.62, 0.8), (0, 5, 30, 120, 400)
    expected = reference_scores(probs8, truth, thresholds, areas, GATES, TOP_K_SMALL)
    np.testing.assert_allclose(grid_scores(probs8, truth, thresholds, areas, GATES, top_k=TOP_K_SMALL), expected,
                               rtol=0, atol=1e-12)


def test_grid_scores_equal_brute_force_with_every_uint8_level_and_one_pixel_wide_maps():
    """Catches faults of the path for more than 255 distinct levels (a uint16 level image, on a
    smooth ramp and on noise) and of maps one pixel wide or high."""
    rng = np.random.default_rng(7)
    ramp = np.tile((np.arange(31) * 8).astype(np.uint8), (23, 1))
    cases = [(np.stack([ramp, rng.integers(0, 256, (23, 31), dtype=np.uint8)]), np.arange(-2, 258) / 255)]
    cases += [(rng.integers(0, 256, (4, *shape), dtype=np.uint8), (0.1, 0.5, 0.9)) for shape in [(1, 9), (9, 1), (1, 1)]]
    for probs8, thresholds in cases:
        truth = rng.random(probs8.shape) < 0.4
        expected = reference_scores(probs8, truth, thresholds, (0, 2, 30), (0.0, 0.6), top_k=3)
        np.testing.assert_allclose(grid_scores(probs8, truth, thresholds, (0, 2, 30), (0.0, 0.6), top_k=3),
                                   expected, rtol=0, atol=1e-12)


def test_a_diagonal_chain_is_one_component():
    """Catches 4-connectivity: five pixels touching only at corners are one component of area 5."""
    probs8 = np.zeros((1, 8, 8), np.uint8)
    probs8[0, np.arange(5), np.arange(5)] = 255
    truth = probs8 > 0
    assert grid_scores(probs8, truth, (0.5,), (5, 6), (0.0,)).ravel().tolist() == [1.0, 0.0]


def test_grid_scores_refuse_float_probabilities():
    """Catches silently thresholding floats in [0, 1] against levels 0-255 (every rule would be empty)."""
    with pytest.raises(ValueError, match="uint8"):
        grid_scores(np.zeros((1, 4, 4)), np.zeros((1, 4, 4), bool))


def test_postprocess_applies_each_class_its_own_threshold_min_area_and_gate():
    """Catches per-class parameters mixed up (class 0's threshold used for class 1, one gate or one
    minimum area for all classes): each class's expected mask below differs from the others'."""
    probs = np.zeros((1, 4, 6, 8), np.float32)
    probs[0, :, 0:2, 0:2] = 0.9  # a block of 4 (uint8 230)
    probs[0, :, 4, 7] = 0.6  # one pixel at the border (153)
    probs[0, :, 3, 2:5] = 0.4  # a bar of 3 (102)
    masks = postprocess(probs, thresholds=(0.5, 0.3, 0.3, 0.3), min_areas=(0, 0, 4, 0), gates=(0.85, 0, 0, 0.95),
                        top_k=4)  # the top-4 mean is 230/255 = 0.902: clears 0.85, not 0.95
    block, pixel, bar = {(0, 0), (0, 1), (1, 0), (1, 1)}, {(4, 7)}, {(3, 2), (3, 3), (3, 4)}
    for label, pixels in enumerate([block | pixel, block | pixel | bar, block, set()]):
        expected = np.zeros((6, 8), np.uint8)
        for y, x in pixels:
            expected[y, x] = 1
        np.testing.assert_array_equal(masks[0, label], expected, err_msg=f"class {label}")


def test_rule_file_top_k_defaults_and_is_checked(tmp_path):
    """Catches a reader that drops top_k (prediction could not apply the gate as tuned) or accepts
    a nonsensical one."""
    rule = {"threshold": [0.5] * 4, "min_area": [0] * 4, "gate": [0.0] * 4}
    (tmp_path / "old.json").write_text(json.dumps(rule))
    assert read_rule_file(tmp_path / "old.json")["top_k"] == TOP_K
    (tmp_path / "k.json").write_text(json.dumps({**rule, "top_k": 50}))
    assert read_rule_file(tmp_path / "k.json")["top_k"] == 50
    (tmp_path / "bad.json").write_text(json.dumps({**rule, "top_k": 0}))
    with pytest.raises(ValueError, match="bad.json: top_k"):
        read_rule_file(tmp_path / "bad.json")
