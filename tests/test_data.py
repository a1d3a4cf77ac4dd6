import shutil
import warnings

import cv2
import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg import rle
from cloudseg.data import (
    CloudDataset,
    build_transform,
    crop,
    load_folds,
    label_strata,
    make_folds,
    pad,
    padded_shape,
    read_label_csv,
    read_train_csv,
    split_by_fold,
    warn_if_unbalanced,
)
from cloudseg.synth import synthesize
from cloudseg.task import LABELS

HEADER = "Image_Label,EncodedPixels\n"


def write_csv(path, text):
    path.write_text(text)
    return path


def four_rows(image_id, rles=("1 2", "", "", "3 1")):
    return "".join(f"{image_id}_{label},{code}\n" for label, code in zip(LABELS, rles))


# ---------------------------------------------------------------- train.csv


def test_read_label_csv_gives_one_row_per_image_in_label_order(tmp_path):
    text = HEADER + four_rows("b.jpg") + four_rows("a.jpg", ("", "5 5", "", ""))
    table = read_label_csv(write_csv(tmp_path / "t.csv", text))
    assert table.index.tolist() == ["b.jpg", "a.jpg"]
    assert table.columns.tolist() == list(LABELS)
    assert table.loc["b.jpg"].tolist() == ["1 2", "", "", "3 1"]
    assert table.loc["a.jpg", "Flower"] == "5 5"


def test_rows_in_any_order_are_regrouped(tmp_path):
    lines = four_rows("a.jpg").splitlines(keepends=True)
    table = read_label_csv(write_csv(tmp_path / "t.csv", HEADER + "".join(reversed(lines))))
    assert table.loc["a.jpg"].tolist() == ["1 2", "", "", "3 1"]


