"""Kaggle-layout datasets that cloudseg was never tuned on: the data of the robustness study.

`cloudseg synth` paints flat-brightness textures in axis-aligned boxes with slanted black
bands. This generator is a different model on purpose, so that a recipe that only works on
`cloudseg synth` fails here:

- textures: band-limited noise fields (a ring of spatial frequencies, optionally narrowed
  to one orientation: stripes and ripples) and blob fields of a given density and size.
  Every class of a variant has the same mean brightness and contrast: classes differ in
  texture statistics (scale, orientation, density), never by a brightness offset. Stripe
  orientations are 0° or 90° only, which the demo's flip augmentation maps to themselves.
- regions: ellipses, rotated boxes or unions of small boxes, painted with soft edges; the
  label is the hard region, as a crowd-drawn outline is.
- label frequencies per class (rare ~15%, common ~70%), every image with at least one label.
- sizes that are not multiples of 32 and no-data wedges cut from a corner (or none).

The `noisy-*` variants label the way Kaggle's crowd did (see `Labellers`): each image holds
true cloud regions and unlabelled clutter; two to four simulated labellers each draw loose
boxes around the regions they see, missing some, naming some with the wrong class, merging
near boxes of one class; the label is the union of their boxes minus the no-data area. Their
test folder also gets `box_oracle.csv`: the true regions' boxes as a submission, the most a
model that found every region exactly could score against labels drawn this way.

Usage: python benchmarks/kaggle_like.py VARIANT --out DIR [--n-train 64 --n-test 16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import cv2
import numpy as np
import pandas as pd

from cloudseg import rle
from cloudseg.files import atomic_path
from cloudseg.metrics import resize_masks
from cloudseg.synth import write_dataset
from cloudseg.task import ID_COLUMN, LABELS, RLE_COLUMN, SAMPLE_SUBMISSION_CSV, image_label

REFERENCE_WIDTH = 525  # texture scales below are in pixels at this width; they scale with the image
BOX_ORACLE_CSV = "box_oracle.csv"  # noisy variants: the true regions' boxes, as a submission of the test images


@dataclass(frozen=True)
class Labellers:
    """How a crowd labels an image, as on Kaggle (about 3 of 68 scientists per image, loose
    rectangles, the truth their union). Shares are per labeller and region; `padding` and
    `merge_gap` are shares of the image side."""

    count: tuple[int, int] = (2, 4)  # labellers per image, inclusive
    miss: float = 0.35  # a labeller does not label a region
    wrong_class: float = 0.25  # labels it as another class
    padding: tuple[float, float] = (0.0, 0.15)  # each side of a region's bounding box moves out by this much
    merge_gap: float = 0.12  # two boxes of one class this close become the box around both
    regions: tuple[int, int] = (1, 2)  # true regions per present class, inclusive
    clutter: tuple[int, int] = (1, 3)  # small unlabelled cloud patches per image, inclusive


@dataclass(frozen=True)
class Texture:
    """`noise`: band-limited noise of period `period` px (`angle` in degrees narrows it to
    stripes across that direction); `blobs`: round blobs of radius `period` px, `density` per
    10,000 px²."""

    kind: str
    period: float
    angle: float | None = None
    density: float = 0.0


@dataclass(frozen=True)
class Variant:
    textures: dict[str, Texture]
    frequencies: tuple[float, float, float, float]  # share of images with each class, LABELS order
    size: tuple[int, int] = (350, 525)
    shape: str = "ellipse"  # ellipse, rotated_box or box_union
    region_scale: tuple[float, float] = (0.25, 0.55)  # region extent as a share of the image side
    wedge_probability: float = 0.0  # share of images with a black no-data wedge
    contrast: float = 22.0  # texture amplitude (grey levels, std)
    lift: float = 45.0  # cloud brightness over the sea, equal for every class
    sea_noise: float = 4.0  # fine sensor noise (grey levels, std)
    seed: int = 0
    labellers: Labellers | None = None  # None: the label is the painted region itself


VARIANTS = {
    # Four noise scales, ellipses, the Kaggle size, one rare class.
    "noise-ellipses": Variant(
        textures={"Fish": Texture("noise", 6), "Flower": Texture("noise", 14),
                  "Gravel": Texture("noise", 30), "Sugar": Texture("noise", 3)},
        frequencies=(0.70, 0.15, 0.45, 0.30), size=(350, 525), shape="ellipse", wedge_probability=0.3, seed=11),
    # Stripes: two orientations x two periods, rotated boxes, smaller images, no wedges.
    "ripples-rotated": Variant(
        textures={"Fish": Texture("noise", 8, angle=0), "Flower": Texture("noise", 8, angle=90),
                  "Gravel": Texture("noise", 20, angle=0), "Sugar": Texture("noise", 20, angle=90)},
        frequencies=(0.30, 0.70, 0.15, 0.50), size=(280, 420), shape="rotated_box", seed=12),
    # Blob fields of different densities and sizes, unions of boxes, many wedges.
    "blobs-union": Variant(
        textures={"Fish": Texture("blobs", 3, density=40), "Flower": Texture("blobs", 9, density=6),
                  "Gravel": Texture("blobs", 5, density=20), "Sugar": Texture("blobs", 16, density=2)},
        frequencies=(0.50, 0.30, 0.70, 0.15), size=(224, 336), shape="box_union", wedge_probability=0.5, seed=13),
    # One family each, two rare classes, two common ones.
    "mixed-rare": Variant(
        textures={"Fish": Texture("noise", 10, angle=0), "Flower": Texture("blobs", 8, density=8),
                  "Gravel": Texture("noise", 4), "Sugar": Texture("noise", 24)},
        frequencies=(0.15, 0.15, 0.70, 0.70), size=(320, 480), shape="ellipse", wedge_probability=0.2, seed=14),
    # Faint textures over a noisy sea, smaller regions: the case of faint false positives.
    "faint-small": Variant(
        textures={"Fish": Texture("noise", 5), "Flower": Texture("blobs", 6, density=12),
                  "Gravel": Texture("noise", 18, angle=90), "Sugar": Texture("noise", 12)},
        frequencies=(0.70, 0.45, 0.30, 0.15), size=(300, 450), shape="rotated_box",
        region_scale=(0.18, 0.40), contrast=12.0, lift=22.0, sea_noise=7.0, wedge_probability=0.25, seed=15),
}
# The same textures labelled by a crowd. True class shares are lower than the clean variants':
# wrong-class boxes add labels, so that the labels come to ~2.1 per image and 45-50% of the
# (image, label) pairs empty, as on Kaggle (the script's summary line prints both). Smaller
# images than the clean variants, for a CPU budget of ten trainings per study.
NOISY_SIZE = (224, 336)
VARIANTS |= {
    f"noisy-{name}": replace(VARIANTS[name], labellers=Labellers(), size=NOISY_SIZE, seed=VARIANTS[name].seed + 50,
                             frequencies=frequencies)
    for name, frequencies in (("noise-ellipses", (0.55, 0.15, 0.40, 0.30)),
                              ("ripples-rotated", (0.30, 0.50, 0.15, 0.40)),
                              ("blobs-union", (0.40, 0.25, 0.50, 0.15)),
                              ("mixed-rare", (0.15, 0.15, 0.50, 0.55)),
                              ("faint-small", (0.50, 0.40, 0.30, 0.15)))
}


def generate(variant: Variant, out_dir, n_train: int = 64, n_test: int = 16) -> Path:
    """Write train/test images, train.csv, sample_submission.csv and test_solution.csv (test
    masks at 350×525) in the layout of `cloudseg synth`; for a variant with labellers also
    BOX_ORACLE_CSV (written last, like every CSV of a finished dataset)."""
    rng = np.random.default_rng(variant.seed)
    oracles = []

    def draw():
        image, labels, oracle = sample_with_oracle(rng, variant)
        oracles.append(oracle)
        return image, labels

    out_dir = write_dataset(out_dir, draw, n_train, n_test, jpeg_quality=92)
    if variant.labellers is not None:
        write_box_oracle(out_dir, oracles[n_train:])
    return out_dir


def write_box_oracle(out_dir: Path, oracles: list[np.ndarray]) -> Path:
    """The test images' true-region boxes (4×H×W each, in test order) as a submission at 350×525."""
    ids = pd.read_csv(out_dir / SAMPLE_SUBMISSION_CSV)[ID_COLUMN].str.rsplit("_", n=1).str[0].unique()
    rows = [(image_label(image_id, label), rle.encode(mask))
            for image_id, boxes in zip(ids, oracles) for label, mask in zip(LABELS, resize_masks(boxes))]
    with atomic_path(out_dir / BOX_ORACLE_CSV) as tmp:
        pd.DataFrame(rows, columns=[ID_COLUMN, RLE_COLUMN]).to_csv(tmp, index=False)
    return out_dir / BOX_ORACLE_CSV


