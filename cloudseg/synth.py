"""A synthetic dataset in the exact Kaggle layout, learnable in minutes on a CPU: what
enters the data path (train.csv, images) when the Kaggle data is not there.

Each class paints its own texture inside large axis-aligned boxes (like the crowd-drawn
labels), classes may overlap, every image has at least one label, and some images carry a
slanted black no-data band that the labels exclude, as in the real swath gaps.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from cloudseg import rle
from cloudseg.files import atomic_path
from cloudseg.metrics import resize_masks
from cloudseg.task import (
    ID_COLUMN,
    IMAGE_SHAPE,
    LABELS,
    RLE_COLUMN,
    SAMPLE_SUBMISSION_CSV,
    TEST_IMAGES,
    TRAIN_CSV,
    TRAIN_IMAGES,
    image_label,
)

TEST_SOLUTION_CSV = "test_solution.csv"
MIN_SIDE = 16
BAND_PROBABILITY = 0.3
CLOUD_BRIGHTNESS = {"Fish": 110, "Flower": 80, "Gravel": 140, "Sugar": 60}


def synthesize(out_dir, n_train=64, n_test=16, height=IMAGE_SHAPE[0], width=IMAGE_SHAPE[1], seed=0) -> Path:
    """Write train/test images, train.csv, sample_submission.csv and test_solution.csv."""
    if min(height, width) < MIN_SIDE:  # the bands and boxes of `sample` need room (smaller ones never end)
        raise ValueError(f"synthetic images need at least {MIN_SIDE} pixels a side, got {height}x{width}")
    rng = np.random.default_rng(seed)
    return write_dataset(out_dir, lambda: sample(rng, height, width), n_train, n_test)


def write_dataset(out_dir, draw, n_train: int, n_test: int, jpeg_quality: int = 95) -> Path:
    """The Kaggle layout from `draw()` (an H×W×3 uint8 RGB image and its 4×H×W masks), called
    for the train images, then the test images: JPEGs, train.csv, sample_submission.csv, and
    test_solution.csv with the test masks at 350×525. Also benchmarks/kaggle_like.py's writer."""
    out_dir = Path(out_dir)
    (out_dir / TRAIN_CSV).unlink(missing_ok=True)  # a dataset written over is unfinished until its new train.csv
    train_ids = [f"{i:07x}.jpg" for i in range(n_train)]
    test_ids = [f"{i:07x}.jpg" for i in range(n_train, n_train + n_test)]
    train_rows, solution_rows = [], []
    for split, ids, rows in ((TRAIN_IMAGES, train_ids, train_rows), (TEST_IMAGES, test_ids, solution_rows)):
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        for image_id in tqdm(ids, desc=f"synth {split}", leave=False, disable=None):
            image, masks = draw()
            path = out_dir / split / image_id
            if not cv2.imwrite(str(path), cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality]):
                raise OSError(f"{path}: OpenCV could not write the image (is the disk full, or a folder in the way?)")
            if split == TEST_IMAGES:
                masks = resize_masks(masks)  # test truth is scored at submission size
            rows += [(image_label(image_id, label), rle.encode(m)) for label, m in zip(LABELS, masks)]
    # CSVs last: a dataset with a train.csv is a finished one.
    sample_rows = [(image_label(i, label), "1 1") for i in test_ids for label in LABELS]
    for name, rows in ((TEST_SOLUTION_CSV, solution_rows), (SAMPLE_SUBMISSION_CSV, sample_rows), (TRAIN_CSV, train_rows)):
        with atomic_path(out_dir / name) as tmp:
            pd.DataFrame(rows, columns=[ID_COLUMN, RLE_COLUMN]).to_csv(tmp, index=False)
    return out_dir