def test_byte_order_mark_and_windows_line_endings_just_work(tmp_path):
    text = (HEADER + four_rows("a.jpg")).replace("\n", "\r\n")
    path = tmp_path / "t.csv"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_label_csv(path).loc["a.jpg"].tolist() == ["1 2", "", "", "3 1"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("Image,Pixels\n" + four_rows("a.jpg"), r"t\.csv: missing column"),
        (HEADER + four_rows("a.jpg").replace("_Sugar", "_Cumulus"), r"t\.csv, line 5 \(a\.jpg_Cumulus\): .*unknown label 'Cumulus'"),
        (HEADER + "nolabel,1 2\n", r"line 2 \(nolabel\).*not of the form"),
        (HEADER + four_rows("a.jpg") + "a.jpg_Fish,\n", r"duplicate Image_Label a\.jpg_Fish on lines \[2, 6\]"),
        (HEADER + four_rows("a.jpg", ("1 2", "3", "", "")), r"line 3 \(a\.jpg_Flower\): RLE has an odd number"),
        # blank lines, which pandas skips, still count: the file's line 6, not its 4th data row's "line 5"
        (HEADER + "\n" + four_rows("a.jpg", ("1 2", "", "x 1", "")).replace("a.jpg_Flower,\n", "a.jpg_Flower,\n\n"),
         r"line 6 \(a\.jpg_Gravel\): RLE has a non-integer"),
        (HEADER + four_rows("a.jpg")[: -len("a.jpg_Sugar,3 1\n")], r"image a\.jpg has no row for label\(s\) \['Sugar'\]"),
    ],
)
def test_csv_errors_name_the_file_and_row(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        read_label_csv(write_csv(tmp_path / "t.csv", text))


def test_missing_csv_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.csv"):
        read_label_csv(tmp_path / "nothere.csv")


# ---------------------------------------------------------------- dataset


@pytest.fixture(scope="module")
def fullres_data(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("full"), n_train=2, n_test=1, seed=5)


def test_dataset_returns_native_full_resolution_with_masks_equal_to_decode(fullres_data):
    dataset = CloudDataset(fullres_data)
    table = read_train_csv(fullres_data)
    assert dataset.image_size == (1400, 2100)
    for index in range(len(dataset)):
        item = dataset[index]
        assert item["image"].shape == (3, 1400, 2100) and item["image"].dtype == torch.uint8
        assert item["mask"].shape == (4, 1400, 2100) and item["mask"].dtype == torch.uint8
        for channel, label in enumerate(LABELS):
            expected = rle.decode(table.at[item["image_id"], label], (1400, 2100))
            assert torch.equal(item["mask"][channel], torch.from_numpy(expected))
        # the image is RGB as on disk: compare with an independent read
        bgr = cv2.imread(str(fullres_data / "train_images" / item["image_id"]))
        assert torch.equal(item["image"], torch.from_numpy(bgr[..., ::-1].transpose(2, 0, 1).copy()))


def test_test_split_has_no_mask_and_follows_sample_submission(tiny_data):
    dataset = CloudDataset(tiny_data, split="test")
    expected_ids = pd.read_csv(tiny_data / "sample_submission.csv")["Image_Label"].str.rsplit("_", n=1).str[0].unique()
    assert dataset.image_ids == list(expected_ids)
    item = dataset[0]
    assert "mask" not in item and item["image"].shape == (3, 64, 96)


def test_image_ids_select_a_subset_and_unknown_ids_fail(tiny_data):
    ids = read_train_csv(tiny_data).index[:3].tolist()
    assert CloudDataset(tiny_data, image_ids=ids).image_ids == ids
    with pytest.raises(KeyError, match="nope.jpg"):
        CloudDataset(tiny_data, image_ids=["nope.jpg"])


def test_transform_moves_image_and_masks_together(tiny_data):
    plain = CloudDataset(tiny_data)[0]
    flipped = CloudDataset(tiny_data, transform=build_transform(hflip=1.0, vflip=0.0))[0]
    assert torch.equal(flipped["image"], plain["image"].flip(-1))
    assert torch.equal(flipped["mask"], plain["mask"].flip(-1))


def test_affine_augmentation_keeps_native_size_and_binary_masks(tiny_data):
    item = CloudDataset(tiny_data, transform=build_transform(0, 0, shift_scale_rotate=1.0, brightness_contrast=1.0))[0]
    assert item["image"].shape == (3, 64, 96) and item["mask"].shape == (4, 64, 96)
    assert set(item["mask"].unique().tolist()) <= {0, 1}


def test_no_transform_when_all_probabilities_are_zero():
    assert build_transform(0, 0, 0, 0) is None


@pytest.fixture
def data_copy(tiny_data, tmp_path):
    return shutil.copytree(tiny_data, tmp_path / "copy")


def corrupt(data_dir, how):
    dataset = CloudDataset(data_dir)
    path = data_dir / "train_images" / dataset.image_ids[1]
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-300])
    elif how == "garbage":
        path.write_bytes(b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9")
    elif how == "not a jpeg":
        path.write_bytes(b"PNG-ish bytes")
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "wrong size":
        cv2.imwrite(str(path), np.zeros((32, 96, 3), np.uint8))
    return dataset, path


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", "image not found"),
        ("truncated", "truncated JPEG"),
        ("garbage", "corrupt JPEG"),
        ("not a jpeg", "not a JPEG"),
        ("empty", "empty file"),
        ("wrong size", "is 32x96, expected 64x96"),
    ],
)
def test_bad_images_raise_errors_naming_the_file(data_copy, how, message):
    dataset, path = corrupt(data_copy, how)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        dataset[1]
    assert str(path) in str(error.value)


def test_rle_past_the_image_names_its_image_label(data_copy):
    csv = data_copy / "train.csv"
    frame = pd.read_csv(csv, keep_default_na=False)
    frame.loc[1, "EncodedPixels"] = "6000 200"  # 64*96 = 6144 pixels
    frame.to_csv(csv, index=False)
    dataset = CloudDataset(data_copy)
    key = frame.loc[1, "Image_Label"]
    with pytest.raises(ValueError, match=f"{key}.*past the last pixel"):
        dataset[0]


