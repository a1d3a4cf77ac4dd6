"""Pictures: masks over images, training curves, and the plots the notebooks show: a look at
every step of the data path, from train.csv to the submission.

Notebooks only call these; they define no logic of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import cv2
import numpy as np

from cloudseg import rle
from cloudseg.metrics import resize_masks
from cloudseg.task import LABELS, SUBMISSION_SHAPE

if TYPE_CHECKING:  # pandas in the functions that make tables: segment imports this module for `overlay`
    import pandas as pd

COLORS = {"Fish": (230, 25, 75), "Flower": (60, 180, 75), "Gravel": (255, 225, 25), "Sugar": (0, 130, 200)}
"""One RGB colour per class, in every picture."""
LEGEND_HEIGHT = 24


def pyplot():
    """matplotlib.pyplot, imported at the first plot, not with this module: it takes a second, and
    the masks and overlays (segment, show) are drawn with OpenCV alone. Without a display matplotlib
    picks Agg; notebooks keep their inline backend."""
    import matplotlib.pyplot as plt

    return plt


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


# ---------------------------------------------------------------------------------- curves


def plot_curves(metrics: pd.DataFrame, path: str | Path | None = None):
    """Loss, mean Dice, per-class Dice and learning rate per epoch (a run's metrics.csv)."""
    fig, axes = pyplot().subplots(1, 4, figsize=(18, 3.6))
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
        pyplot().close(fig)
    return fig


def show(image_ids: list[str], data_dir: str | Path, submission: str | Path | None, out_dir: str | Path) -> list[Path]:
    """`cloudseg show`: one PNG per image: truth (train.csv, or test_solution.csv for test
    images when present) and, with a submission, the predicted masks beside it."""
    from cloudseg.data import decode_masks, read_image, read_label_csv, read_train_csv
    from cloudseg.synth import TEST_SOLUTION_CSV
    from cloudseg.task import TEST_IMAGES, TRAIN_CSV, TRAIN_IMAGES

    data_dir = Path(data_dir)
    train = read_train_csv(data_dir)
    solution = read_label_csv(data_dir / TEST_SOLUTION_CSV) if (data_dir / TEST_SOLUTION_CSV).is_file() else None
    predicted = read_label_csv(submission) if submission else None
    written = []
    for image_id in map(image_file_name, image_ids):
        in_train = image_id in train.index
        image = read_image(data_dir / (TRAIN_IMAGES if in_train else TEST_IMAGES) / image_id)
        views = {}
        if in_train:
            views["truth"] = decode_masks(train, image_id, image.shape[:2], data_dir / TRAIN_CSV)
        elif solution is not None and image_id in solution.index:
            views["truth"] = decode_masks(solution, image_id, SUBMISSION_SHAPE, data_dir / TEST_SOLUTION_CSV)
        if predicted is not None and not (in_train and image_id not in predicted.index):
            if image_id not in predicted.index:
                raise KeyError(f"{submission}: no rows for image {image_id}")
            views["prediction"] = decode_masks(predicted, image_id, SUBMISSION_SHAPE, submission)
        if not views:
            views["image"] = np.zeros((len(LABELS), *SUBMISSION_SHAPE), np.uint8)
        written.append(save_png(Path(out_dir) / f"{Path(image_id).stem}.png", panels(image, views)))
    return written


def image_file_name(image_id: str) -> str:
    """An image id as a user types it: Kaggle's ids are file names, `03580aa.jpg`, and `03580aa`
    means the same image."""
    return image_id if Path(image_id).suffix else f"{image_id}.jpg"


# ---------------------------------------------------------------------------------- EDA


def find_data(preferred: str | Path = "data/kaggle", fallback: str | Path = "data/synthetic") -> tuple[Path, str]:
    """The data folder a notebook should use, and a sentence saying which (CLOUDSEG_DATA overrides)."""
    import os

    if os.environ.get("CLOUDSEG_DATA"):
        return Path(os.environ["CLOUDSEG_DATA"]), f"Using {os.environ['CLOUDSEG_DATA']} (CLOUDSEG_DATA)."
    if (Path(preferred) / "train.csv").is_file():
        return Path(preferred), f"Using the Kaggle data in {preferred}."
    if not (Path(fallback) / "train.csv").is_file():
        from cloudseg.synth import synthesize

        synthesize(fallback, n_train=64, n_test=8, height=192, width=288, seed=0)
    return Path(fallback), f"No Kaggle data in {preferred}: using the SYNTHETIC dataset in {fallback}."


def label_stats(labels: pd.DataFrame) -> dict[str, pd.DataFrame | pd.Series]:
    """Share of images with each label, the label co-occurrence matrix, labels per image."""
    present = labels[list(LABELS)].ne("").astype(int)
    return {"frequency": present.mean(), "cooccurrence": present.T @ present,
            "per_image": present.sum(axis=1).value_counts().sort_index()}


def mask_stats(labels: pd.DataFrame, shape, limit: int = 500, seed: int = 0) -> pd.DataFrame:
    """Per (image, label) with a mask: coverage (area fraction) and bounding-box height and width
    as fractions of the image, on up to `limit` images."""
    import pandas as pd

    ids = labels.index.to_series().sample(min(limit, len(labels)), random_state=seed)
    rows = []
    for image_id in ids:
        for label in LABELS:
            if labels.at[image_id, label]:
                mask = rle.decode(labels.at[image_id, label], shape)
                ys, xs = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
                rows.append({"label": label, "coverage": mask.mean(), "box_height": (ys[-1] - ys[0] + 1) / shape[0],
                             "box_width": (xs[-1] - xs[0] + 1) / shape[1]})
    return pd.DataFrame(rows)


def band_stats(image_dir: str | Path, image_ids, limit: int = 200) -> pd.Series:
    """Black (no-data) share of each image, on up to `limit` images."""
    import pandas as pd

    from cloudseg.data import read_image
    from cloudseg.predict import BLACK_LEVEL

    shares = {i: (read_image(Path(image_dir) / i) <= BLACK_LEVEL).all(-1).mean() for i in list(image_ids)[:limit]}
    return pd.Series(shares, name="black share")


def plot_label_stats(stats: dict):
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 3.8))
    stats["frequency"].plot.bar(ax=axes[0], color=[np.array(COLORS[c]) / 255 for c in LABELS], title="share of images with the label")
    axes[1].imshow(stats["cooccurrence"], cmap="Blues")
    axes[1].set(xticks=range(4), yticks=range(4), xticklabels=LABELS, yticklabels=LABELS, title="images with both labels")
    for (i, j), v in np.ndenumerate(stats["cooccurrence"].to_numpy()):
        axes[1].text(j, i, v, ha="center", va="center")
    stats["per_image"].plot.bar(ax=axes[2], title="labels per image", color="grey")
    fig.tight_layout()
    return fig


