"""Bounding boxes as the rule's last shape step (`predict.box`) and their per-class search, by
hand and against `postprocess` itself. NumPy only (no device)."""

import json

import numpy as np
import pytest

from cloudseg.config import load_config
from cloudseg.metrics import dice
from cloudseg.postprocess import bounding_boxes, postprocess, read_rule_file
from cloudseg.tune import search_boxes, search_rule, table

ALL = [0.5] * 4
NONE = [0] * 4


def test_each_component_becomes_its_own_bounding_box():
    """An L of 5 pixels, a diagonal pair (one 8-connected component) and a lone pixel, drawn by
    hand. Would catch: one box around everything, 4-connectivity (the pair boxed apart), or
    boxes off by one at their far edges."""
    mask = np.zeros((8, 10), np.uint8)
    mask[1:4, 1] = 1
    mask[3, 1:4] = 1  # the L: rows 1-3, columns 1-3
    mask[5, 6] = mask[6, 7] = 1  # the diagonal pair: rows 5-6, columns 6-7
    mask[0, 9] = 1
    expected = np.zeros_like(mask)
    expected[1:4, 1:4] = 1
    expected[5:7, 6:8] = 1
    expected[0, 9] = 1
    np.testing.assert_array_equal(bounding_boxes(mask), expected)
    assert bounding_boxes(np.zeros((4, 4), np.uint8)).sum() == 0


def test_boxes_apply_per_class_after_the_minimum_area_and_never_open_a_closed_gate():
    """Class 0 and 2 boxed, 1 and 3 not, over the same probabilities: a 3-pixel diagonal and
    a lone pixel. With min_area 2 the lone pixel goes before boxing (its box would stay); with a
    closed gate nothing is drawn. Would catch: the box read for another class, boxes drawn
    before the minimum area, or drawn for a gated-out mask."""
    plane = np.zeros((6, 8), np.uint8)
    plane[0, 0] = plane[1, 1] = plane[2, 2] = 200
    plane[5, 7] = 200
    probs8 = np.repeat(plane[None, None], 4, axis=1)
    masks = postprocess(probs8, ALL, [2] * 4, box=[True, False, True, False])[0]
    boxed = np.zeros((6, 8), np.uint8)
    boxed[:3, :3] = 1
    for c in (0, 2):
        np.testing.assert_array_equal(masks[c], boxed)
    for c in (1, 3):
        np.testing.assert_array_equal(masks[c], (plane > 0) & (np.arange(6)[:, None] < 3))
    closed = postprocess(probs8, ALL, NONE, [0.99] * 4, top_k=3, box=[True] * 4)
    assert closed.sum() == 0


def boxes_and_ellipses(n=6):
    """Probabilities that are an ellipse in every class; the truth is the ellipse's bounding
    rectangle in classes 0 and 1 (labels drawn as boxes) and the ellipse itself in 2 and 3."""
    yy, xx = np.mgrid[:30, :40]
    ellipse = ((yy - 15) / 10) ** 2 + ((xx - 20) / 15) ** 2 <= 1
    probs8 = np.repeat((ellipse * 220).astype(np.uint8)[None, None], 4, axis=1).repeat(n, axis=0)
    rectangle = np.zeros_like(ellipse)
    rectangle[5:26, 5:36] = True
    truth = np.stack([rectangle, rectangle, ellipse, ellipse])[None].repeat(n, axis=0)
    return probs8, truth


def test_the_search_boxes_the_classes_whose_labels_are_boxes_and_no_others():
    """The box raises Dice to 1 where the labels are rectangles and lowers it where they are the
    ellipse: chosen for classes 0 and 1 only, and the Dice it reports is postprocess's with that
    choice. Would catch: a choice read from another class's figures, boxes kept whatever they
    score, or a reported Dice of other masks than the rule's."""
    probs8, truth = boxes_and_ellipses()
    rule = {"threshold": ALL, "min_area": NONE, "gate": NONE, "gate_on": ["top_k"] * 4}
    chosen, figures = search_boxes(probs8, truth, rule, prior_images=0)
    assert chosen == [True, True, False, False]
    expected = np.asarray(dice(postprocess(probs8, ALL, NONE, box=chosen), truth)).mean(0)
    assert figures["mean"] == pytest.approx(expected.mean())
    assert figures["Fish"] == pytest.approx(1.0) and figures["Gravel"] == pytest.approx(1.0)
    result = search_rule(probs8, truth, {**rule, "box": [False] * 4, "box_search": True}, prior_images=0)
    assert result["box"] == [True, True, False, False]
    kept = search_rule(probs8, truth, {**rule, "box": [False, True, False, False], "box_search": False}, prior_images=0)
    assert kept["box"] == [False, True, False, False]  # not searched: the rule in force keeps its own


