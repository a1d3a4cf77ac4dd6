"""Facts of the Kaggle task "Understanding Clouds from Satellite Images", defined once: the
labels, shapes and column names that every step of the data path shares.
"""

COMPETITION = "understanding_cloud_organization"
"""The competition's name on Kaggle (its data, its rules, its submissions)."""

LABELS = ("Fish", "Flower", "Gravel", "Sugar")
"""The four cloud patterns, in the order of train.csv and of every 4-channel mask."""

IMAGE_SHAPE = (1400, 2100)
"""Native (H, W) of the Kaggle images."""

SUBMISSION_SHAPE = (350, 525)
"""(H, W) at which submissions are encoded and scored: a quarter of the native size per side."""

PAD_MULTIPLE = 32
"""smp encoders downsample 5 times, so H and W must be divisible by 2**5."""

ID_COLUMN = "Image_Label"
RLE_COLUMN = "EncodedPixels"

TRAIN_CSV = "train.csv"
SAMPLE_SUBMISSION_CSV = "sample_submission.csv"
FOLDS_CSV = "folds.csv"
TRAIN_IMAGES = "train_images"
TEST_IMAGES = "test_images"


def image_label(image_id: str, label: str) -> str:
    """`0011165.jpg`, `Fish` -> `0011165.jpg_Fish`."""
    return f"{image_id}_{label}"


def split_image_label(value: str) -> tuple[str, str]:
    """`0011165.jpg_Fish` -> (`0011165.jpg`, `Fish`); ValueError for anything else."""
    image_id, sep, label = str(value).rpartition("_")
    if not sep or not image_id:
        raise ValueError(f"{ID_COLUMN} {value!r} is not of the form '<image>_<label>'")
    if label not in LABELS:
        raise ValueError(f"{ID_COLUMN} {value!r} has unknown label {label!r}; expected one of {', '.join(LABELS)}")
    return image_id, label