def sample(rng: np.random.Generator, variant: Variant) -> tuple[np.ndarray, np.ndarray]:
    """One image (H×W×3 uint8 RGB) and its label masks (4×H×W uint8)."""
    image, labels, _ = sample_with_oracle(rng, variant)
    return image, labels


def sample_with_oracle(rng: np.random.Generator, variant: Variant) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image, its label masks, and the box oracle's masks (4×H×W uint8 each): with
    labellers, the crowd's boxes and the true regions' boxes; without, the regions themselves
    (twice)."""
    height, width = variant.size
    present = label_set(rng, variant.frequencies)
    valid = valid_area(rng, variant)
    crowd = variant.labellers
    regions = [(index, present_region(rng, variant, valid))
               for index in np.flatnonzero(present) for _ in range(1 if crowd is None else rng.integers(
                   crowd.regions[0], crowd.regions[1] + 1))]
    painted = np.zeros((len(LABELS), height, width), np.uint8)
    for index, mask in regions:
        painted[index] |= mask
    if crowd is None:
        return paint(rng, variant, painted, valid), painted, painted
    for _ in range(rng.integers(crowd.clutter[0], crowd.clutter[1] + 1)):  # cloud that nobody labels
        small = replace(variant, region_scale=(0.06, 0.14))
        painted[rng.integers(len(LABELS))] |= region(rng, variant.shape, variant.size, small.region_scale) & valid
    oracle = np.zeros_like(painted)
    for index, mask in regions:
        oracle[index] |= box_mask(bounding_box(mask), variant.size)
    return paint(rng, variant, painted, valid), crowd_labels(rng, crowd, regions, valid), oracle * valid


def paint(rng, variant: Variant, painted: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """The image of cloud masks `painted` (4×H×W, each class's texture in its mask) over the sea."""
    height, width = variant.size
    unit = width / REFERENCE_WIDTH
    grey = sea(rng, height, width, unit, variant.sea_noise)
    soft = [cv2.GaussianBlur(m.astype(np.float32), (0, 0), 6 * unit) for m in painted]  # cloud edges fade
    grey += variant.lift * np.max(soft, axis=0)
    for label, mask, alpha in zip(LABELS, painted, soft):
        if mask.any():
            grey += variant.contrast * alpha * texture(rng, variant.textures[label], height, width, unit)
    tint = np.array([0.6, 0.8, 1.0], np.float32)  # blue-grey sea, whiter where brighter
    image = np.clip(grey[..., None] * tint + np.clip(grey - 60, 0, None)[..., None] * (1 - tint), 0, 255)
    return (image * valid[..., None]).astype(np.uint8)


def crowd_labels(rng, crowd: Labellers, regions: list[tuple[int, np.ndarray]], valid: np.ndarray,
                 tries: int = 20) -> np.ndarray:
    """The union of the labellers' boxes per class, minus no-data (4×H×W uint8); drawn again
    while it is empty, since every Kaggle image has at least one label."""
    size = valid.shape
    for _ in range(tries):
        labels = np.zeros((len(LABELS), *size), np.uint8)
        for _ in range(rng.integers(crowd.count[0], crowd.count[1] + 1)):
            for index, box in labeller_boxes(rng, crowd, regions, size):
                labels[index] |= box_mask(box, size)
        labels *= valid
        if labels.any():
            return labels
    raise RuntimeError(f"the labellers left an image unlabelled {tries} times; lower Labellers.miss")


def labeller_boxes(rng, crowd: Labellers, regions, size) -> list[tuple[int, tuple[float, float, float, float]]]:
    """One labeller's boxes (class, (x0, y0, x1, y1)): each region seen or missed, its class
    right or wrong, its box loose; near boxes of one class merged into one."""
    height, width = size
    boxes: dict[int, list] = {}
    for index, mask in regions:
        if rng.random() < crowd.miss:
            continue
        if rng.random() < crowd.wrong_class:
            index = int(rng.choice([c for c in range(len(LABELS)) if c != index]))
        pad = rng.uniform(*crowd.padding, 4) * (width, height, width, height)
        x0, y0, x1, y1 = bounding_box(mask)
        boxes.setdefault(index, []).append((x0 - pad[0], y0 - pad[1], x1 + pad[2], y1 + pad[3]))
    gap = crowd.merge_gap * max(height, width)
    return [(index, box) for index, drawn in boxes.items() for box in merged(drawn, gap)]


def merged(boxes: list, gap: float) -> list:
    """Boxes with every two that come within `gap` of each other replaced by the box around both."""
    boxes = list(boxes)
    joined = True
    while joined:
        joined = False
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                a, b = boxes[i], boxes[j]
                if max(a[0], b[0]) - min(a[2], b[2]) <= gap and max(a[1], b[1]) - min(a[3], b[3]) <= gap:
                    boxes[i] = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))
                    del boxes[j]
                    joined = True
                    break
            if joined:
                break
    return boxes


