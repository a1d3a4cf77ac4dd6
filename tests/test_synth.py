import numpy as np
import pandas as pd
import pytest

from cloudseg import rle
from cloudseg.cli import main
from cloudseg.data import CloudDataset, read_label_csv, read_train_csv
from cloudseg.synth import sample, synthesize


def test_kaggle_layout_and_row_counts(tiny_data):
    assert {p.name for p in tiny_data.iterdir()} >= {"train.csv", "sample_submission.csv", "test_solution.csv", "train_images", "test_images"}
    train = pd.read_csv(tiny_data / "train.csv")
    assert list(train.columns) == ["Image_Label", "EncodedPixels"] and len(train) == 24 * 4
    assert len(list((tiny_data / "train_images").glob("*.jpg"))) == 24
    sample_submission = read_label_csv(tiny_data / "sample_submission.csv")
    assert len(sample_submission) == 6 and (sample_submission == "1 1").all(axis=None)
    solution = read_label_csv(tiny_data / "test_solution.csv")
    assert solution.index.equals(sample_submission.index)
    for code in solution.to_numpy().ravel():
        rle.decode(code, (350, 525))  # test truth is encoded at submission size


def test_every_image_has_a_label_and_no_label_inside_black_bands():
    rng = np.random.default_rng(0)
    banded = 0
    for _ in range(30):
        image, masks = sample(rng, 64, 96)
        assert masks.shape == (4, 64, 96) and masks.any()
        black = (image == 0).all(axis=-1)
        banded += black.sum() > 200
        assert not masks[:, black].any()
    assert 3 <= banded <= 20  # about 30% of images carry a band


def test_same_seed_same_data(tmp_path):
    synthesize(tmp_path / "a", 3, 1, 32, 48, seed=9)
    synthesize(tmp_path / "b", 3, 1, 32, 48, seed=9)
    assert (tmp_path / "a/train.csv").read_text() == (tmp_path / "b/train.csv").read_text()


def test_classes_differ_in_appearance(tiny_data):
    """Each class's pixels have their own statistics, so the data is learnable."""
    dataset = CloudDataset(tiny_data)
    brightness = {c: [] for c in range(4)}
    for item in dataset:
        grey = item["image"].float().mean(0)
        for c in range(4):
            only_c = (item["mask"][c] == 1) & (item["mask"].sum(0) == 1)
            if only_c.sum() > 50:
                brightness[c].append(grey[only_c].mean().item())
    means = [np.mean(v) for v in brightness.values()]
    assert all(len(v) for v in brightness.values())
    assert min(abs(a - b) for i, a in enumerate(means) for b in means[i + 1 :]) > 3, means


def test_cli_writes_a_dataset(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "s"), "--n-train", "5", "--n-test", "2", "--height", "32", "--width", "64"]) == 0
    assert len(read_train_csv(tmp_path / "s")) == 5
    assert CloudDataset(tmp_path / "s")[0]["image"].shape == (3, 32, 64)


def test_cli_folds_reports_balance(tiny_data, tmp_path, capsys):
    import shutil

    data = shutil.copytree(tiny_data, tmp_path / "d")
    assert main(["folds", "--data-dir", str(data), "--n-folds", "3"]) == 0
    assert (data / "folds.csv").is_file() and "Gravel" in capsys.readouterr().out


@pytest.mark.parametrize("command, message", [
    (["synth", "--n-train", "-3"], "argument --n-train: must be at least 1, got -3"),
    (["synth", "--n-test", "0"], "argument --n-test: must be at least 1, got 0"),
    (["synth", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["folds", "--n-folds", "1"], "argument --n-folds: must be at least 2, got 1"),
    (["folds", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
])
def test_counts_and_seeds_out_of_range_are_refused_naming_the_option(tmp_path, capsys, command, message):
    """Would catch: synth writing -3 images ('wrote -3 train and 2 test images', exit 0) or a
    dataset of a header alone, NumPy's 'expected non-negative integer', or scikit-learn's
    'n_splits=2 or more' naming no option."""
    where = ["--out", str(tmp_path / "s")] if command[0] == "synth" else ["--data-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main([*command[:1], *where, *command[1:]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_synth_never_writes_over_a_dataset_and_an_unwritten_image_leaves_it_unfinished(tmp_path, capsys):
    """`cloudseg synth --out` a folder with a train.csv: refused in one line, nothing changed. A
    library call over an old dataset whose first image cannot be written (a folder in its way):
    an OSError naming the image, and no train.csv left (the old one is gone before any image, so
    the folder no longer looks finished). Sides under 16 pixels refused (they looped forever).
    Would catch: synth overwriting another dataset's images under its old labels, or
    cv2.imwrite's failure ignored (exit 0 and a train.csv naming an image that is not there)."""
    data = synthesize(tmp_path / "d", 3, 1, 32, 48, seed=1)
    before = {path: path.read_bytes() for path in data.rglob("*") if path.is_file()}
    assert main(["synth", "--out", str(data), "--n-train", "3", "--n-test", "1", "--height", "32", "--width", "48",
                 "--seed", "2"]) == 2  # a user error
    assert "train.csv: --out already holds a dataset" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in data.rglob("*") if path.is_file()} == before
    first = data / "train_images" / "0000000.jpg"
    first.unlink()
    first.mkdir()
    with pytest.raises(OSError, match="0000000.jpg: OpenCV could not write the image"):
        synthesize(data, 3, 1, 32, 48, seed=2)
    assert not (data / "train.csv").exists()
    with pytest.raises(ValueError, match="at least 16 pixels a side, got 4x48"):
        synthesize(tmp_path / "small", 3, 1, 4, 48)
