"""From probabilities at submission size to binary masks, and the search for the rule's parameters.

Data path: probabilities at 350×525 → **post-process** → submission.

The rule, per class: quantize probabilities to uint8 (as out-of-fold files store them), keep
pixels above the threshold, drop 8-connected components smaller than the minimum area, and
empty the mask unless its gate score clears the gate; with `box`, each component left
becomes its bounding box (Kaggle's labels are the union of labellers' rectangles, so on noisy
labels a box can score higher than the shape the model saw). The gate score (`gate_on`) is the
mean of the image's `top_k` highest probabilities of the class (`top_k`), the classification
head's probability (`head`), or the mean of the two (`score`, pudae's class score, 1st place).
Then, with `force_label`, an image the rule left without any label keeps the class of highest
presence score (the mean of head and top-k mean; the top-k mean without a head), its pixels
above `force_label`: every Kaggle image has at least one label.
Tuning and prediction apply this same rule to the same uint8 values (head probabilities too).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import cv2
import numpy as np

from cloudseg.files import atomic_path
from cloudseg.task import LABELS

TOP_K = 1000  # pixels whose mean probability the empty-mask gate looks at (0.5% of 350x525)
THRESHOLDS = tuple(round(0.20 + 0.03 * i, 2) for i in range(20))
MIN_AREAS = (0, 1000, 2500, 5000, 7500, 10000, 12500, 15000, 20000, 25000)
GATES = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


RULE_KEYS = ("threshold", "min_area", "gate")
GATE_SCORES = ("top_k", "head", "score")  # top_k first: among tied rules the search keeps the one without the head
HEAD_GATES = ("head", "score")
# Keys that files written before them lack, with the value that reads them as they were meant.
RULE_DEFAULTS = {"gate_on": ["top_k"] * len(LABELS), "box": [False] * len(LABELS), "force_label": None}
RULE_FILE = "postprocess.json"  # every run writes its tuned rule under this name; make cv the pooled one


def is_cv_fold(run_dir: Path) -> bool:
    """Whether `run_dir` is one of make cv's folds (CV_DIR/foldK), whose pooled rule is CV_DIR/RULE_FILE."""
    return re.fullmatch(r"fold\d+", Path(run_dir).name) is not None


def read_rule_file(path: str | Path) -> dict:
    """A postprocess.json written by `cloudseg tune` (the rule under RULE_KEYS, `top_k`, its CV figures)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: post-processing file not found (cloudseg tune writes it)")
    try:
        result = json.loads(path.read_text())
        missing = [key for key in RULE_KEYS if key not in result]
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a cloudseg postprocess.json ({type(error).__name__}: {error})") from None
    if missing:
        raise ValueError(f"{path}: not a cloudseg postprocess.json (no {', '.join(missing)})")
    result.setdefault("top_k", TOP_K)  # files written before the gate existed
    for key, value in RULE_DEFAULTS.items():
        result.setdefault(key, value)
    if not is_per_class(result["gate_on"]) or any(kind not in GATE_SCORES for kind in result["gate_on"]):
        raise ValueError(f"{path}: gate_on must name one of {', '.join(GATE_SCORES)} per class, got {result['gate_on']!r}")
    if not is_per_class(result["box"]) or any(not isinstance(value, bool) for value in result["box"]):
        raise ValueError(f"{path}: box must be true or false per class, got {result['box']!r}")
    if not isinstance(result["top_k"], int) or isinstance(result["top_k"], bool) or result["top_k"] < 1:
        raise ValueError(f"{path}: top_k must be a positive integer, got {result['top_k']!r}")
    return result


def is_per_class(value) -> bool:
    """Whether a rule file's `value` is a list of one entry per class (JSON may hold null or a string there)."""
    return isinstance(value, list) and len(value) == len(LABELS)