def bounding_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of a non-empty mask, x1 and y1 exclusive."""
    x, y, w, h = cv2.boundingRect(mask.astype(np.uint8))
    return x, y, x + w, y + h


def box_mask(box, size: tuple[int, int]) -> np.ndarray:
    """A uint8 mask of `size` that is 1 inside the box (x0, y0, x1, y1), clipped to the image."""
    height, width = size
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    mask = np.zeros(size, np.uint8)
    mask[max(0, y0) : min(height, y1), max(0, x0) : min(width, x1)] = 1
    return mask


def label_set(rng: np.random.Generator, frequencies) -> np.ndarray:
    """Which classes an image has: each with its own frequency; an image that drew none gets
    one class, drawn in proportion to the frequencies (so each share rises by
    P(none) · p / Σp, see `expected_frequencies`)."""
    frequencies = np.asarray(frequencies, float)
    present = rng.random(len(frequencies)) < frequencies
    if not present.any():
        present[rng.choice(len(frequencies), p=frequencies / frequencies.sum())] = True
    return present


def expected_frequencies(frequencies) -> np.ndarray:
    """The share of images with each class that `label_set` gives (at least one label each)."""
    frequencies = np.asarray(frequencies, float)
    return frequencies + np.prod(1 - frequencies) * frequencies / frequencies.sum()


def present_region(rng, variant: Variant, valid: np.ndarray, tries: int = 50) -> np.ndarray:
    """A region of the variant's shape with at least 1% of the image outside the no-data area."""
    for _ in range(tries):
        mask = region(rng, variant.shape, variant.size, variant.region_scale) & valid
        if mask.mean() >= 0.01:
            return mask.astype(np.uint8)
    raise RuntimeError(f"no region of shape {variant.shape} fits beside the no-data area in {tries} tries")