def test_boxes_kept_unsearched_are_scored_and_tabled():
    """predict.box set and box_search off: the tuned rule keeps the boxes, reports the Dice with
    them (postprocess's, by hand here) and `cloudseg tune`'s table prints it. Would catch: the
    table reading a boxed Dice that only the search had filled (KeyError after postprocess.json
    was written, so `cloudseg tune` failed on a rule it had saved)."""
    probs8, truth = boxes_and_ellipses()
    rule = {"threshold": ALL, "min_area": NONE, "gate": NONE, "gate_on": ["top_k"] * 4,
            "box": [False, True, False, False], "box_search": False}
    kept = search_rule(probs8, truth, rule, prior_images=0)
    masks = postprocess(probs8, kept["threshold"], kept["min_area"], kept["gate"], gate_on=kept["gate_on"],
                        box=[False, True, False, False])
    assert kept["cv_dice"]["boxed"]["mean"] == pytest.approx(np.asarray(dice(masks, truth)).mean())
    kept.update(runs=["fold0"], seconds=0.5, path="postprocess.json")
    assert f"bounding boxes where the table says yes: CV {kept['cv_dice']['boxed']['mean']:.4f}" in table(kept)


def test_a_class_with_no_evidence_follows_the_pooled_gain():
    """Class 0 present in every image: no evidence about emptying, full weight to the four
    classes' mean gain. With three classes gaining from boxes, it is boxed though its own figures
    lose; with the prior off it follows its own. Would catch: the guard of small folds missing
    from the box choice."""
    probs8, truth = boxes_and_ellipses()
    truth[:, 0], truth[:, 1:] = truth[:, 2], truth[:, :1].repeat(3, axis=1)  # class 0 the ellipse, others boxes
    truth[0, 1:] = False  # classes 1-3 absent from one image, so they have evidence; class 0 has none
    rule = {"threshold": ALL, "min_area": NONE, "gate": NONE, "gate_on": ["top_k"] * 4}
    assert search_boxes(probs8, truth, rule, prior_images=0)[0] == [False, True, True, True]
    assert search_boxes(probs8, truth, rule, prior_images=5)[0] == [True, True, True, True]


def test_rule_files_without_boxes_read_as_before_and_bad_ones_are_one_line(tmp_path):
    """A postprocess.json written before `box` existed reads as no boxes; a box that is not
    true/false per class, or a gate_on that is not a gate score per class (null included), is
    refused naming the file."""
    path = tmp_path / "postprocess.json"
    rule = {"threshold": ALL, "min_area": NONE, "gate": NONE}
    path.write_text(json.dumps(rule))
    assert read_rule_file(path)["box"] == [False] * 4
    for bad in ([1, 0, 0, 0], [True, False], "yes", None, 1):  # None and 1: no len(), a TypeError before
        path.write_text(json.dumps({**rule, "box": bad}))
        with pytest.raises(ValueError, match=r"postprocess.json: box must be true or false per class"):
            read_rule_file(path)
    for bad in (None, "top_k", ["top_k"] * 3):
        path.write_text(json.dumps({**rule, "gate_on": bad}))
        with pytest.raises(ValueError, match=r"postprocess.json: gate_on must name one of"):
            read_rule_file(path)


def test_one_value_of_predict_box_is_every_class_s():
    config = load_config("configs/demo.yaml", ["predict.box=true"])
    assert config.predict.box == (True,) * 4 and config.predict.box_search is True
