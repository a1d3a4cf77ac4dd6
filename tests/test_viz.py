import shutil

import cv2
import numpy as np
import pandas as pd
import pytest

from cloudseg import rle
from cloudseg.cli import main
from cloudseg.data import read_train_csv
from cloudseg.task import LABELS
from cloudseg.viz import COLORS, LEGEND_HEIGHT


def read_rgb(path):
    return cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)


def test_show_draws_truth_and_prediction_in_class_colours(tiny_data, tmp_path):
    # a submission that predicts one Gravel box for the first test image
    sample = pd.read_csv(tiny_data / "sample_submission.csv")
    test_id = sample["Image_Label"].iloc[0].rsplit("_", 1)[0]
    box = np.zeros((350, 525), np.uint8)
    box[100:200, 150:350] = 1
    rows = [(key, rle.encode(box) if key == f"{test_id}_Gravel" else "") for key in sample["Image_Label"]]
    pd.DataFrame(rows, columns=["Image_Label", "EncodedPixels"]).to_csv(tmp_path / "sub.csv", index=False)
    train_id = read_train_csv(tiny_data).index[0]
    assert main(["show", train_id, test_id, "--data-dir", str(tiny_data), "--submission", str(tmp_path / "sub.csv"),
                 "--out", str(tmp_path / "pics")]) == 0

    picture = read_rgb(tmp_path / "pics" / f"{test_id[:-4]}.png")
    assert picture.shape == (350 + LEGEND_HEIGHT, 2 * 525, 3)  # truth | prediction, over a legend
    prediction = picture[:350, 525:].astype(int)
    gravel = np.array(COLORS["Gravel"])
    outline = np.abs(prediction - gravel).sum(-1) < 60
    assert outline[100:200, 150:350].sum() > 300  # the box is drawn in Gravel's colour...
    assert outline.sum() - outline[98:202, 148:352].sum() < 20  # ...and nowhere else
    inside = prediction[120:180, 170:330].mean((0, 1))
    assert inside[0] > prediction[10:60, 10:100].mean((0, 1))[0] + 20  # the fill is tinted

    train_picture = read_rgb(tmp_path / "pics" / f"{train_id[:-4]}.png")
    assert train_picture.shape == (350 + LEGEND_HEIGHT, 525, 3)  # a train image has only its truth
    truth = read_train_csv(tiny_data).loc[train_id]
    present = [label for label in LABELS if truth[label]]
    for label in present:  # every class of the truth shows its colour
        assert (np.abs(train_picture[:350].astype(int) - np.array(COLORS[label])).sum(-1) < 60).sum() > 20, label


def test_show_names_a_test_image_missing_from_the_submission(tiny_data, tmp_path, capsys):
    sample = pd.read_csv(tiny_data / "sample_submission.csv")
    sample.iloc[4:].to_csv(tmp_path / "partial.csv", index=False)
    test_id = sample["Image_Label"].iloc[0].rsplit("_", 1)[0]
    assert main(["show", test_id, "--data-dir", str(tiny_data), "--submission", str(tmp_path / "partial.csv"),
                 "--out", str(tmp_path)]) == 2
    assert test_id in capsys.readouterr().err


def test_show_takes_an_image_id_with_or_without_jpg(tiny_data, tmp_path):
    """Catches `show 03580aa` failing (test_images/03580aa: image not found), `.jpg` added to ids
    that have it, and a train image typed without `.jpg` losing its truth (drawn as a test image)."""
    train_id = read_train_csv(tiny_data).index[0]
    test_id = pd.read_csv(tiny_data / "sample_submission.csv")["Image_Label"].iloc[0].rsplit("_", 1)[0]
    for typed, out in (([train_id, test_id], "full"), ([train_id[:-4], test_id[:-4]], "bare")):
        assert main(["show", *typed, "--data-dir", str(tiny_data), "--out", str(tmp_path / out)]) == 0
    for image_id in (train_id, test_id):
        png = f"{image_id[:-4]}.png"
        assert np.array_equal(read_rgb(tmp_path / "bare" / png), read_rgb(tmp_path / "full" / png)), image_id


def test_training_writes_curves_and_tensorboard_events(tiny_data, tmp_path):
    from cloudseg.config import load_config
    from cloudseg.train import train
    from tests.conftest import TINY

    data = shutil.copytree(tiny_data, tmp_path / "data")
    train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY]), tmp_path / "run")
    curves = cv2.imread(str(tmp_path / "run" / "curves.png"))
    assert curves is not None and curves.shape[0] > 100 and curves.shape[1] > 400
    events = list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path / "run" / "tb")).Reload().Tags()["scalars"]
    assert {"train_loss", "valid_loss", "dice", "dice_Fish", "lr"} <= set(scalars)


def test_the_masks_segment_wrote_as_class_bits_read_back_with_no_data_as_no_class(tmp_path):
    """NAME_masks.png of class bits with NODATA (255) pixels: read back per class by hand, no-data
    in none; a missing PNG is one line naming it. Would catch 255 read as bits (every class drawn
    over the no-data) and a None image shifted (a TypeError naming nothing)."""
    from cloudseg.viz import written_masks

    out = tmp_path / "maps"
    out.mkdir()
    cv2.imwrite(str(out / "scene_masks.png"), np.array([[1, 255, 8], [0, 3, 255]], np.uint8))
    masks = written_masks(tmp_path / "scene.jpg", out)
    expected = np.zeros((4, 2, 3), np.uint8)
    expected[0, 0, 0] = expected[3, 0, 2] = expected[0, 1, 1] = expected[1, 1, 1] = 1
    np.testing.assert_array_equal(masks, expected)
    with pytest.raises(FileNotFoundError, match="other_masks.png: no masks of cloudseg segment"):
        written_masks(tmp_path / "other.png", out)


def test_the_rule_shown_is_the_one_predict_applies_to_the_run(tmp_path):
    """CPU. Would catch: a postprocess.json beside any run taken as its rule (`cloudseg tune RUN`
    wrote one beside the run before it wrote into it: runs/postprocess.json, stale, shown for every
    run in runs/ while predict applies each run's own), or a fold of make cv not shown its pooled one."""
    import json

    from cloudseg.viz import tuned_rule

    def rule(path, threshold):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"threshold": [threshold] * 4, "min_area": [0] * 4, "gate": [0.0] * 4}))

    rule(tmp_path / "runs" / "postprocess.json", 0.1)  # stale, beside two runs
    (tmp_path / "runs" / "a").mkdir()
    assert tuned_rule(tmp_path / "runs" / "a") is None
    rule(tmp_path / "runs" / "a" / "postprocess.json", 0.2)
    assert tuned_rule(tmp_path / "runs" / "a")["threshold"] == [0.2] * 4
    rule(tmp_path / "cv" / "postprocess.json", 0.3)  # make cv's pooled rule, its fold without one of its own
    (tmp_path / "cv" / "fold0").mkdir()
    assert tuned_rule(tmp_path / "cv" / "fold0")["threshold"] == [0.3] * 4