def region(rng, shape: str, size: tuple[int, int], scale: tuple[float, float]) -> np.ndarray:
    """A bool mask of one label region: an ellipse, a rotated box or a union of 2-4 boxes."""
    height, width = size
    canvas = np.zeros(size, np.uint8)
    extent = rng.uniform(*scale, 2) * (width, height)  # (w, h) in pixels
    centre = rng.uniform(0.15, 0.85, 2) * (width, height)
    angle = rng.uniform(0, 180)
    if shape == "ellipse":
        cv2.ellipse(canvas, (centre, extent, angle), 1, thickness=-1)
    elif shape == "rotated_box":
        cv2.fillPoly(canvas, [cv2.boxPoints((centre, extent, angle)).round().astype(np.int32)], 1)
    elif shape == "box_union":
        for _ in range(rng.integers(2, 5)):
            w, h = extent * rng.uniform(0.4, 0.8, 2)
            x, y = centre + rng.uniform(-0.5, 0.5, 2) * extent - (w / 2, h / 2)
            canvas[max(0, int(y)) : max(0, int(y + h)), max(0, int(x)) : max(0, int(x + w))] = 1
    else:
        raise ValueError(f"unknown region shape {shape!r}; expected ellipse, rotated_box or box_union")
    return canvas.astype(bool)