@pytest.mark.parametrize("orientation", [3, 6])
def test_an_exif_orientation_is_not_applied_as_the_gpu_decode_and_the_masks_do_not(tmp_path, orientation):
    """A 64x96 JPEG with a white top-left corner, tagged EXIF orientation 3 (turned 180°) or 6
    (90°). Would catch: OpenCV's default, which turns the pixels by the tag: the image rotated away
    from its masks (3), or refused as 96x64 while read_jpeg_bytes, for the GPU, takes it (6)."""
    from PIL import Image

    from cloudseg.data import read_image, read_jpeg_bytes

    pixels = np.full((64, 96, 3), 40, np.uint8)
    pixels[:16, :16] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(tmp_path / "a.jpg", quality=95, exif=exif)
    image = read_image(tmp_path / "a.jpg", (64, 96))
    assert image[:16, :16].min() > 200 and image[-16:, -16:].max() < 80
    assert len(read_jpeg_bytes(tmp_path / "a.jpg", (64, 96)))


def test_without_a_size_the_one_most_images_have_is_taken_and_an_odd_first_image_is_the_one_refused(data_copy):
    """CPU; the tiny data's first training image rewritten at 32x96. Would catch: the first
    image's size taken (every good image then refused as 'is 64x96, expected 32x96', the error
    blaming the images that are right)."""
    dataset = CloudDataset(data_copy)
    odd = data_copy / "train_images" / dataset.image_ids[0]
    cv2.imwrite(str(odd), np.zeros((32, 96, 3), np.uint8))
    dataset = CloudDataset(data_copy)
    assert dataset.image_size == (64, 96)
    assert dataset[1]["image"].shape == (3, 64, 96)
    with pytest.raises(ValueError, match=f"{odd}: image is 32x96, expected 64x96"):
        dataset[0]


def test_explicit_image_size_rejects_other_sizes(tiny_data):
    with pytest.raises(ValueError, match="is 64x96, expected 1400x2100"):
        CloudDataset(tiny_data, image_size=(1400, 2100))[0]


# ---------------------------------------------------------------- padding


def test_padded_shape_of_the_kaggle_image():
    assert padded_shape((1400, 2100)) == (1408, 2112)
    assert padded_shape((64, 96)) == (64, 96)


def test_pad_then_crop_is_exact():
    batch = torch.randn(2, 3, 1400, 2100)
    padded = pad(batch)
    assert padded.shape == (2, 3, 1408, 2112)
    assert padded[..., 1400:, :].abs().sum() == 0 and padded[..., :, 2100:].abs().sum() == 0
    assert torch.equal(crop(padded, (1400, 2100)), batch)


# ---------------------------------------------------------------- folds


def random_label_table(n, seed=0):
    rng = np.random.default_rng(seed)
    present = rng.random((n, 4)) < [0.5, 0.45, 0.45, 0.6]
    present[~present.any(1), 0] = True
    return pd.DataFrame(np.where(present, "1 1", ""), columns=list(LABELS), index=[f"{i}.jpg" for i in range(n)])


def test_every_image_in_exactly_one_fold_with_balanced_labels():
    labels = random_label_table(1000)
    folds = make_folds(labels, n_folds=5, seed=1)
    assert folds.index.equals(labels.index) and set(folds) == set(range(5))
    assert folds.value_counts().max() - folds.value_counts().min() <= 1
    counts = labels.ne("").groupby(folds).sum()
    assert (counts.max() - counts.min()).max() <= 3, counts  # a random split spreads by ~20


def kaggle_sized_label_table(seed=0):
    """5,546 images like Kaggle's train.csv: each label on 40-55% of images, every image has one."""
    rng = np.random.default_rng(seed)
    present = rng.random((5546, 4)) < [0.50, 0.43, 0.53, 0.55]
    unlabelled = ~present.any(1)
    present[unlabelled, rng.integers(0, 4, unlabelled.sum())] = True
    return pd.DataFrame(np.where(present, "1 1", ""), columns=list(LABELS), index=[f"{i}.jpg" for i in range(5546)])