def sample(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic image (H×W×3 uint8 RGB) and its masks (4×H×W uint8)."""
    while True:
        boxes = np.stack([_boxes(rng, height, width) if present else np.zeros((height, width), bool)
                          for present in _label_set(rng)])
        valid = _valid_area(rng, height, width)
        masks = (boxes & valid).astype(np.uint8)
        if masks.any():
            break
    unit = max(height, width) / 384  # textures scale with the image, so every size looks alike
    grey = _ocean(rng, height, width, unit)
    for label, box in zip(LABELS, boxes):
        if box.any():
            grey += CLOUD_BRIGHTNESS[label] * TEXTURES[label](rng, height, width, unit) * box
    ocean_tint = np.array([0.55, 0.75, 1.0], np.float32)  # dark blue sea, white clouds
    cloud = np.clip(grey - 40, 0, None)[..., None]
    image = np.clip(grey[..., None] * ocean_tint + cloud * (1 - ocean_tint), 0, 255)
    return (image * valid[..., None]).astype(np.uint8), masks


def _label_set(rng) -> np.ndarray:
    present = rng.random(len(LABELS)) < 0.45
    present[rng.integers(len(LABELS))] = True
    return present


def _boxes(rng, height, width) -> np.ndarray:
    mask = np.zeros((height, width), bool)
    for _ in range(rng.integers(1, 3)):
        h, w = (rng.uniform(0.25, 0.6, 2) * (height, width)).astype(int)
        y, x = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
        mask[y : y + h, x : x + w] = True
    return mask


def _valid_area(rng, height, width) -> np.ndarray:
    """False inside a slanted no-data band (on some images), True elsewhere."""
    if rng.random() >= BAND_PROBABILITY:
        return np.ones((height, width), bool)
    y, x = np.mgrid[0:height, 0:width]
    centre, slope, half_width = rng.uniform(0.2, 0.8) * width, rng.uniform(-0.3, 0.3), rng.uniform(0.05, 0.12) * width
    return np.abs(x - (centre + slope * y)) > half_width


def _ocean(rng, height, width, unit) -> np.ndarray:
    coarse = rng.normal(0, 12, (max(2, int(height / (48 * unit))), max(2, int(width / (48 * unit)))))
    smooth = cv2.resize(coarse.astype(np.float32), (width, height), interpolation=cv2.INTER_CUBIC)
    return 50 + smooth + rng.normal(0, 4, (height, width)).astype(np.float32)


def _stripes(rng, height, width, unit):  # Fish: diagonal bands of cloud
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    return 0.5 + 0.5 * np.sin((x + y) * (2 * np.pi / (14 * unit)) + rng.uniform(0, 2 * np.pi))


def _flowers(rng, height, width, unit):  # Flower: a lattice of round puffs
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    period, phase = 18 * unit, rng.uniform(0, 18 * unit, 2)
    dy, dx = (y + phase[0]) % period - period / 2, (x + phase[1]) % period - period / 2
    return (np.hypot(dy, dx) < 5 * unit).astype(np.float32)


def _gravel(rng, height, width, unit):  # Gravel: coarse random speckle
    cells = rng.random((int(height / (3 * unit)) + 1, int(width / (3 * unit)) + 1)).astype(np.float32)
    return cv2.resize(cells, (width, height), interpolation=cv2.INTER_NEAREST)


def _sugar(rng, height, width, unit):  # Sugar: faint fine horizontal streaks
    y = np.arange(height, dtype=np.float32)[:, None]
    return np.broadcast_to((np.sin(y * (2 * np.pi / (5 * unit)) + rng.uniform(0, 6.3)) > 0).astype(np.float32), (height, width))


TEXTURES = {"Fish": _stripes, "Flower": _flowers, "Gravel": _gravel, "Sugar": _sugar}


def synthetic_scene(path, rows: int = 2, columns: int = 3, shape=(192, 288), *, west: float = -58.0,
                    north: float = 15.0, degrees_per_pixel: float = 0.01, when: str = "2020:02:02 14:00:00",
                    seed: int = 0) -> tuple[Path, np.ndarray]:
    """A georeferenced satellite scene for `cloudseg segment`: rows×columns synthetic images of
    `shape` side by side in one RGB GeoTIFF (EPSG:4326, its north-west corner at west, north,
    square pixels of `degrees_per_pixel`, TIFFTAG_DATETIME `when`). Returns the path and the
    scene's true masks (4×H×W). Needs the geo extra (rasterio)."""
    from cloudseg.geo import geo_module, write_rgb_geotiff

    rng = np.random.default_rng(seed)
    drawn = [[sample(rng, *shape) for _ in range(columns)] for _ in range(rows)]
    image = np.concatenate([np.concatenate([d[0] for d in row], axis=1) for row in drawn], axis=0)
    masks = np.concatenate([np.concatenate([d[1] for d in row], axis=2) for row in drawn], axis=1)
    transform = geo_module("rasterio.transform").from_origin(west, north, degrees_per_pixel, degrees_per_pixel)
    write_rgb_geotiff(path, image, "EPSG:4326", transform, tags={"TIFFTAG_DATETIME": when})
    return Path(path), masks