def write_rule_file(result: dict, path: str | Path) -> Path:
    """Write a rule (RULE_KEYS, top_k and its figures, as `search_rule` returns it) as JSON, never half-written."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    return Path(path)


def quantize(probs) -> np.ndarray:
    """Probabilities in [0, 1] as uint8 0-255 (the compact form of out-of-fold files)."""
    return np.clip(np.rint(np.asarray(probs, np.float32) * 255), 0, 255).astype(np.uint8)


def postprocess(probs, thresholds, min_areas, gates=(0.0,) * len(LABELS), *, top_k: int = TOP_K,
                gate_on=RULE_DEFAULTS["gate_on"], classes8: np.ndarray | None = None,
                force_label: float | None = None, box=RULE_DEFAULTS["box"]) -> np.ndarray:
    """(N, 4, H, W) probabilities (float or uint8) -> uint8 masks by the rule above; `classes8`:
    the head's (N, 4) uint8 probabilities, needed by the head and score gates."""
    probs8 = probs if probs.dtype == np.uint8 else quantize(probs)
    masks = np.zeros(probs8.shape, np.uint8)
    opened = (gate_scores(probs8, classes8, gate_on, top_k) >= np.asarray(gates) if any(gates)
              else np.ones(probs8.shape[:2], bool))
    for index in np.ndindex(probs8.shape[:2]):
        label = index[1]
        if not opened[index]:
            continue
        mask = (probs8[index] > thresholds[label] * 255).view(np.uint8)
        if min_areas[label] > 0 and mask.any():
            mask = remove_small_components(mask, min_areas[label])
        masks[index] = bounding_boxes(mask) if box[label] and mask.any() else mask
    if force_label is not None:
        force_one_label(masks, probs8, classes8, force_label, top_k)
    return masks


def apply_rule(probs8: np.ndarray, rule: dict, classes8: np.ndarray | None = None) -> np.ndarray:
    """`postprocess` by a whole rule, as `search_rule` returns it and `read_rule_file` reads it."""
    return postprocess(probs8, rule["threshold"], rule["min_area"], rule["gate"], top_k=rule["top_k"],
                       gate_on=rule["gate_on"], classes8=classes8, force_label=rule["force_label"], box=rule["box"])


def gate_scores(probs8: np.ndarray, classes8: np.ndarray | None, gate_on, top_k: int = TOP_K) -> np.ndarray:
    """(N, 4) gate score of each (image, class) in [0, 1], of the kind `gate_on` names per class."""
    kinds = all_gate_scores(probs8, classes8, top_k, [kind for kind in GATE_SCORES if kind in gate_on])
    return np.stack([kinds[kind][:, c] for c, kind in enumerate(gate_on)], axis=1)


def all_gate_scores(probs8: np.ndarray, classes8: np.ndarray | None, top_k: int, kinds=GATE_SCORES) -> dict:
    """{kind: (N, ...) scores} for each of `kinds`; probs8 (N, ..., H, W), classes8 (N, ...)."""
    if classes8 is None and any(kind in HEAD_GATES for kind in kinds):
        raise ValueError(f"the gate scores {', '.join(k for k in kinds if k in HEAD_GATES)} need the "
                         "classification head's probabilities, and this model has no head (model.cls_head)")
    top = top_k_mean(probs8, top_k)
    head = None if classes8 is None else np.asarray(classes8, np.float64) / 255
    every = {"top_k": lambda: top, "head": lambda: head, "score": lambda: (top + head) / 2}
    return {kind: every[kind]() for kind in kinds}


def presence_scores(probs8: np.ndarray, classes8: np.ndarray | None, top_k: int = TOP_K) -> np.ndarray:
    """(N, 4): how sure the model is that each class is present, to choose the forced label:
    pudae's score with a head, the top-k mean without."""
    return all_gate_scores(probs8, classes8, top_k, ["top_k" if classes8 is None else "score"]).popitem()[1]


