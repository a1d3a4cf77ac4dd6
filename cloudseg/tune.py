"""`cloudseg tune`: the post-processing rule per class, searched on pooled out-of-fold probabilities.

Data path: probabilities at 350×525 (oof.npz) → **the rule of the post-process step**
(postprocess.json), which every run also searches for itself at its end.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cloudseg.checkpoint import fold_checkpoints
from cloudseg.config import load_config
from cloudseg.oof import IN_SAMPLE_FILE, OOF_FILE, read_oof
from cloudseg.metrics import dice
from cloudseg.postprocess import (GATE_SCORES, GATES, HEAD_GATES, MIN_AREAS, RULE_DEFAULTS, RULE_FILE, RULE_KEYS,
                                  THRESHOLDS, TOP_K, all_gate_scores, apply_rule, grid_scores, postprocess, presence_scores,
                                  write_rule_file)
from cloudseg.task import LABELS
from cloudseg.units import human_duration

log = logging.getLogger("cloudseg")

# The other classes' say in a class's rule, counted in images: a class with n images with it
# and at least n without picks the rule that maximizes (n·own Dice + PRIOR_IMAGES·pooled Dice)
# / (n + PRIOR_IMAGES). Thin classes lean on the classes pooled; at Kaggle's size (hundreds of
# images of each kind in a fold) the pooled share is about 1% and each class's own data decides.
PRIOR_IMAGES = 5


def tune(run_dirs: list[str | Path], out: str | Path | None = None) -> dict:
    """Search threshold, minimum area and gate per class on the runs' pooled out-of-fold images
    (an every-fold run's folds' files), and on an every-fold run's in-sample ones (its insample.npz,
    where training wrote it: the rule then fits the folds' ensemble); write postprocess.json, with
    the CV figures of the out-of-fold images alone; return it.

    The runs' own rule (predict.* in the first run's config.yaml) is part of the grid, so it is
    scored exactly and wins where it is best; see `RuleSearch` for the guard against a small fold.
    """
    runs = [(Path(r), folds_of(Path(r))) for r in run_dirs]
    folds = [fold for _, run_folds in runs for fold in run_folds]
    ids, probs, truth, classes = pool(folds)
    in_sample = in_sample_parts([run for run, run_folds in runs if run_folds != [run]], ids, classes is not None)
    current = load_config(Path(run_dirs[0]) / "config.yaml").predict
    started = time.perf_counter()
    if in_sample:  # the rule is chosen on both; the out-of-fold images alone score it, as cross-validation does
        every = [(probs, truth, classes), *in_sample]
        result = search_rule(np.concatenate([part[0] for part in every]), np.concatenate([part[1] for part in every]),
                             current, classes8=None if classes is None else np.concatenate([part[2] for part in every]))
        rules = reported_rules(result, current)
        result["cv_dice"] = {key: rule_dice(probs, truth, rules[key], classes) for key in result["cv_dice"]}
    else:
        result = search_rule(probs, truth, current, classes8=classes)
    result.update(in_sample_images=sum(len(part[0]) for part in in_sample), runs=[str(fold) for fold in folds],
                  seconds=time.perf_counter() - started)
    out = Path(out) if out else default_rule_file(run_dirs)
    write_rule_file(result, out)
    result["path"] = str(out)
    return result


def in_sample_parts(every_fold_runs: list[Path], oof_ids: np.ndarray, head: bool) -> list[tuple]:
    """(probabilities, true masks, head probabilities or None) of the every-fold runs' in-sample
    files (RUN/insample.npz, their ensembles on every training image; a run without one adds
    none), each of the same images as the runs' out-of-fold files; head probabilities only when
    the out-of-fold files have them too."""
    parts = []
    for run in every_fold_runs:
        path = run / IN_SAMPLE_FILE
        if not path.is_file():
            continue
        ids, probs, truth, classes = read_oof(path, with_classes=True)
        if set(ids) - set(oof_ids) or len(ids) != len(set(ids)):
            raise ValueError(f"{path}: its images are not the out-of-fold images of {run}'s folds (a fold trained "
                             f"again since?); delete it and make it again: cloudseg oof --checkpoint {run / 'best.pt'}")
        if head and classes is None:
            raise ValueError(f"{path}: no head probabilities, and the out-of-fold files of {run}'s folds have them: "
                             f"make it again: cloudseg oof --checkpoint {run / 'best.pt'}")
        parts.append((probs, truth, classes if head else None))
    return parts


def reported_rules(rule: dict, current) -> dict:
    """The rules behind each figure of `search_rule`'s cv_dice, to score them on other images:
    the current rule ("before"), `rule` without boxes or forced label ("after"), with its boxes
    ("boxed") and whole ("forced")."""
    plain = {**rule, "box": [False] * len(LABELS), "force_label": None}
    before = {**plain, **{key: list(_rule_value(current, key)) for key in RULE_KEYS},
              "gate_on": list(_rule_value(current, "gate_on", RULE_DEFAULTS["gate_on"]))}
    return {"before": before, "after": plain, "boxed": {**rule, "force_label": None}, "forced": rule}


def folds_of(run_dir: Path) -> list[Path]:
    """The runs whose out-of-fold files `run_dir` stands for: an every-fold run's folds (those its
    best.pt names), else itself."""
    folds = fold_checkpoints(run_dir / "best.pt")
    return [fold.parent for fold in folds] if folds else [run_dir]


def default_rule_file(run_dirs: list[str | Path]) -> Path:
    """Where prediction looks for the rule of these runs (`predict.tuned_rule`): one run's in the
    run (beside its best.pt), several runs' pooled one beside the first (make cv's CV_DIR)."""
    first = Path(os.path.abspath(run_dirs[0]))  # `.`'s parent too, not `.`
    return (first if len(run_dirs) == 1 else first.parent) / RULE_FILE


def search_rule(probs8: np.ndarray, truth: np.ndarray, current, top_k: int = TOP_K,
                prior_images: float = PRIOR_IMAGES, classes8: np.ndarray | None = None) -> dict:
    """The best rule per class on these images, with its mean Dice before (current rule) and after,
    then the bounding boxes per class (`search_boxes`, when `box_search`; else the current rule's
    `box`) and the at-least-one-label option on top of it (`search_force_label`, when
    `force_label_search`).

    probs8: (N, 4, H, W) uint8 probabilities at submission size; truth: the (N, 4, H, W) masks
    (bool or integer); current: the rule in force, per-class `threshold`, `min_area`, `gate`,
    `gate_on`, and `gate_search` (`config.predict` or a mapping); classes8: the head's (N, 4)
    uint8 probabilities, None without a head. See `RuleSearch` for the guard and the result.
    """
    search = RuleSearch(current, top_k, prior_images, head=classes8 is not None)
    search.add(probs8, truth, classes8)
    result = search.result()
    result["box"] = list(_rule_value(current, "box", RULE_DEFAULTS["box"]))
    if _rule_value(current, "box_search", True):
        result["box"], result["cv_dice"]["boxed"] = search_boxes(probs8, truth, result, classes8, top_k, prior_images)
    elif any(result["box"]):  # the current rule's boxes, kept: scored as the search's would be
        result["cv_dice"]["boxed"] = rule_dice(probs8, truth, result, classes8)
    result["force_label"] = _rule_value(current, "force_label", RULE_DEFAULTS["force_label"])
    if _rule_value(current, "force_label_search", True):
        result["force_label"], result["cv_dice"]["forced"] = search_force_label(probs8, truth, result, classes8, top_k)
    elif result["force_label"] is not None:  # likewise
        result["cv_dice"]["forced"] = rule_dice(probs8, truth, result, classes8)
    return result


def rule_dice(probs8, truth, rule: dict, classes8=None) -> dict:
    """The mean Dice over these images of the whole `rule` (`apply_rule`), as `mean_dice` gives it."""
    return mean_dice(np.asarray(dice(apply_rule(probs8, rule, classes8), truth)))


def mean_dice(pair: np.ndarray) -> dict:
    """{"mean": ..., label: ...} of (image, class) Dice scores (N×4): overall and per class."""
    return {"mean": float(pair.mean()), **dict(zip(LABELS, pair.mean(0).tolist()))}


def search_boxes(probs8, truth, rule: dict, classes8=None, top_k: int = TOP_K, prior_images: float = PRIOR_IMAGES):
    """Per class, whether filling each kept component out to its bounding box (postprocess's
    `box`) raises the mean Dice over these images under `rule`: its gain, blended with the four
    classes' mean gain as the grid's choice is (see PRIOR_IMAGES), must be above zero. Returns the
    choice per class and the mean Dice with it ({"mean": ..., label: ...})."""
    def class_dice(box):
        masks = postprocess(probs8, rule["threshold"], rule["min_area"], rule["gate"], top_k=top_k,
                            gate_on=rule["gate_on"], classes8=classes8, box=box)
        return np.asarray(dice(masks, truth)).mean(0)

    shapes, boxes = class_dice([False] * len(LABELS)), class_dice([True] * len(LABELS))
    present = np.count_nonzero(np.asarray(truth).any(axis=(-2, -1)), axis=0)
    weights = np.array([pooled_weight(int(min(n, len(truth) - n)), prior_images) for n in present])
    gains = boxes - shapes
    chosen = (1 - weights) * gains + weights * gains.mean() > 0
    kept = np.where(chosen, boxes, shapes)
    return chosen.tolist(), {"mean": float(kept.mean()), **dict(zip(LABELS, kept.tolist()))}


def search_force_label(probs8, truth, rule: dict, classes8=None, top_k: int = TOP_K, thresholds=THRESHOLDS):
    """The threshold of the at-least-one-label option (postprocess.force_one_label) that most raises
    the mean Dice over these images under `rule`, or None when none raises it; and that mean Dice
    ({"mean": ..., label: ...}). Only images the rule leaves empty change, each in one class."""
    masks = postprocess(probs8, rule["threshold"], rule["min_area"], rule["gate"], top_k=top_k, gate_on=rule["gate_on"],
                        classes8=classes8, box=rule.get("box", RULE_DEFAULTS["box"]))
    pair = np.asarray(dice(masks, truth))
    empty = np.flatnonzero(~masks.any(axis=(1, 2, 3)))
    gains = np.zeros(len(thresholds))
    if len(empty):
        chosen = presence_scores(probs8[empty], None if classes8 is None else classes8[empty], top_k).argmax(1)
        forced_probs, forced_truth = probs8[empty, chosen], truth[empty, chosen]
        gains = np.array([(np.asarray(dice(forced_probs > t * 255, forced_truth)) - pair[empty, chosen]).sum()
                          for t in thresholds])
    best = int(np.argmax(gains))
    if gains[best] <= 0:
        return None, mean_dice(pair)
    pair[empty, chosen] = np.asarray(dice(forced_probs > thresholds[best] * 255, forced_truth))
    return float(thresholds[best]), mean_dice(pair)


class RuleSearch:
    """The search of `search_rule`, fed batch by batch: each class's grid of Dice sums and its
    image counts add up, so a validation pass keeps no probabilities, and processes that each
    saw a shard `merge` into the search over all images.

    Guard against a small fold: a class's own Dice is blended with the mean Dice of the four
    classes over the same grid, the pooled share falling as its evidence (the smaller of its
    images with and without it) grows; see PRIOR_IMAGES. A class absent from the fold (or in
    every image) has no evidence about emptying masks, so it takes the pooled rule instead of
    "always empty". Ties go to the rule that removes least, and gates on the top-k mean before
    the head's. The gate scores searched are `gate_search` (those needing a head only with
    `head`) and the current rule's `gate_on`. `result()` gives the rule under RULE_KEYS and
    `gate_on`, `top_k`, `images`, `cv_dice` {before (current rule), after: {mean, label: own
    Dice}} and `pooled_weight` {label: the pooled share of its choice}.
    """

    def __init__(self, current, top_k: int = TOP_K, prior_images: float = PRIOR_IMAGES, head: bool = False):
        gate_on = list(_rule_value(current, "gate_on", ["top_k"] * len(LABELS)))
        if not head and any(kind in HEAD_GATES for kind in gate_on):
            raise ValueError(f"the rule's gate_on {gate_on} names the classification head's gate, and this model "
                             "has no head (model.cls_head)")
        searched = set(_rule_value(current, "gate_search", ["top_k"])) | set(gate_on)
        self.kinds = [kind for kind in GATE_SCORES if kind in searched and (head or kind not in HEAD_GATES)]
        self.current = [[_rule_value(current, key)[c] for key in RULE_KEYS] + [gate_on[c]] for c in range(len(LABELS))]
        # One grid for every class, holding each class's current rule, so classes can be pooled.
        self.grid = [sorted(set(values) | {rule[k] for rule in self.current})
                     for k, values in enumerate((THRESHOLDS, MIN_AREAS, GATES))] + [self.kinds]
        self.top_k, self.prior_images = top_k, prior_images
        self.sums = np.zeros((len(LABELS), *map(len, self.grid)))
        self.present, self.images = np.zeros(len(LABELS), dtype=np.int64), 0

    def add(self, probs8: np.ndarray, truth: np.ndarray, classes8: np.ndarray | None = None) -> None:
        values = all_gate_scores(probs8, classes8, self.top_k, self.kinds)  # {kind: (N, 4)}
        for c in range(len(LABELS)):
            kinds = np.stack([values[kind][:, c] for kind in self.kinds], axis=1)
            self.sums[c] += grid_scores(probs8[:, c], truth[:, c], *self.grid[:3], gate_values=kinds) * len(probs8)
            self.present[c] += int(np.count_nonzero(np.asarray(truth[:, c]).any(axis=(-2, -1))))
        self.images += len(probs8)

    def merge(self, others) -> None:
        """Add the sums and counts of other searches over other images (e.g. other ranks')."""
        for other in others:
            self.sums = self.sums + other.sums
            self.present, self.images = self.present + other.present, self.images + other.images

    def result(self) -> dict:
        scores = self.sums / max(self.images, 1)
        pooled = scores.mean(axis=0)
        rule = {key: [] for key in (*RULE_KEYS, "gate_on")}
        before, after, weights = {}, {}, {}
        for c, label in enumerate(LABELS):
            evidence = min(int(self.present[c]), self.images - int(self.present[c]))
            weights[label] = pooled_weight(evidence, self.prior_images)
            best = least_aggressive_best((1 - weights[label]) * scores[c] + weights[label] * pooled)
            current = tuple(values.index(value) for values, value in zip(self.grid, self.current[c]))
            before[label], after[label] = float(scores[c][current]), float(scores[c][best])
            for key, values, index in zip(rule, self.grid, best):
                rule[key].append(values[index])
        return {**rule, "top_k": self.top_k, "images": self.images, "force_label": None,
                "cv_dice": {"before": {"mean": float(np.mean(list(before.values()))), **before},
                            "after": {"mean": float(np.mean(list(after.values()))), **after}},
                "images_with": dict(zip(LABELS, self.present.tolist())), "pooled_weight": weights}


def pooled_weight(evidence: int, prior_images: float) -> float:
    """The pooled classes' share in the choice of a class with `evidence` images of its rarer
    kind (with it, or without it): 1 with none, 1/2 at PRIOR_IMAGES, → 0 as evidence grows.

    Without images of both kinds every rule that empties (or keeps) all masks ties for best, and
    a search on the class alone would learn "always empty" from a fold where it happens to be
    absent; with a few, its own Dice is noise that a threshold can overfit.
    """
    return prior_images / (evidence + prior_images) if prior_images > 0 else 0.0


def least_aggressive_best(scores: np.ndarray) -> tuple[int, ...]:
    """Index (threshold, min area, gate[, gate score]) of the best score in grids sorted ascending;
    among exact ties, the first gate score (the top-k mean, needing no head), then the rule that
    removes least: lowest gate, then smallest minimum area, then lowest threshold."""
    ties = np.argwhere(scores == scores.max())
    return tuple(min(ties.tolist(), key=lambda index: index[::-1]))


_MISSING = object()


def _rule_value(current, key: str, default=_MISSING):
    if isinstance(current, Mapping):
        return current[key] if default is _MISSING else current.get(key, default)
    return getattr(current, key) if default is _MISSING else getattr(current, key, default)


def pool(run_dirs: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The runs' OOF files concatenated (head probabilities: None unless every run has them); an
    image held out by two runs is an error."""
    parts = [read_oof(run / OOF_FILE, with_classes=True) for run in run_dirs]
    ids = np.concatenate([p[0] for p in parts])
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        shared = unique[counts > 1][0]
        holders = [str(run) for run, part in zip(run_dirs, parts) if shared in part[0]]
        raise ValueError(f"image {shared} is out-of-fold in more than one run ({', '.join(holders)}); "
                         "pool runs of different folds")
    headless = [str(run) for run, part in zip(run_dirs, parts) if part[3] is None]
    if headless and len(headless) < len(parts):
        log.warning("the head's probabilities are left out of the tuning: %s has none", ", ".join(headless))
    classes = None if headless else np.concatenate([p[3] for p in parts])
    return ids, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), classes


NOTE_WEIGHT = 0.05  # a pooled share worth a line in the table and the training log


def pooled_notes(result: dict) -> list[str]:
    """One line per class whose rule leans on the pooled classes (a share of NOTE_WEIGHT or more),
    and why: for `cloudseg tune`'s table and the training log."""
    return [f"{label}: {result['images_with'][label]} image(s) with it and "
            f"{result['images'] - result['images_with'][label]} without, so its rule is "
            f"{result['pooled_weight'][label]:.0%} the four classes' pooled Dice"
            for label in LABELS if result["pooled_weight"][label] >= NOTE_WEIGHT]


def table(result: dict) -> str:
    """The before/after table that `cloudseg tune` prints."""
    lines = [f"{'class':<8}{'threshold':>10}{'min_area':>10}{'gate':>6}{'gate on':>8}{'CV before':>11}{'CV after':>10}"
             f"{'boxes':>7}"]
    for c, label in enumerate(LABELS):
        lines.append(f"{label:<8}{result['threshold'][c]:>10.2f}{result['min_area'][c]:>10}{result['gate'][c]:>6.2f}"
                     f"{result['gate_on'][c]:>8}{result['cv_dice']['before'][label]:>11.4f}"
                     f"{result['cv_dice']['after'][label]:>10.4f}{'yes' if result['box'][c] else 'no':>7}")
    lines.append(f"{'mean':<42}{result['cv_dice']['before']['mean']:>11.4f}{result['cv_dice']['after']['mean']:>10.4f}")
    if any(result["box"]):
        lines.append(f"bounding boxes where the table says yes: CV {result['cv_dice']['boxed']['mean']:.4f}")
    if result.get("force_label") is not None:
        lines.append(f"at least one label per image: the likeliest class above {result['force_label']:.2f} where the "
                     f"rule leaves none; CV {result['cv_dice']['forced']['mean']:.4f}")
    lines += pooled_notes(result)
    in_sample = result.get("in_sample_images", 0)
    lines.append(f"{result['images'] - in_sample} out-of-fold images from {len(result['runs'])} run(s)"
                 + (f" and {in_sample} in-sample ones (the folds' ensemble; the CV figures are the out-of-fold images')"
                    if in_sample else "") + ", searched in "
                 f"{human_duration(result['seconds'])}; wrote {result['path']}")
    return "\n".join(lines)
