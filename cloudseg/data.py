"""The data layer: train.csv, images, folds, and the Dataset that serves them at native size.

Data path: **train.csv → Dataset → loader** → model → loss → accumulated step → checkpoint →
probabilities at 350×525 → post-process → submission.
"""

from __future__ import annotations

import csv
import io
import random
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from cloudseg import rle
from cloudseg.decode import ENCODED_KEYS, check_replayable, draw_steps
from cloudseg.files import atomic_path
from cloudseg.task import (
    FOLDS_CSV,
    ID_COLUMN,
    LABELS,
    PAD_MULTIPLE,
    RLE_COLUMN,
    SAMPLE_SUBMISSION_CSV,
    TEST_IMAGES,
    TRAIN_CSV,
    TRAIN_IMAGES,
    image_label,
    split_image_label,
)

if TYPE_CHECKING:
    import pandas as pd

# ---------------------------------------------------------------------------------- CSV


class Problem(NamedTuple):
    """A sample that cannot be used: its image id and a message naming the file or row."""

    image_id: str
    message: str


def read_label_csv(path: str | Path, *, require_all_labels: bool = True,
                   problems: list[Problem] | None = None) -> pd.DataFrame:
    """A Kaggle-format CSV (`Image_Label,EncodedPixels`) as one row per image.

    Returns a frame indexed by image id with one column of RLE strings per label, in
    `LABELS` order, "" meaning no mask. Every run's syntax is checked here, so a malformed
    RLE fails before a long run starts. A bad row (malformed RLE, unknown label, duplicate,
    an image missing a label) raises a ValueError naming the file, line and Image_Label;
    given a `problems` list, it is appended there instead and its image left out. A missing,
    empty or non-UTF-8 file, a wrong header or no rows under it always raises.
    """
    import pandas as pd  # here: pandas takes 0.3 s to import; a command without tables (segment) never does

    path = Path(path)
    text = csv_text(path, f"header '{ID_COLUMN},{RLE_COLUMN}' and a row per image and label")
    frame = csv_frame(text, path, dtype=str, keep_default_na=False)
    missing = [c for c in (ID_COLUMN, RLE_COLUMN) if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; expected header '{ID_COLUMN},{RLE_COLUMN}'")
    if frame.empty:
        raise ValueError(f"{path}: no rows under its header; expected a row per image and label")
    found: list[Problem] = []

    def reject(image_id: str, message: str) -> None:
        if problems is None:
            raise ValueError(message)
        found.append(Problem(image_id, message))

    rows = []
    for line, key, encoded in zip(data_lines(text, len(frame)), frame[ID_COLUMN], frame[RLE_COLUMN]):
        try:
            image_id, label = split_image_label(key)
            rle.parse(encoded)
        except ValueError as error:
            reject(key.rpartition("_")[0] or key, f"{path}, line {line} ({key}): {error}")
            continue
        rows.append((image_id, label, encoded.strip(), line))
    long = pd.DataFrame(rows, columns=["image_id", "label", "rle", "line"])
    for (image_id, label), lines in long.groupby(["image_id", "label"], sort=False)["line"]:
        if len(lines) > 1:
            reject(image_id, f"{path}: duplicate {ID_COLUMN} {image_id}_{label} on lines {lines.tolist()}")
    long = long.drop_duplicates(["image_id", "label"], keep=False)
    table = long.pivot(index="image_id", columns="label", values="rle").reindex(columns=list(LABELS))
    table = table.loc[long["image_id"].drop_duplicates()]  # keep the file's image order
    if require_all_labels:
        rejected = {problem.image_id for problem in found}
        for image_id in table.index[table.isna().any(axis=1)].difference(rejected, sort=False):
            absent = [label for label in LABELS if pd.isna(table.loc[image_id, label])]
            reject(image_id, f"{path}: image {image_id} has no row for label(s) {absent}")
    if found:
        problems.extend(found)
        table = table.drop(index=[p.image_id for p in found], errors="ignore")
    table = table.fillna("")
    table.columns.name = None
    return table


def read_train_csv(data_dir: str | Path, problems: list[Problem] | None = None) -> pd.DataFrame:
    """`data_dir/train.csv` as one row per image, four RLE columns (see `read_label_csv`)."""
    return read_label_csv(Path(data_dir) / TRAIN_CSV, problems=problems)


def test_image_ids(data_dir: str | Path, problems: list[Problem] | None = None) -> list[str]:
    """Test image ids in the order of `sample_submission.csv`."""
    return read_label_csv(Path(data_dir) / SAMPLE_SUBMISSION_CSV, problems=problems).index.tolist()


def csv_text(path: Path, expected: str) -> str:
    """The text of the CSV file at `path`; a missing, non-UTF-8 or empty file is an error naming
    it (and the line, and what it should hold: `expected`). A byte-order mark is dropped; \r\n
    line endings read as \n. One read: the text also gives the rows' line numbers (`data_lines`)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {raw[error.start]:#04x}): save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{path}: empty file; expected {expected}")
    return text


def csv_frame(text: str, path: Path, **options) -> pd.DataFrame:
    """The CSV `text` of the file at `path` as pandas reads it with `options`. A row of more fields
    than the header is an error naming its line: pandas names no file, or, where the first data
    row has one more, takes the first column as an index and shifts every column by one."""
    import pandas as pd

    try:
        frame = pd.read_csv(io.StringIO(text), **options)
    except pd.errors.ParserError as error:
        raise ValueError(overfull_row(text, path) or f"{path}: not a CSV file ({str(error).strip()})") from None
    if not isinstance(frame.index, pd.RangeIndex):
        raise ValueError(overfull_row(text, path) or f"{path}: its rows have more fields than its header")
    return frame


def overfull_row(text: str, path: Path) -> str | None:
    """The first row of the CSV `text` with more fields than its header, told; None if none has."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, [])
        for row in reader:
            if len(row) > len(header):
                return f"{path}, line {reader.line_num}: {len(row)} fields, where the header has {len(header)}"
    except csv.Error:  # a field over the csv module's limit (131,072 characters): an RLE of 10,000 runs or more
        pass
    return None


def data_lines(text: str, rows: int) -> list[int]:
    """The line number of each of a CSV `text`'s `rows` data rows as pandas reads them: the blank
    lines pandas skips counted (else, where the two disagree, the rows' own count from line 2)."""
    numbers = [n for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    return numbers[1:] if len(numbers) == rows + 1 else list(range(2, rows + 2))


def sample_rows(data_dir: str | Path) -> list[str]:
    """The Image_Label of every row of `sample_submission.csv`, in its order (checked as
    `test_image_ids` checks it): a submission's rows, whatever order its labels come in."""
    import pandas as pd  # here, as in read_label_csv

    path = Path(data_dir) / SAMPLE_SUBMISSION_CSV
    test_image_ids(data_dir)
    keys = pd.read_csv(path, usecols=[ID_COLUMN], dtype=str, keep_default_na=False, encoding="utf-8-sig")[ID_COLUMN]
    return [image_label(*split_image_label(key)) for key in keys]


def decode_masks(table: pd.DataFrame, image_id: str, shape, source) -> list[np.ndarray]:
    """The four masks (LABELS order) of one image of a label table; errors name `source` and the row."""
    return _per_label(table, image_id, source, lambda encoded: rle.decode(encoded, shape))


def mask_runs(table: pd.DataFrame, image_id: str, shape, source) -> torch.Tensor:
    """The runs of one image's four masks (LABELS order) as one `rle.runs` sequence, what
    `rle.decode_runs` decodes (data.decode=gpu); errors name `source` and the row."""
    runs = _per_label(table, image_id, source, lambda encoded: torch.from_numpy(rle.runs(encoded, shape)))
    return rle.concat_runs(runs, shape[0] * shape[1])


def _per_label(table: pd.DataFrame, image_id: str, source, read) -> list:
    """`read` of each label's RLE string of one image; a ValueError names `source` and the row."""
    out = []
    for label in LABELS:
        try:
            out.append(read(table.at[image_id, label]))
        except ValueError as error:
            raise ValueError(f"{source} ({image_id}_{label}): {error}") from None
    return out


# ---------------------------------------------------------------------------------- images


def read_image(path: str | Path, expected_shape: tuple[int, int] | None = None) -> np.ndarray:
    """An RGB image as an H×W×3 uint8 array; errors name the file.

    Grayscale and CMYK JPEGs are refused rather than converted: the Kaggle images are all
    RGB, so one that is not was damaged or swapped, and OpenCV would convert it silently.
    """
    path = Path(path)
    data, _ = _checked_jpeg(path)
    # the pixels as stored, as the GPU's decode and the masks have them: OpenCV would turn an image
    # by its EXIF orientation, and rotate it away from its masks
    image = cv2.imdecode(data, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if image is None:
        raise ValueError(f"{path}: corrupt JPEG, OpenCV cannot decode it")
    _check_size(path, image.shape[:2], expected_shape)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def read_jpeg_bytes(path: str | Path, expected_shape: tuple[int, int] | None = None) -> np.ndarray:
    """A JPEG file's bytes (1-D uint8), checked as `read_image` checks them but not decoded:
    the size comes from the frame header (`data.decode=gpu` decodes later, on the GPU)."""
    path = Path(path)
    data, frame = _checked_jpeg(path)
    if frame is None:
        raise ValueError(f"{path}: corrupt JPEG, no readable frame header")
    _check_size(path, (frame.height, frame.width), expected_shape)
    return data


def _checked_jpeg(path: Path) -> tuple[np.ndarray, JpegFrame | None]:
    """The file's bytes and frame header, after the checks that need no decoding."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: image not found")
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as error:  # unreadable (permissions, an I/O error): a problem of this file, as a bad one is
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
    if data.size == 0:
        raise ValueError(f"{path}: empty file")
    if data[:2].tobytes() != b"\xff\xd8":
        raise ValueError(f"{path}: not a JPEG file")
    if b"\xff\xd9" not in data[-1024:].tobytes():
        raise ValueError(f"{path}: truncated JPEG (no end-of-image marker)")
    frame = jpeg_frame(data)
    if frame is not None and frame.components != 3:  # None: no frame header; the decoder says corrupt
        kind = {1: "grayscale", 4: "CMYK"}.get(frame.components, f"{frame.components}-channel")
        raise ValueError(f"{path}: {kind} JPEG; expected a 3-channel RGB image")
    return data, frame


def _check_size(path: Path, shape: tuple[int, int], expected_shape: tuple[int, int] | None) -> None:
    if expected_shape is not None and tuple(shape) != tuple(expected_shape):
        raise ValueError(f"{path}: image is {shape[0]}x{shape[1]}, expected {expected_shape[0]}x{expected_shape[1]}")


# Start-of-frame markers (baseline, progressive, lossless, ...); C4, C8 and CC are other segments.
_START_OF_FRAME = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class JpegFrame(NamedTuple):
    height: int
    width: int
    components: int  # 1 grayscale, 3 YCbCr/RGB, 4 CMYK


def jpeg_frame(data: bytes | np.ndarray) -> JpegFrame | None:
    """Size and colour components from a JPEG's frame header, without decoding the image;
    None when there is no readable frame header (OpenCV then reports the file as corrupt)."""
    data = memoryview(data)  # indexes as ints, slices without copying the file
    position = 2  # after the start-of-image marker
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in _START_OF_FRAME:
            header = data[position + 5 : position + 10]
            if len(header) < 5:
                return None
            return JpegFrame(int.from_bytes(header[0:2], "big"), int.from_bytes(header[2:4], "big"), header[4])
        position += 2 + int.from_bytes(data[position + 2 : position + 4], "big")
    return None


HEADER_BYTES = 1 << 16  # a JPEG's frame header sits in its first segments
SIZE_SAMPLE = 32  # the images whose headers give a dataset its size where none is set


def most_common_size(paths) -> tuple[int, int] | None:
    """The (H, W) most of the JPEG files `paths` give in their frame headers (the earliest on a
    tie), the unreadable ones left out; None when none is readable."""
    sizes = Counter()
    for path in paths:
        try:
            with open(path, "rb") as file:
                frame = jpeg_frame(file.read(HEADER_BYTES))
        except OSError:
            continue
        if frame is not None:
            sizes[frame.height, frame.width] += 1
    return sizes.most_common(1)[0][0] if sizes else None


def image_shape(path: str | Path) -> tuple[int, int]:
    """(H, W) of an image file."""
    return read_image(path).shape[:2]


def padded_shape(shape: tuple[int, int], multiple: int = PAD_MULTIPLE) -> tuple[int, int]:
    """Smallest (H, W) at least `shape` and divisible by `multiple`: 1400×2100 -> 1408×2112."""
    return tuple(-(-side // multiple) * multiple for side in shape)


def pad(batch: torch.Tensor, multiple: int = PAD_MULTIPLE) -> torch.Tensor:
    """Zero-pad the last two dims at the bottom and right up to a multiple (undo with `crop`)."""
    height, width = batch.shape[-2:]
    padded_height, padded_width = padded_shape((height, width), multiple)
    return F.pad(batch, (0, padded_width - width, 0, padded_height - height))


def crop(batch: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of `pad`: the top-left `shape` of the last two dims."""
    return batch[..., : shape[0], : shape[1]]


# ---------------------------------------------------------------------------------- dataset


class CloudDataset(Dataset):
    """Images (and, for the train split, their four masks) at the files' native size.

    An item is a dict: `image` (3×H×W uint8 tensor, RGB), `mask` (4×H×W uint8 tensor in
    `LABELS` order, train split only) and `image_id`. `image_size` is the (H, W) every image
    must have; None takes the size most of the first images have (`SIZE_SAMPLE`). `transform`
    is an albumentations transform applied to image and masks together.

    `on_bad_sample="raise"`: a bad CSV row or image raises an error naming the file or row.
    `"skip"`: bad CSV rows leave their images out (listed in `skipped`), and a bad image
    gives the item `{"image_id", "problem": Problem}`, which `collate` moves aside.

    `decode="gpu"` (see cloudseg.decode): `image` is the file's JPEG bytes (1-D uint8 tensor,
    header checked, not decoded), `runs` (train split) the four masks' runs (`mask_runs`)
    and `augment` (with a transform) the steps it draws (`decode.draw_steps`);
    `decode.decode_batch` decodes and augments a batch of them on the GPU. The transform's
    steps must be ones it can replay there (`decode.check_replayable`).
    """

    def __init__(self, data_dir, split="train", image_ids=None, transform=None, image_size=None,
                 on_bad_sample: str = "raise", *, decode: str = "cpu"):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if on_bad_sample not in ("raise", "skip"):
            raise ValueError(f"on_bad_sample must be 'raise' or 'skip', got {on_bad_sample!r}")
        if decode not in ("cpu", "gpu"):
            raise ValueError(f"decode must be 'cpu' or 'gpu' (decode.resolve_decode resolves auto), got {decode!r}")
        self.decode = decode
        self.data_dir = Path(data_dir)
        self.split = split
        self.on_bad_sample = on_bad_sample
        self.skipped: list[Problem] = []  # rows of the CSV left out (skip mode)
        sink = self.skipped if on_bad_sample == "skip" else None
        self.image_dir = self.data_dir / (TRAIN_IMAGES if split == "train" else TEST_IMAGES)
        self.labels = read_train_csv(self.data_dir, sink) if split == "train" else None
        all_ids = self.labels.index.tolist() if split == "train" else test_image_ids(self.data_dir, sink)
        left_out = {problem.image_id for problem in self.skipped}
        self.image_ids = [i for i in (all_ids if image_ids is None else image_ids) if i not in left_out]
        unknown = sorted(set(self.image_ids) - set(all_ids))
        if unknown:
            raise KeyError(f"{len(unknown)} image id(s) not in the {split} split of {self.data_dir}, e.g. {unknown[0]}")
        self.transform = transform
        self.image_size = tuple(image_size) if image_size is not None else self._common_image_size()

    @property
    def transform(self):
        return self._transform

    @transform.setter
    def transform(self, transform) -> None:
        if self.decode == "gpu":  # refused when set, not at the first item inside a worker
            check_replayable(transform)
        self._transform = transform

    def _common_image_size(self) -> tuple[int, int] | None:
        """(H, W) most of the first SIZE_SAMPLE images' headers give: were the first image's taken,
        one odd image first would have every good one refused as the wrong size. Where none has
        a readable header, the first image's (its error in raise mode)."""
        paths = [self.image_dir / image_id for image_id in self.image_ids[:SIZE_SAMPLE]]
        return most_common_size(paths) or self._first_image_size()

    def _first_image_size(self) -> tuple[int, int] | None:
        """(H, W) of the first image (in skip mode: the first readable one)."""
        for image_id in self.image_ids:
            try:
                return image_shape(self.image_dir / image_id)
            except (ValueError, FileNotFoundError):
                if self.on_bad_sample == "raise":
                    raise
        return None

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        """`dataset[i]`, or `dataset[i, seed]` to draw the augmentation from `seed` (see EpochSampler)."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        if seed is not None and self.transform is not None:
            # One generator shared by every transform: set_random_seed would give each child the
            # same seed, and flips drawn with p=0.5 would always come together.
            self.transform.set_random_state(np.random.default_rng(seed), random.Random(seed))
        image_id = self.image_ids[index]
        try:
            image, masks = self._read(image_id)
        except (ValueError, FileNotFoundError) as error:
            if self.on_bad_sample == "raise":
                raise
            return {"image_id": image_id, "problem": Problem(image_id, str(error))}
        if self.decode == "gpu":
            return self._encoded_item(image_id, image, masks)
        item = {"image_id": image_id}
        if masks is None:
            if self.transform is not None:
                image = self.transform(image=image)["image"]
        else:
            mask = cv2.merge(masks)
            if self.transform is not None:
                out = self.transform(image=image, mask=mask)
                image, mask = out["image"], out["mask"]
            item["mask"] = _chw_tensor(mask)
        item["image"] = _chw_tensor(image)
        return item

    def _encoded_item(self, image_id: str, data: np.ndarray, runs: torch.Tensor | None) -> dict:
        """gpu mode: the JPEG bytes, (train split) the masks' runs, and the augmentation steps drawn."""
        item = {"image_id": image_id, "image": torch.from_numpy(data)}
        if runs is not None:
            item["runs"] = runs
        if self.transform is not None:
            item["augment"] = draw_steps(self.transform, self.image_size)
        return item

    def _read(self, image_id: str) -> tuple[np.ndarray, list[np.ndarray] | torch.Tensor | None]:
        """The image and (train split) its four masks, or in gpu mode the JPEG bytes and the
        masks' runs; errors name the file or row."""
        gpu = self.decode == "gpu"
        image = (read_jpeg_bytes if gpu else read_image)(self.image_dir / image_id, self.image_size)
        if self.labels is None:
            return image, None
        masks = mask_runs if gpu else decode_masks
        return image, masks(self.labels, image_id, self.image_size, self.data_dir / TRAIN_CSV)


def readable(batches, skipped: list[Problem]):
    """The batches (of `collate`) with their unreadable samples moved into `skipped`; a batch
    left with no image is dropped."""
    for batch in batches:
        skipped.extend(batch.pop("skipped", []))
        if "image" in batch:
            yield batch


def collate(items: list[dict]) -> dict:
    """A batch of the readable items; unreadable ones (skip mode) as Problems under "skipped".

    A batch whose every item was unreadable has no "image" key. A gpu-mode item's JPEG bytes,
    mask runs and augmentation steps vary in size, so they stay lists: `decode.decode_batch`
    turns them into the tensors a cpu-mode batch has.
    """
    good = [item for item in items if "problem" not in item]
    if good and good[0]["image"].dim() == 1:
        batch = default_collate([{key: value for key, value in item.items() if key not in ENCODED_KEYS}
                                 for item in good])
        batch.update({key: [item[key] for item in good] for key in ENCODED_KEYS if key in good[0]})
    else:
        batch = default_collate(good) if good else {}
    batch["skipped"] = [item["problem"] for item in items if "problem" in item]
    return batch


def make_loader(dataset: Dataset, data_config, batch_size: int, device: torch.device, sampler=None,
                every_epoch: bool = False) -> DataLoader:
    """The DataLoader of every pass (training, validation, out-of-fold, test), from `data.*`:
    worker processes (kept alive between passes when the loader runs `every_epoch`),
    prefetching, pinned memory for a GPU, and `collate`'s skip handling."""
    workers = data_config.num_workers
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0 and every_epoch,
                      prefetch_factor=data_config.prefetch_factor if workers else None)


class EpochSampler(Sampler):
    """Shuffled `(index, augmentation seed)` pairs, a pure function of (seed, epoch).

    Data order and augmentation are then the same whatever the number of workers, and a
    run resumed at epoch k sees exactly what an uninterrupted run saw.

    On several processes (`world` > 1) each optimizer window of `window` consecutive pairs
    is cut into micro-batches of `chunk`, dealt to the ranks in turn: every rank sees the
    micro-batches a single process would have, so the summed gradient (and BatchNorm's
    per-micro-batch statistics) are the same.
    """

    def __init__(self, size: int, seed: int, window: int | None = None, chunk: int | None = None,
                 rank: int = 0, world: int = 1):
        self.size, self.seed, self.epoch, self.start = size, seed, 0, 0
        self.window, self.chunk, self.rank, self.world = window or size or 1, chunk or 1, rank, world

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Serve `epoch`'s order from position `start` (to resume an interrupted epoch)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return len(self._pairs())

    def __iter__(self):
        return iter(self._pairs())

    def _pairs(self) -> list[tuple[int, int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        order, seeds = rng.permutation(self.size), rng.integers(0, 2**31, self.size)
        pairs = list(zip(order.tolist(), seeds.tolist()))[self.start :]
        if self.world == 1:
            return pairs
        mine = []
        for begin in range(0, len(pairs), self.window):
            window = pairs[begin : begin + self.window]
            chunks = [window[i : i + self.chunk] for i in range(0, len(window), self.chunk)]
            for chunk in chunks[self.rank :: self.world]:
                mine += chunk
        return mine


def _chw_tensor(array: np.ndarray) -> torch.Tensor:
    """H×W×C -> C×H×W; OpenCV's channel split is about twice as fast as a strided NumPy copy."""
    return torch.from_numpy(np.stack(cv2.split(array)))


# ---------------------------------------------------------------------------------- transforms


def build_transform(
    hflip: float = 0.5,
    vflip: float = 0.5,
    shift_scale_rotate: float = 0.0,
    brightness_contrast: float = 0.0,
    nodata_band: float = 0.0,
    image_size: tuple[int, int] | None = None,
) -> A.Compose | None:
    """Training augmentation: each argument is the probability of that transform (0 = off).

    Geometry keeps the native size; masks move with the image, resampled nearest-neighbour.
    `nodata_band` blacks out a vertical band 5-15% of the width (needs `image_size`) and
    removes the labels under it, as in the real swath gaps.
    """
    import albumentations as A  # here, not at the top: only training augments, and the import takes a second

    steps = []
    if nodata_band:
        if image_size is None:
            raise ValueError("augment.nodata_band needs the image size")
        width = image_size[1]
        steps.append(A.XYMasking(num_masks_x=(1, 1), mask_x_length=(max(1, width // 20), max(1, width * 3 // 20)),
                                 fill=0, fill_mask=0, p=nodata_band))
    if hflip:
        steps.append(A.HorizontalFlip(p=hflip))
    if vflip:
        steps.append(A.VerticalFlip(p=vflip))
    if shift_scale_rotate:
        steps.append(
            A.Affine(translate_percent=(-0.0625, 0.0625), scale=(0.9, 1.1), rotate=(-15, 15),
                     border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=0, p=shift_scale_rotate)
        )
    if brightness_contrast:
        steps.append(A.RandomBrightnessContrast(brightness_limit=0.2, contrast_limit=0.2, p=brightness_contrast))
    return A.Compose(steps) if steps else None


# ---------------------------------------------------------------------------------- folds


POOR_BALANCE = 0.10
"""make_folds warns when some label's share of some fold is further than this (10 percentage
points) from its share of all images: that fold's validation scores will not be comparable."""


def make_folds(labels: pd.DataFrame, n_folds: int = 5, seed: int = 42) -> pd.Series:
    """Fold index per image, stratified on the set of labels each image has.

    With four labels there are at most 15 sets, so stratifying on the set itself keeps fold
    sizes equal (within one image) and every label's and every co-occurrence's frequency
    balanced (on a simulated Kaggle-sized label table, label shares differ by < 0.4% across folds).
    Small datasets, where no set is held by n_folds images, get their rarest sets merged into
    the most similar ones (`label_strata`) and a warning when the balance is poor.
    (MultilabelStratifiedKFold from iterative-stratification balances each label's count but
    not fold sizes: on the same table folds differed by up to 67 images and shares by up to 3.6%.)
    """
    import pandas as pd
    from sklearn.model_selection import StratifiedKFold  # here: scikit-learn takes seconds to import; only folds use it

    if len(labels) < n_folds:
        raise ValueError(f"cannot split {len(labels)} images into {n_folds} folds")
    present = (labels[list(LABELS)] != "").to_numpy()
    strata = label_strata(present, n_folds)
    splitter = StratifiedKFold(n_splits=n_folds, shuffle=True, random_state=seed)
    fold = np.empty(len(labels), dtype=int)
    with warnings.catch_warnings():  # strata rarer than n_folds are spread as well as they can be
        warnings.filterwarnings("ignore", "The least populated class", UserWarning)
        for k, (_, valid) in enumerate(splitter.split(strata, strata)):
            fold[valid] = k
    warn_if_unbalanced(present, fold)
    return pd.Series(fold, index=labels.index, name="fold")


def label_strata(present: np.ndarray, n_folds: int) -> np.ndarray:
    """Each image's label set as a bitmask (images × labels booleans in), the stratum it is
    folded by. StratifiedKFold needs one stratum of n_folds images: until there is one, the
    rarest set (the smaller bitmask on ties) joins the set differing from it in the fewest
    labels (ties: the larger, then the smaller bitmask). When some set already holds n_folds
    images nothing merges, so every table that split before splits as before."""
    strata = present @ (1 << np.arange(present.shape[1]))
    sets, counts = np.unique(strata, return_counts=True)
    while counts.max() < n_folds:
        rare = counts.argmin()
        bits = (sets[:, None] >> np.arange(present.shape[1])) & 1
        differing = np.abs(bits - bits[rare]).sum(1)
        differing[rare] = present.shape[1] + 1  # never itself
        nearest = np.lexsort((sets, -counts, differing))[0]
        strata[strata == sets[rare]] = sets[nearest]
        sets, counts = np.unique(strata, return_counts=True)
    return strata


def warn_if_unbalanced(present: np.ndarray, fold: np.ndarray) -> None:
    """A warning naming the worst label share when some fold's is POOR_BALANCE off the overall."""
    overall = present.mean(0)
    per_fold = np.stack([present[fold == k].mean(0) for k in np.unique(fold)])
    gap = np.abs(per_fold - overall)
    if gap.max() > POOR_BALANCE:
        k, j = np.unravel_index(gap.argmax(), gap.shape)
        warnings.warn(f"{len(fold)} images are too few for {per_fold.shape[0]} well-balanced folds: "
                      f"{LABELS[j]} is on {per_fold[k, j]:.0%} of fold {k}'s images and {overall[j]:.0%} of all, "
                      f"so validation scores will differ between folds", stacklevel=3)


def load_folds(data_dir: str | Path, n_folds: int = 5, seed: int = 42,
               problems: list[Problem] | None = None) -> pd.Series:
    """Folds saved in `data_dir/folds.csv`, made and saved on first use so every run shares them.

    With a `problems` list, images with bad train.csv rows are left out (see `read_label_csv`).
    """
    import pandas as pd

    path = Path(data_dir) / FOLDS_CSV
    labels = read_train_csv(data_dir, problems)
    if not path.is_file():
        folds = make_folds(labels, n_folds, seed)
        with atomic_path(path) as tmp:
            folds.rename_axis("image_id").to_csv(tmp)
        return folds
    folds = read_folds_csv(path)
    if not set(labels.index) <= set(folds.index) or set(folds) != set(range(n_folds)):
        raise ValueError(
            f"{path} does not match {TRAIN_CSV} with {n_folds} folds ({len(folds)} images in folds "
            f"{','.join(map(str, sorted(set(folds))))} vs {len(labels)} images); delete it to re-split"
        )
    return folds.reindex(labels.index)


def read_folds_csv(path: Path) -> pd.Series:
    """folds.csv as image id -> fold; a row without a whole fold number, or an image on two rows,
    is an error naming its line (a blank fold left its image in every fold's training, never
    validated). Which folds there must be is `load_folds`' to say."""
    text = csv_text(path, "header 'image_id,fold' and a row per training image")
    saved = csv_frame(text, path, dtype=str, keep_default_na=False)
    if list(saved.columns) != ["image_id", "fold"]:
        raise ValueError(f"{path}: expected columns image_id,fold, got {','.join(saved.columns)}")
    lines = data_lines(text, len(saved))
    for line, image_id, fold in zip(lines, saved["image_id"], saved["fold"]):
        if not (fold.strip().isascii() and fold.strip().isdigit()):
            raise ValueError(f"{path}, line {line} ({image_id}): fold {fold!r}, not a whole number from 0: "
                             "delete the file to re-split")
    if (twice := saved["image_id"].duplicated(keep=False)).any():
        image_id = saved["image_id"][twice].iloc[0]
        where = [line for line, same in zip(lines, saved["image_id"] == image_id) if same]
        raise ValueError(f"{path}: image {image_id} on lines {where}: delete the file to re-split")
    return saved.set_index("image_id")["fold"].astype(int)


def split_by_fold(folds: pd.Series, fold: int) -> tuple[list[str], list[str]]:
    """(train ids, validation ids): fold `fold` is held out, the others train."""
    if fold not in set(folds):
        raise ValueError(f"fold {fold} does not exist; folds are {sorted(set(folds))}")
    return folds.index[folds != fold].tolist(), folds.index[folds == fold].tolist()


def fold_ids(data_config, seed: int) -> tuple[list[str], list[str]]:
    """(train ids, validation ids) for a config's `data` section (folds made with `seed`);
    in skip mode, images with bad train.csv rows are left out (the datasets list them)."""
    skip = data_config.on_bad_sample == "skip"
    folds = load_folds(data_config.dir, data_config.n_folds, seed, problems=[] if skip else None)
    return split_by_fold(folds, data_config.fold)