def force_one_label(masks: np.ndarray, probs8: np.ndarray, classes8: np.ndarray | None, threshold: float,
                    top_k: int = TOP_K) -> np.ndarray:
    """In place: each image whose masks are all empty gets the class of highest presence score,
    its pixels above `threshold` (no minimum area, no gate); other images are left alone."""
    empty = np.flatnonzero(~masks.any(axis=(1, 2, 3)))
    if len(empty):
        chosen = presence_scores(probs8[empty], None if classes8 is None else classes8[empty], top_k).argmax(1)
        masks[empty, chosen] = probs8[empty, chosen] > threshold * 255
    return masks


def top_k_mean(probs8: np.ndarray, top_k: int = TOP_K) -> np.ndarray:
    """Mean of the `top_k` highest probabilities of each mask (shape probs8.shape[:-2]), in [0, 1]."""
    flat = probs8.reshape(*probs8.shape[:-2], -1)
    top_k = min(top_k, flat.shape[-1])
    top = np.partition(flat, flat.shape[-1] - top_k, axis=-1)[..., -top_k:]
    return top.mean(-1, dtype=np.float64) / 255


def bounding_boxes(mask: np.ndarray) -> np.ndarray:
    """The mask with each 8-connected component filled out to its bounding box (boxes may overlap)."""
    count, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    boxes = np.zeros_like(mask)
    for x, y, width, height, _ in stats[1:]:
        boxes[y : y + height, x : x + width] = 1
    return boxes


def remove_small_components(mask: np.ndarray, min_area: int) -> np.ndarray:
    """The mask without its 8-connected components smaller than `min_area` pixels."""
    count, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    keep = stats[:, cv2.CC_STAT_AREA] >= min_area
    keep[0] = False  # background
    return keep[labels].astype(np.uint8)


# ---------------------------------------------------------------------------------- search
#
# The search scores every (threshold, minimum area) on every image without labelling one mask
# per threshold. Masks of rising thresholds are nested, so each pixel gets a level: how many of
# the thresholds it exceeds. For every level k the mask {level >= k} is cut into horizontal
# runs; runs on adjacent rows that touch (8-connectivity) are joined by one connected-components
# call over all levels of a chunk of images, and a component's area and overlap with the truth
# are sums over its runs. The work grows with the number of runs, not pixels x thresholds; on
# noise-like maps, where runs are a pixel or two long, labelling each threshold's mask is faster.

CHUNK = 16  # images per connected-components call (about 30 MB of temporaries at 350x525)


def grid_scores(probs8: np.ndarray, truth: np.ndarray, thresholds=THRESHOLDS, min_areas=MIN_AREAS,
                gates=GATES, *, top_k: int = TOP_K, gate_values: np.ndarray | None = None) -> np.ndarray:
    """Mean Dice of one class over N images for every (threshold, min area, gate): shape (T, A, G).

    probs8: (N, H, W) uint8; truth: (N, H, W) bool or integer (nonzero = the class). Each cell equals
    `postprocess` with that rule followed by `metrics.dice`, averaged over the images. The gate
    looks at the top-k mean, or at `gate_values`: (N, K) scores of K gate kinds, giving (T, A, G, K).
    """
    probs8, truth = np.asarray(probs8), np.asarray(truth)
    if probs8.dtype != np.uint8 or probs8.ndim != 3 or truth.shape != probs8.shape:
        raise ValueError(f"grid_scores needs (N, H, W) uint8 probabilities and a truth of the same shape, "
                         f"got {probs8.dtype} {probs8.shape} and {truth.shape}")
    # For an integer p, p > t*255 exactly when p > floor(t*255): one integer level per threshold.
    levels = np.clip(np.floor(np.asarray(thresholds, np.float64) * 255), -1, 255)
    levels, which = np.unique(levels, return_inverse=True)
    min_areas, gates = np.asarray(min_areas, np.float64), np.asarray(gates, np.float64)
    pred_area, overlap = kept_areas(probs8, truth, levels, min_areas)
    pred_area, overlap = pred_area[:, which.ravel()], overlap[:, which.ravel()]  # (N, T, A)
    truth_area = np.count_nonzero(truth, axis=(1, 2)).astype(np.float64)[:, None, None]
    total = pred_area + truth_area
    dice = np.where(total == 0, 1.0, 2 * overlap / np.maximum(total, 1))  # (N, T, A)
    values = top_k_mean(probs8, top_k)[:, None] if gate_values is None else np.asarray(gate_values, np.float64)
    open_gate = values[:, None, :] >= gates[None, :, None]  # (N, G, K)
    empty_dice = (truth_area[:, 0, 0] == 0).astype(np.float64)  # what a gated-out mask scores
    scores = np.where(open_gate[:, None, None], dice[..., None, None], empty_dice[:, None, None, None, None]).mean(0)
    return scores[..., 0] if gate_values is None else scores


