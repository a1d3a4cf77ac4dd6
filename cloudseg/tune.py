"""`cloudseg tune`: the post-processing rule per class, searched on pooled out-of-fold probabilities."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from cloudseg.checkpoint import load_checkpoint
from cloudseg.config import from_dict
from cloudseg.files import atomic_path
from cloudseg.oof import OOF_FILE, read_oof
from cloudseg.postprocess import GATES, MIN_AREAS, RULE_KEYS, THRESHOLDS, TOP_K, grid_scores
from cloudseg.task import LABELS


def tune(run_dirs: list[str | Path], out: str | Path | None = None) -> dict:
    """Search threshold, minimum area and gate per class; write postprocess.json; return it.

    The runs' own rule (their config's predict.*) is part of the grid, so the tuned CV Dice
    is never below the untuned one on the same images.
    """
    ids, probs, truth = pool([Path(r) for r in run_dirs])
    current = from_dict(load_checkpoint(Path(run_dirs[0]) / "last.pt")["config"]).predict
    started = time.perf_counter()
    rule = {key: [] for key in RULE_KEYS}
    before, after = {}, {}
    for c, label in enumerate(LABELS):
        mine = (current.threshold[c], current.min_area[c], current.gate[c])
        grid = [sorted(set(values) | {value}) for values, value in zip((THRESHOLDS, MIN_AREAS, GATES), mine)]
        scores = grid_scores(probs[:, c], truth[:, c], *grid)
        before[label] = float(scores[tuple(values.index(value) for values, value in zip(grid, mine))])
        best = np.unravel_index(np.argmax(scores), scores.shape)
        after[label] = float(scores[best])
        for key, values, index in zip(rule, grid, best):
            rule[key].append(values[index])
    result = {**rule, "top_k": TOP_K, "images": len(ids), "runs": [str(r) for r in run_dirs],
              "cv_dice": {"before": {"mean": float(np.mean(list(before.values()))), **before},
                          "after": {"mean": float(np.mean(list(after.values()))), **after}},
              "seconds": time.perf_counter() - started}
    out = Path(out) if out else Path(run_dirs[0]).parent / "postprocess.json"
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    result["path"] = str(out)
    return result


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
    lines.append(f"{result['images']} out-of-fold images from {len(result['runs'])} run(s), searched in "
                 f"{result['seconds']:.1f} s; wrote {result['path']}")
    return "\n".join(lines)
