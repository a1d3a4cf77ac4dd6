"""Pictures: masks over images, training curves, and the plots the notebooks show.

Notebooks only call these; they define no logic of their own.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import matplotlib

matplotlib.use("Agg")  # files, not windows: training and `cloudseg show` run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from cloudseg import rle  # noqa: E402
from cloudseg.metrics import resize_masks  # noqa: E402
from cloudseg.task import LABELS, SUBMISSION_SHAPE  # noqa: E402

COLORS = {"Fish": (230, 25, 75), "Flower": (60, 180, 75), "Gravel": (255, 225, 25), "Sugar": (0, 130, 200)}
"""One RGB colour per class, in every picture."""
LEGEND_HEIGHT = 24


def overlay(image: np.ndarray, masks: np.ndarray, alpha: float = 0.35) -> np.ndarray:
    """H×W×3 RGB uint8 with each class's mask tinted in its colour and outlined."""
    out = image.astype(np.float32)
    for label, mask in zip(LABELS, masks):
        colour, on = np.array(COLORS[label], np.float32), mask.astype(bool)
        out[on] = (1 - alpha) * out[on] + alpha * colour
        edge = on & ~cv2.erode(mask.astype(np.uint8), np.ones((5, 5), np.uint8)).astype(bool)
        out[edge] = colour
    return out.astype(np.uint8)


def panels(image: np.ndarray, masks_by_title: dict[str, np.ndarray]) -> np.ndarray:
    """Side-by-side overlays at 350×525 (one per title, e.g. truth and prediction) over a legend."""
    small = cv2.resize(image, SUBMISSION_SHAPE[::-1], interpolation=cv2.INTER_AREA)
    tiles = []
    for title, masks in masks_by_title.items():
        tile = overlay(small, resize_masks(np.asarray(masks, np.uint8)))
        cv2.putText(tile, title, (8, 22), cv2.FONT_HERSHEY_SIMPLEX, 0.7, (255, 255, 255), 2, cv2.LINE_AA)
        tiles.append(tile)
    row = np.concatenate(tiles, axis=1)
    return np.concatenate([row, legend(row.shape[1])], axis=0)


def legend(width: int) -> np.ndarray:
    strip = np.zeros((LEGEND_HEIGHT, width, 3), np.uint8)
    for i, label in enumerate(LABELS):
        x = 8 + i * 110
        cv2.rectangle(strip, (x, 6), (x + 14, 18), COLORS[label], -1)
        cv2.putText(strip, label, (x + 20, 18), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (255, 255, 255), 1, cv2.LINE_AA)
    return strip


def save_png(path: str | Path, rgb: np.ndarray) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
        raise ValueError(f"{path}: could not write the PNG")
    return path


def decode_row(table: pd.DataFrame, image_id: str, shape) -> np.ndarray:
    """The four masks of one image from a label table (see data.read_label_csv)."""
    return np.stack([rle.decode(table.at[image_id, label], shape) for label in LABELS])


# ---------------------------------------------------------------------------------- curves


def plot_curves(metrics: pd.DataFrame, path: str | Path | None = None):
    """Loss, mean Dice, per-class Dice and learning rate per epoch (a run's metrics.csv)."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
    axes[0].plot(metrics["epoch"], metrics["train_loss"], "o-", label="train")
    axes[0].plot(metrics["epoch"], metrics["valid_loss"], "o-", label="validation")
    axes[1].plot(metrics["epoch"], metrics["dice"], "o-", color="black", label="mean")
    for label in LABELS:
        axes[2].plot(metrics["epoch"], metrics[f"dice_{label}"], "o-", color=np.array(COLORS[label]) / 255, label=label)
    axes[3].plot(metrics["epoch"], metrics["lr"], "o-")
    for ax, title in zip(axes, ("loss", "validation Dice", "Dice per class", "learning rate")):
        ax.set(title=title, xlabel="epoch")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=80, format="png")
        plt.close(fig)
    return fig


def show(image_ids: list[str], data_dir: str | Path, submission: str | Path | None, out_dir: str | Path) -> list[Path]:
    """`cloudseg show`: one PNG per image: truth (train.csv, or test_solution.csv for test
    images when present) and, with a submission, the predicted masks beside it."""
    from cloudseg.data import read_image, read_label_csv, read_train_csv
    from cloudseg.synth import TEST_SOLUTION_CSV
    from cloudseg.task import TEST_IMAGES, TRAIN_IMAGES

    data_dir = Path(data_dir)
    train = read_train_csv(data_dir)
    solution = read_label_csv(data_dir / TEST_SOLUTION_CSV) if (data_dir / TEST_SOLUTION_CSV).is_file() else None
    predicted = read_label_csv(submission) if submission else None
    written = []
    for image_id in image_ids:
        in_train = image_id in train.index
        image = read_image(data_dir / (TRAIN_IMAGES if in_train else TEST_IMAGES) / image_id)
        views = {}
        if in_train:
            views["truth"] = decode_row(train, image_id, image.shape[:2])
        elif solution is not None and image_id in solution.index:
            views["truth"] = decode_row(solution, image_id, SUBMISSION_SHAPE)
        if predicted is not None and not (in_train and image_id not in predicted.index):
            if image_id not in predicted.index:
                raise KeyError(f"{submission}: no rows for image {image_id}")
            views["prediction"] = decode_row(predicted, image_id, SUBMISSION_SHAPE)
        if not views:
            views["image"] = np.zeros((len(LABELS), *SUBMISSION_SHAPE), np.uint8)
        written.append(save_png(Path(out_dir) / f"{Path(image_id).stem}.png", panels(image, views)))
    return written
