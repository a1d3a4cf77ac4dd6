"""`cloudseg check`: read every sample the way training and prediction read it, and report
every problem at once, before a long run finds the first one.

Data path: the first two steps, **train.csv → Dataset**, run over everything in advance.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from cloudseg.data import CloudDataset, Problem, most_common_size, read_folds_csv
from cloudseg.hardware import usable_cores
from cloudseg.task import FOLDS_CSV, IMAGE_SHAPE


def check_dataset(data_dir: str | Path, image_size: tuple[int, int] | None = None,
                  workers: int | None = None) -> tuple[list[Problem], list[str]]:
    """(problems, summary lines) for the Kaggle-layout folder `data_dir`.

    Each split's CSV rows and images go through `CloudDataset` in skip mode, so every bad
    row and every unreadable, grayscale/CMYK or wrongly sized image is one Problem, as is a
    damaged row of folds.csv where there is one. The
    expected size is `image_size`, or else the size most image headers give. Images are read on
    `workers` threads (default: the cores this process may use).
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such folder")
    splits, problems = {}, []
    for split in ("train", "test"):
        try:
            splits[split] = CloudDataset(data_dir, split, on_bad_sample="skip")
        except (ValueError, FileNotFoundError) as error:  # a missing CSV or a wrong header
            problems.append(Problem("", str(error)))
    if (data_dir / FOLDS_CSV).is_file():  # its rows; whether its folds suit a config is training's to say
        try:
            read_folds_csv(data_dir / FOLDS_CSV)
        except ValueError as error:
            problems.append(Problem("", str(error)))
    all_images = (dataset.image_dir / image_id for dataset in splits.values() for image_id in dataset.image_ids)
    image_size = tuple(image_size or most_common_size(all_images) or IMAGE_SHAPE)
    summary = [f"{data_dir}: expected image size {image_size[0]}x{image_size[1]}"]
    for split, dataset in splits.items():
        dataset.image_size = image_size
        bad_images = unreadable(dataset, workers or usable_cores(), f"checking {split}")
        summary.append(f"{split}: {len(dataset)} images with valid rows; {len(dataset.skipped)} bad rows, "
                       f"{len(bad_images)} bad images")
        problems += dataset.skipped + bad_images
    return problems, summary


def unreadable(dataset: CloudDataset, workers: int, desc: str) -> list[Problem]:
    """The Problems of the dataset's items (skip mode), read on `workers` threads: OpenCV's
    JPEG decode, most of the work, runs outside Python's lock."""

    def problem(index: int) -> Problem | None:
        return dataset[index].get("problem")

    with ThreadPoolExecutor(workers) as pool:
        found = tqdm(pool.map(problem, range(len(dataset))), desc=desc, total=len(dataset), unit="image", disable=None)
        return [p for p in found if p is not None]