def kept_areas(probs8: np.ndarray, truth: np.ndarray, levels: np.ndarray, min_areas: np.ndarray):
    """Predicted area and overlap with the truth, shape (N, L, A), of {probs8 > level} without its
    8-connected components smaller than each minimum area; `levels` sorted and distinct."""
    # level_of[p]: how many levels the value p exceeds (p > levels[k] exactly when level_of[p] > k)
    level_of = np.searchsorted(levels, np.arange(256), side="left").astype(np.min_scalar_type(len(levels)))
    pred_area = np.zeros((len(probs8), len(levels), len(min_areas)))
    overlap = np.zeros_like(pred_area)
    for i in range(0, len(probs8), CHUNK):
        level_image, chunk_truth = _lookup(probs8[i : i + CHUNK], level_of), truth[i : i + CHUNK] != 0
        textured = _is_textured(level_image, len(levels))
        smooth = slice(None) if not textured.any() else ~textured
        if not textured.all():
            sums = _run_areas(level_image[smooth], chunk_truth[smooth], len(levels), min_areas)
            pred_area[i : i + CHUNK][smooth], overlap[i : i + CHUNK][smooth] = sums
        for j in np.flatnonzero(textured):
            pred_area[i + j], overlap[i + j] = _labelled_areas(level_image[j], chunk_truth[j], len(levels), min_areas)
    return pred_area, overlap


def _is_textured(level_image, n_levels) -> np.ndarray:
    """Which images have so many level steps along their rows (noise-like maps) that labelling each
    level's mask with OpenCV is faster than the runs: measured crossover, n_levels / 25 per pixel."""
    rows = level_image.reshape(-1, level_image.shape[-1])
    if rows.shape[1] < 2:
        return np.zeros(len(level_image), bool)  # nothing to compare (and OpenCV returns None)
    changes = cv2.absdiff(rows[:, 1:], rows[:, :-1]).reshape(len(level_image), -1)
    return changes.sum(1, dtype=np.int64) > changes.shape[1] * n_levels / 25


def _labelled_areas(level_image, truth, n_levels, min_areas):
    """`kept_areas` of one image by labelling the mask of each level."""
    pred_area = np.zeros((n_levels, len(min_areas)))
    overlap = np.zeros_like(pred_area)
    truth_at = np.flatnonzero(truth)
    for k in range(n_levels):
        count, labels, stats, _ = cv2.connectedComponentsWithStats((level_image > k).view(np.uint8), connectivity=8)
        if count == 1:
            break  # empty, and so is every higher level
        area = stats[1:, cv2.CC_STAT_AREA].astype(np.float64)
        hits = np.bincount(labels.ravel()[truth_at], minlength=count)[1:].astype(np.float64)
        keep = area[:, None] >= min_areas[None, :]
        pred_area[k], overlap[k] = area @ keep, hits @ keep
    return pred_area, overlap