def valid_area(rng, variant: Variant) -> np.ndarray:
    """False inside a black no-data wedge cut from a random corner (on some images)."""
    height, width = variant.size
    valid = np.ones(variant.size, np.uint8)
    if rng.random() < variant.wedge_probability:
        corner = np.array([rng.integers(2) * width, rng.integers(2) * height])
        along_x = np.array([abs(corner[0] - rng.uniform(0.2, 0.6) * width), corner[1]])
        along_y = np.array([corner[0], abs(corner[1] - rng.uniform(0.2, 0.7) * height)])
        cv2.fillPoly(valid, [np.stack([corner, along_x, along_y]).round().astype(np.int32)], 0)
    return valid.astype(bool)


def sea(rng, height: int, width: int, unit: float, fine_noise: float) -> np.ndarray:
    """Dark sea: slow swells of brightness plus sensor noise (float32 grey levels)."""
    swell = 10 * band_noise(rng, height, width, 150 * unit)
    return (50 + swell + rng.normal(0, fine_noise, (height, width))).astype(np.float32)


def texture(rng, spec: Texture, height: int, width: int, unit: float) -> np.ndarray:
    """A zero-mean, unit-variance texture field (float32 H×W)."""
    if spec.kind == "noise":
        return band_noise(rng, height, width, spec.period * unit, spec.angle)
    if spec.kind == "blobs":
        return blob_field(rng, height, width, spec.period * unit, spec.density / unit**2)
    raise ValueError(f"unknown texture kind {spec.kind!r}; expected noise or blobs")


def band_noise(rng, height: int, width: int, period: float, angle: float | None = None) -> np.ndarray:
    """White noise filtered to a log-normal ring around frequency 1/period (octave-wide); with
    `angle`, also to ±15° around that direction of the wave vector: stripes."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    radius = np.hypot(fy, fx)
    with np.errstate(divide="ignore"):
        gain = np.exp(-0.5 * (np.log(radius * period) / 0.35) ** 2)
    if angle is not None:
        offset = np.angle(np.exp(2j * (np.arctan2(fy, fx) - np.radians(angle)))) / 2  # orientation mod 180°
        gain *= np.exp(-0.5 * (offset / np.radians(15)) ** 2)
    field = np.fft.irfft2(np.fft.rfft2(rng.standard_normal((height, width))) * gain, s=(height, width))
    return standardize(field)


def blob_field(rng, height: int, width: int, radius: float, density: float) -> np.ndarray:
    """Round blurred blobs of about `radius` px at `density` per 10,000 px², placed at random."""
    canvas = np.zeros((height, width), np.float32)
    count = rng.poisson(density * height * width / 10_000)
    for x, y, r in zip(rng.uniform(0, width, count), rng.uniform(0, height, count),
                       radius * rng.uniform(0.7, 1.3, count)):
        cv2.circle(canvas, (int(x), int(y)), max(1, int(r)), 1.0, thickness=-1)
    return standardize(cv2.GaussianBlur(canvas, (0, 0), max(0.5, radius / 3)))


def standardize(field: np.ndarray) -> np.ndarray:
    field = np.asarray(field, np.float32)
    return (field - field.mean()) / max(float(field.std()), 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="instead of the variant's size")
    args = parser.parse_args()
    variant = VARIANTS[args.variant]
    variant = replace(variant, size=tuple(args.size)) if args.size else variant
    print(f"wrote {generate(variant, args.out, args.n_train, args.n_test)}")


if __name__ == "__main__":
    main()
