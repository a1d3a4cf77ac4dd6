"""`cloudseg tune`: the post-processing rule per class, searched on pooled out-of-fold probabilities.

Data path: probabilities at 350×525 (oof.npz) → **the rule of the post-process step**
(postprocess.json), which every run also searches for itself at its end.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cloudseg.config import load_config
from cloudseg.oof import OOF_FILE, read_oof
from cloudseg.postprocess import GATES, MIN_AREAS, RULE_FILE, RULE_KEYS, THRESHOLDS, TOP_K, grid_scores, write_rule_file
from cloudseg.task import LABELS

# Images with and without a class that the search needs before it changes that class's rule.
MIN_IMAGES = 5


def tune(run_dirs: list[str | Path], out: str | Path | None = None) -> dict:
    """Search threshold, minimum area and gate per class; write postprocess.json; return it.

    The runs' own rule (predict.* in the first run's config.yaml) is part of the grid, so the
    tuned CV Dice is never below the untuned one on the same images.
    """
    ids, probs, truth = pool([Path(r) for r in run_dirs])
    current = load_config(Path(run_dirs[0]) / "config.yaml").predict
    started = time.perf_counter()
    result = search_rule(probs, truth, current)
    result.update(runs=[str(r) for r in run_dirs], seconds=time.perf_counter() - started)
    out = Path(out) if out else Path(run_dirs[0]).parent / RULE_FILE
    write_rule_file(result, out)
    result["path"] = str(out)
    return result


def search_rule(probs8: np.ndarray, truth: np.ndarray, current, top_k: int = TOP_K,
                min_images: int = MIN_IMAGES) -> dict:
    """The best rule per class on these images, with its mean Dice before (current rule) and after.

    probs8: (N, 4, H, W) uint8 probabilities at submission size; truth: the (N, 4, H, W) masks
    (bool or integer); current: the rule in force, per-class `threshold`, `min_area`, `gate`
    (`config.predict` or a mapping). See `RuleSearch` for the guard and the result.
    """
    search = RuleSearch(current, top_k, min_images)
    search.add(probs8, truth)
    return search.result()


class RuleSearch:
    """The search of `search_rule`, fed batch by batch: each class's grid of Dice sums and its
    image counts add up, so a validation pass keeps no probabilities, and processes that each
    saw a shard `merge` into the search over all images.

    Guard against a small fold: a class with fewer than `min_images` images with it, or
    without it, keeps the current rule; ties between best rules go to the one that removes
    least. `result()` gives the rule under RULE_KEYS, `top_k`, `images`, `cv_dice` {before,
    after: {mean, label: Dice}} and `kept` {label: why the guard kept it}.
    """

    def __init__(self, current, top_k: int = TOP_K, min_images: int = MIN_IMAGES):
        self.mine = [[_rule_value(current, key)[c] for key in RULE_KEYS] for c in range(len(LABELS))]
        self.grids = [[sorted(set(values) | {value}) for values, value in zip((THRESHOLDS, MIN_AREAS, GATES), mine)]
                      for mine in self.mine]
        self.top_k, self.min_images = top_k, min_images
        self.sums = [np.zeros([len(values) for values in grid]) for grid in self.grids]
        self.present, self.images = np.zeros(len(LABELS), dtype=np.int64), 0

    def add(self, probs8: np.ndarray, truth: np.ndarray) -> None:
        for c, grid in enumerate(self.grids):
            self.sums[c] += grid_scores(probs8[:, c], truth[:, c], *grid, top_k=self.top_k) * len(probs8)
            self.present[c] += int(np.count_nonzero(np.asarray(truth[:, c]).any(axis=(-2, -1))))
        self.images += len(probs8)

    def merge(self, others) -> None:
        """Add the sums and counts of other searches over other images (e.g. other ranks')."""
        for other in others:
            self.sums = [mine + theirs for mine, theirs in zip(self.sums, other.sums)]
            self.present, self.images = self.present + other.present, self.images + other.images

    def result(self) -> dict:
        rule = {key: [] for key in RULE_KEYS}
        before, after, kept = {}, {}, {}
        for c, label in enumerate(LABELS):
            grid, scores = self.grids[c], self.sums[c] / max(self.images, 1)
            current = tuple(values.index(value) for values, value in zip(grid, self.mine[c]))
            kept_because = too_few_images(int(self.present[c]), self.images - int(self.present[c]), self.min_images)
            best = current if kept_because else least_aggressive_best(scores)
            if kept_because:
                kept[label] = kept_because
            before[label], after[label] = float(scores[current]), float(scores[best])
            for key, values, index in zip(rule, grid, best):
                rule[key].append(values[index])
        return {**rule, "top_k": self.top_k, "images": self.images,
                "cv_dice": {"before": {"mean": float(np.mean(list(before.values()))), **before},
                            "after": {"mean": float(np.mean(list(after.values()))), **after}},
                "kept": kept}


def too_few_images(present: int, absent: int, min_images: int) -> str | None:
    """Why a class with `present` images with it and `absent` without is too thin to tune on
    (None when it is not).

    Without images of both kinds every rule that empties (or keeps) all masks ties for best, and
    the search would learn "always empty" from a fold where the class happens to be absent.
    """
    if min(present, absent) >= min_images:
        return None
    return f"{present} image(s) with it and {absent} without; tuning needs {min_images} of each"


def least_aggressive_best(scores: np.ndarray) -> tuple[int, int, int]:
    """Index (threshold, min area, gate) of the best score in grids sorted ascending; among exact
    ties, the rule that removes least: lowest gate, then smallest minimum area, then lowest threshold."""
    ties = np.argwhere(scores == scores.max())
    t, a, g = min(ties.tolist(), key=lambda index: index[::-1])
    return t, a, g


def _rule_value(current, key: str):
    return current[key] if isinstance(current, Mapping) else getattr(current, key)


def pool(run_dirs: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs' OOF files concatenated; an image held out by two runs is an error."""
    parts = [read_oof(run / OOF_FILE) for run in run_dirs]
    ids = np.concatenate([p[0] for p in parts])
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"image {unique[counts > 1][0]} is out-of-fold in more than one run; pool runs of different folds")
    return ids, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def table(result: dict) -> str:
    """The before/after table that `cloudseg tune` prints."""
    lines = [f"{'class':<8}{'threshold':>10}{'min_area':>10}{'gate':>6}{'CV before':>11}{'CV after':>10}"]
    for c, label in enumerate(LABELS):
        lines.append(f"{label:<8}{result['threshold'][c]:>10.2f}{result['min_area'][c]:>10}{result['gate'][c]:>6.2f}"
                     f"{result['cv_dice']['before'][label]:>11.4f}{result['cv_dice']['after'][label]:>10.4f}")
    lines.append(f"{'mean':<34}{result['cv_dice']['before']['mean']:>11.4f}{result['cv_dice']['after']['mean']:>10.4f}")
    lines += [f"{label}: kept the run's rule ({why})" for label, why in result.get("kept", {}).items()]
    lines.append(f"{result['images']} out-of-fold images from {len(result['runs'])} run(s), searched in "
                 f"{result['seconds']:.1f} s; wrote {result['path']}")
    return "\n".join(lines)