def _lookup(probs8, table):
    """table[probs8], through OpenCV's faster lookup when the table is uint8."""
    if table.dtype != np.uint8:
        return table[probs8]
    return cv2.LUT(probs8.reshape(-1, probs8.shape[-1]), table).reshape(probs8.shape)


def _run_areas(level_image, truth, n_levels, min_areas):
    """`kept_areas` of a few images, from their (n, H, W) level image, through runs (see above)."""
    n, height, width = level_image.shape
    # One zero column each side and a zero row below each image: no run crosses a row end and
    # no component joins two images, so the chunk can be treated as one tall image.
    padded = np.zeros((n, height + 1, width + 2), level_image.dtype)
    padded[:, :height, 1:-1] = level_image
    level, start, stop = _runs(padded)  # flat positions in `padded`
    count, component = _components(level, start, stop, padded.size, width + 2)
    padded_truth = np.zeros(padded.shape, bool)
    padded_truth[:, :height, 1:-1] = truth
    truth_before = np.zeros(padded.size + 1, np.int32)  # truth pixels before each position
    np.cumsum(padded_truth, out=truth_before[1:])
    area = np.bincount(component, stop - start, count)
    hits = np.bincount(component, truth_before[stop] - truth_before[start], count)
    cell = np.zeros(count, np.int64)  # (image, level) of each component
    cell[component] = start // padded[0].size * n_levels + level - 1
    keep = area[:, None] >= min_areas[None, :]  # (components, A)
    where = (cell[:, None] * len(min_areas) + np.arange(len(min_areas))).ravel()
    size = n * n_levels * len(min_areas)
    sums = [np.bincount(where, (values[:, None] * keep).ravel(), size) for values in (area, hits)]
    return [s.reshape(n, n_levels, len(min_areas)) for s in sums]


def _runs(padded):
    """Horizontal runs of {padded >= k} for every k >= 1: (k, start, stop) with flat positions,
    stop exclusive, sorted by k then position."""
    flat = padded.ravel()
    step = np.flatnonzero(flat[1:] != flat[:-1]) + 1  # flat[step] differs from the value before it
    before, after = flat[step - 1], flat[step]
    rising = after > before
    # A step from level a up to b starts a run of each level a+1..b; a step down from b to a ends them.
    level, start = _levels_between(before[rising], after[rising], step[rising])
    _, stop = _levels_between(after[~rising], before[~rising], step[~rising])
    return level, start, stop


def _levels_between(low, high, position):
    """(k, position) for each k in low+1..high of each step, sorted by k then position."""
    owner, offset = _expand(high.astype(np.int64) - low)
    level = (offset + 1 + low[owner]).astype(np.int16)  # int16 sorts by radix
    order = np.argsort(level, kind="stable")  # positions are already sorted
    return level[order], position[owner[order]]


def _components(level, start, stop, level_stride, row_stride):
    """Connected components of runs (8-connectivity between adjacent rows of the same level)."""
    from scipy.sparse import csr_array  # here: SciPy takes a second to import, and only the rule search needs it
    from scipy.sparse.csgraph import connected_components

    if len(level) == 0:
        return 0, np.zeros(0, np.intp)
    offset = level.astype(np.int64) * level_stride
    run_start, run_stop = offset + start, offset + stop
    # Runs below run r that touch it: start <= r's stop and stop >= r's start, one row down.
    first = np.searchsorted(run_stop, run_start + row_stride, "left")
    last = np.searchsorted(run_start, run_stop + row_stride, "right")
    touching = np.maximum(last - first, 0)
    owner, rank = _expand(touching)
    indptr = np.concatenate([[0], np.cumsum(touching)])
    graph = csr_array((np.ones(len(owner), np.int8), first[owner] + rank, indptr), shape=(len(level),) * 2)
    return connected_components(graph, directed=True, connection="weak")


def _expand(counts):
    """For each i, counts[i] copies of i, each with its rank 0..counts[i]-1."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