@pytest.mark.parametrize("seed", [0, 1])
def test_kaggle_sized_folds_keep_every_label_share_within_half_a_percent(seed):
    """Catches a split that balances label counts but not fold sizes (iterative-stratification's
    MultilabelStratifiedKFold: folds ~70 images apart, shares ~3% apart), a random split (~4%),
    and a warning on folds that are fine."""
    labels = kaggle_sized_label_table(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folds = make_folds(labels, n_folds=5, seed=42)
    assert folds.value_counts().max() - folds.value_counts().min() <= 1
    shares = labels.ne("").groupby(folds).mean()
    assert (shares.max() - shares.min()).max() < 0.005, shares


@pytest.mark.parametrize("n_images", [5, 12, 24])
def test_small_datasets_are_split_with_a_warning_not_refused(n_images):
    """Catches the old refusal (no label set shared by 5 of 12 images) and unequal fold sizes."""
    labels = random_label_table(n_images, seed=3)
    with pytest.warns(UserWarning, match=f"{n_images} images are too few for 5 well-balanced folds"):
        folds = make_folds(labels, n_folds=5)
    assert folds.index.equals(labels.index) and set(folds) == set(range(5))
    assert folds.value_counts().max() - folds.value_counts().min() <= 1


def test_fewer_images_than_folds_is_a_clear_error():
    """Catches silently making empty folds."""
    with pytest.raises(ValueError, match="cannot split 4 images into 5 folds"):
        make_folds(random_label_table(4), n_folds=5)


def label_rows(*sets):
    """Images × labels booleans from label sets such as {"Fish", "Flower"}."""
    return np.array([[label in labels for label in LABELS] for labels in sets])


def test_rare_label_sets_join_the_most_similar_until_one_fills_every_fold():
    """Bitmasks Fish=1 Flower=2 Gravel=4 Sugar=8, worked by hand. Catches merging by size alone
    (Fish,Flower would join the 3 Sugar images: 1,1,8,7,8,8,8), the wrong tie-break (joining
    the equally near but smaller Fish,Flower,Gravel: 8,8,7,7,8,8,8), and merging when a set
    already fills every fold (which would change folds that split fine before)."""
    fish, sugar = {"Fish"}, {"Sugar"}
    present = label_rows(fish, fish, {"Fish", "Flower"}, {"Fish", "Flower", "Gravel"}, sugar, sugar, sugar)
    # 4 folds: sets 3 and 7 are the rarest (1 image); 3 (the smaller) joins 1 (1 label apart like 7,
    # but 2 images beat 7's 1); then 7 joins 1 (2 labels apart, 8 is 4 apart): Fish holds 4 images.
    assert label_strata(present, n_folds=4).tolist() == [1, 1, 1, 1, 8, 8, 8]
    assert label_strata(present, n_folds=3).tolist() == [1, 1, 3, 7, 8, 8, 8]  # Sugar already fills 3 folds


def test_poor_balance_warning_names_the_worst_label():
    """Catches warning on balanced folds, staying silent on unbalanced ones, and naming the wrong label or fold."""
    fish, sugar = {"Fish"}, {"Sugar"}
    folds = np.array([0, 0, 1, 1, 2, 2])
    # Fish is on 50% of every fold; Sugar on 50%, 50%, 100% against 4/6 overall: fold 2 is 33 points off.
    sugar_heavy_fold_2 = label_rows(fish, sugar, fish, sugar, {"Fish", "Sugar"}, sugar)
    with pytest.warns(UserWarning, match="Sugar is on 100% of fold 2's images and 67% of all"):
        warn_if_unbalanced(sugar_heavy_fold_2, folds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unbalanced(label_rows(fish, sugar, fish, sugar, fish, sugar), folds)  # 50% everywhere


def test_folds_are_deterministic_for_a_seed():
    labels = random_label_table(200)
    assert make_folds(labels, 5, seed=7).equals(make_folds(labels, 5, seed=7))
    assert not make_folds(labels, 5, seed=7).equals(make_folds(labels, 5, seed=8))


def test_folds_are_saved_once_and_reused(data_copy):
    first = load_folds(data_copy, n_folds=3, seed=1)
    assert (data_copy / "folds.csv").is_file()
    assert load_folds(data_copy, n_folds=3, seed=999).equals(first)  # the saved split wins
    for other in (4, 2):  # more folds, and fewer (a row of fold 2 is no damaged row: the file was made for 3)
        with pytest.raises(ValueError, match=f"folds.csv does not match train.csv with {other} folds"):
            load_folds(data_copy, n_folds=other)


@pytest.mark.parametrize("spoil, message", [
    (lambda rows: [rows[0], rows[1].split(",")[0] + ",", *rows[2:]], r"line 2 \(\w+\.jpg\): fold '', not a whole"),
    (lambda rows: [rows[0], rows[1].split(",")[0] + ",1.5", *rows[2:]], r"line 2 \(\w+\.jpg\): fold '1.5', not a"),
    (lambda rows: [rows[0], *[row.replace(",0", ",7") for row in rows[1:]]],  # the three folds 1, 2, 7
     r"does not match train.csv with 3 folds \(\d+ images in folds 1,2,7 vs"),
    (lambda rows: [*rows, rows[1]], r"image \w+\.jpg on lines \[2, \d+\]"),
    (lambda rows: [rows[0], rows[1] + ",0", *rows[2:]], r"folds\.csv, line 2: 3 fields, where the header has 2"),
    (lambda rows: [], r"folds\.csv: empty file"),
])
def test_a_spoilt_folds_csv_is_one_error_naming_its_line(data_copy, spoil, message):
    """CPU. Would catch: a blank fold read as NaN, its image then in every fold's training and
    never validated; three folds of which one no split asks for (1, 2, 7: 'fold 0 does not
    exist' only once a run asked); an image on two rows (pandas' "cannot reindex on an axis with
    duplicate labels"); pandas' own errors, which name no file."""
    load_folds(data_copy, n_folds=3, seed=1)
    path = data_copy / "folds.csv"
    path.write_text("\n".join(spoil(path.read_text().splitlines())) + "\n")
    with pytest.raises(ValueError, match=message):
        load_folds(data_copy, n_folds=3)


def test_check_reports_a_damaged_folds_csv(data_copy, capsys):
    """CPU. Would catch `cloudseg check` saying "no problems found" of a folds.csv that training
    then refuses (data-errors.md says check reports every error of its table)."""
    from cloudseg.cli import main

    load_folds(data_copy, n_folds=3, seed=1)
    rows = (data_copy / "folds.csv").read_text().splitlines()
    rows[2] = rows[2].split(",")[0] + ",x"
    (data_copy / "folds.csv").write_text("\n".join(rows) + "\n")
    assert main(["check", "--data-dir", str(data_copy), "--workers", "1"]) == 1
    assert f"{data_copy / 'folds.csv'}, line 3 (" in capsys.readouterr().out


def test_split_by_fold_holds_out_one_fold(tiny_data):
    folds = make_folds(read_train_csv(tiny_data), 3, seed=0)
    train_ids, valid_ids = split_by_fold(folds, 1)
    assert set(valid_ids) == set(folds.index[folds == 1])
    assert set(train_ids) | set(valid_ids) == set(folds.index) and not set(train_ids) & set(valid_ids)
    with pytest.raises(ValueError, match="fold 7 does not exist"):
        split_by_fold(folds, 7)


def test_the_seeded_flips_are_drawn_independently(tiny_data):
    """Would catch: seeding every transform of the Compose with the same seed, which makes the
    horizontal and vertical flips (both p=0.5) always fire together: two of the four flip
    combinations would never be seen in training."""
    plain = CloudDataset(tiny_data, "train")[0]["image"]
    combinations = {(h, v): plain.flip([d for d, on in ((-1, h), (-2, v)) if on]) if h or v else plain
                    for h in (False, True) for v in (False, True)}
    dataset = CloudDataset(tiny_data, "train", transform=build_transform(hflip=0.5, vflip=0.5))
    seen = set()
    for seed in range(64):
        image = dataset[0, seed]["image"]
        seen |= {flips for flips, expected in combinations.items() if torch.equal(image, expected)}
    assert seen == set(combinations)