def plot_mask_stats(stats: pd.DataFrame):
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 3.8))
    for label in LABELS:
        part = stats[stats.label == label]
        colour = np.array(COLORS[label]) / 255
        axes[0].hist(part.coverage, bins=20, range=(0, 1), histtype="step", lw=2, color=colour, label=label)
        axes[1].scatter(part.box_width, part.box_height, s=10, color=colour, label=label)
    axes[0].set(title="mask coverage (area fraction)", xlabel="coverage")
    axes[1].set(title="mask bounding boxes", xlabel="width / image width", ylabel="height / image height")
    axes[0].legend()
    fig.tight_layout()
    return fig


def plot_band_stats(shares: pd.Series):
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    ax.hist(shares, bins=20, range=(0, 1), color="black")
    ax.set(title=f"black no-data share ({(shares > 0.001).mean():.0%} of images have some)", xlabel="share of the image")
    fig.tight_layout()
    return fig


def plot_grid(pictures: list[np.ndarray], titles: list[str], columns: int = 2):
    """Pictures (e.g. from `panels`) in a grid."""
    rows = -(-len(pictures) // columns)
    fig, axes = pyplot().subplots(rows, columns, figsize=(8 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, picture, title in zip(axes.ravel(), pictures, titles):
        ax.imshow(picture)
        ax.set_title(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------- results


def oof_dice(run_dir: str | Path, rule: dict | None = None) -> pd.DataFrame:
    """Per-image Dice of a run's out-of-fold predictions under a post-processing rule (default:
    the run's config), with the per-class columns."""
    import pandas as pd

    from cloudseg.checkpoint import load_checkpoint
    from cloudseg.config import from_dict
    from cloudseg.metrics import dice
    from cloudseg.oof import OOF_FILE, read_oof
    from cloudseg.postprocess import RULE_DEFAULTS, postprocess

    ids, probs8, truth = read_oof(Path(run_dir) / OOF_FILE)
    if rule is None:
        rule = from_dict(load_checkpoint(Path(run_dir) / "last.pt")["config"]).predict.model_dump()
    masks = postprocess(probs8, rule["threshold"], rule["min_area"], rule.get("gate", (0.0,) * 4),
                        box=rule.get("box", RULE_DEFAULTS["box"]))
    frame = pd.DataFrame(dice(masks, truth), index=ids, columns=list(LABELS))
    return frame.assign(dice=frame.mean(1))


def plot_postprocess_effect(result: dict):
    """Per-class CV Dice before and after tuning, from a postprocess.json."""
    before, after = result["cv_dice"]["before"], result["cv_dice"]["after"]
    keys = [*LABELS, "mean"]
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    x = np.arange(len(keys))
    ax.bar(x - 0.2, [before[k] for k in keys], 0.4, label="before tuning", color="lightgrey")
    ax.bar(x + 0.2, [after[k] for k in keys], 0.4, label="after tuning", color="steelblue")
    ax.set(xticks=x, xticklabels=keys, ylim=(0, 1), title="out-of-fold Dice")
    ax.legend()
    fig.tight_layout()
    return fig


def oof_pictures(run_dir: str | Path, data_dir: str | Path, image_ids, rule: dict | None = None) -> list[np.ndarray]:
    """truth | prediction panels for out-of-fold images of a run."""
    from cloudseg.data import read_image
    from cloudseg.oof import OOF_FILE, read_oof
    from cloudseg.postprocess import RULE_DEFAULTS, postprocess
    from cloudseg.task import TRAIN_IMAGES

    ids, probs8, truth = read_oof(Path(run_dir) / OOF_FILE)
    rows = {image_id: i for i, image_id in enumerate(ids)}
    rule = rule or {"threshold": (0.5,) * 4, "min_area": (0,) * 4}
    pictures = []
    for image_id in image_ids:
        i = rows[image_id]
        pred = postprocess(probs8[i : i + 1], rule["threshold"], rule["min_area"], rule.get("gate", (0.0,) * 4),
                           box=rule.get("box", RULE_DEFAULTS["box"]))[0]
        image = read_image(Path(data_dir) / TRAIN_IMAGES / image_id)
        pictures.append(panels(image, {"truth": truth[i], "prediction": pred}))
    return pictures


def find_run(root: str | Path = "runs") -> Path:
    """The run a results notebook shows: CLOUDSEG_RUN, else the newest run with metrics.csv."""
    import os

    if os.environ.get("CLOUDSEG_RUN"):
        return Path(os.environ["CLOUDSEG_RUN"])
    runs = sorted(Path(root).glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"no run with metrics.csv under {root}/: run `make train` first")
    return runs[-1].parent


def run_metrics(run_dir: str | Path) -> pd.DataFrame:
    """A run's metrics.csv."""
    import pandas as pd

    return pd.read_csv(Path(run_dir) / "metrics.csv")


def tuned_rule(run_dir: str | Path) -> dict | None:
    """The run's own postprocess.json (every run tunes itself; `cloudseg tune RUN` again), what
    `cloudseg predict` applies to its best.pt; else, for a fold of `make cv` (CV_DIR/foldK), the
    pooled one beside it; else None."""
    from cloudseg.postprocess import RULE_FILE, is_cv_fold, read_rule_file

    run_dir = Path(run_dir).resolve()
    pooled = [run_dir.parent / RULE_FILE] if is_cv_fold(run_dir) else []
    for path in (run_dir / RULE_FILE, *pooled):
        if path.is_file():
            return read_rule_file(path)
    return None


# ---------------------------------------------------------------------------------- segment (satellite scenes)


def scene_map(scene_path: str | Path, out_dir: str | Path | None = None, masks: np.ndarray | None = None) -> np.ndarray:
    """The scene with the masks `cloudseg segment` wrote for it into `out_dir`, or with `masks`
    (4×H×W, e.g. the truth), drawn over it, above a legend. The scene is read whole: for a look at
    small ones."""
    from cloudseg.geo import open_scene

    with open_scene(scene_path) as scene:
        image = scene.read(0, 0, scene.height, scene.width)[0].permute(1, 2, 0).numpy()
    masks = written_masks(Path(scene_path), Path(out_dir)) if masks is None else masks
    return np.concatenate([overlay(image, masks), legend(image.shape[1])], axis=0)


def written_masks(scene_path: Path, out_dir: Path) -> np.ndarray:
    """4×H×W masks that `cloudseg segment` wrote for a scene (NAME.tif's mask bands, or
    NAME_masks.png's class bits), 0 on no-data."""
    from cloudseg.geo import NODATA, geo_module, is_geotiff

    if is_geotiff(scene_path):
        with geo_module("rasterio").open(out_dir / f"{scene_path.stem}.tif") as maps:
            masks = maps.read(list(range(len(LABELS) + 1, 2 * len(LABELS) + 1)))
        return np.where(masks == NODATA, 0, masks).astype(np.uint8)
    path = out_dir / f"{scene_path.stem}_masks.png"
    bits = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if bits is None:
        raise FileNotFoundError(f"{path}: no masks of cloudseg segment to draw (map the scene into {out_dir} first)")
    valid = bits != NODATA  # NODATA has every bit set: read as bits, it would be all four classes
    return np.stack([((bits >> k) & 1) * valid for k in range(len(LABELS))]).astype(np.uint8)


def training_image_shape(run_dir: str | Path) -> tuple[int, int]:
    """(H, W) of the images a run trained on: its data.image_size, else its first training image's."""
    from cloudseg.config import load_config
    from cloudseg.data import image_shape
    from cloudseg.task import TRAIN_IMAGES

    data = load_config(Path(run_dir) / "config.yaml").data
    return tuple(data.image_size or image_shape(min((Path(data.dir) / TRAIN_IMAGES).iterdir())))


def plot_gridded_fractions(grid, index: int = 0):
    """One map per class of a grid.nc dataset's `fraction` at time (or scene) `index`, with the
    valid pixels per cell beside them."""
    first = grid.fraction.dims[0]
    fig, axes = pyplot().subplots(1, len(LABELS) + 1, figsize=(4 * (len(LABELS) + 1), 3.4))
    extent = [float(grid.lon.min()) - grid.grid_degrees / 2, float(grid.lon.max()) + grid.grid_degrees / 2,
              float(grid.lat.min()) - grid.grid_degrees / 2, float(grid.lat.max()) + grid.grid_degrees / 2]
    for ax, label in zip(axes, LABELS):
        shown = ax.imshow(grid.fraction.isel({first: index}).sel({"class": label}).values, origin="lower",
                          extent=extent, vmin=0, vmax=1, cmap="viridis")
        ax.set(title=label, xlabel="longitude", ylabel="latitude")
    fig.colorbar(shown, ax=axes[:-1], label="area fraction")
    cells = axes[-1].imshow(grid.valid_pixels.isel({first: index}).values, origin="lower", extent=extent, cmap="Greys")
    axes[-1].set(title="valid pixels", xlabel="longitude")
    fig.colorbar(cells, ax=axes[-1])
    fig.suptitle(f"{first} {grid[first].values[index]}")
    return fig
