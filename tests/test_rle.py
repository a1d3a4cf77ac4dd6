import numpy as np
import pytest

from cloudseg import rle


def reference_encode(mask: np.ndarray) -> str:
    """Pixel-by-pixel Kaggle RLE written the slow, obvious way."""
    height, width = mask.shape
    runs, start, length = [], None, 0
    for number in range(1, height * width + 1):
        x, y = divmod(number - 1, height)  # column-major: down each column, then right
        if mask[y, x]:
            start, length = (number, 1) if start is None else (start, length + 1)
        elif start is not None:
            runs += [start, length]
            start = None
    if start is not None:
        runs += [start, length]
    return " ".join(map(str, runs))


def test_orientation_on_a_3x2_mask():
    # pixel numbers: column 0 is 1,2,3 top to bottom; column 1 is 4,5,6
    mask = np.array([[1, 0], [1, 1], [0, 1]], np.uint8)
    assert rle.encode(mask) == "1 2 5 2"
    np.testing.assert_array_equal(rle.decode("1 2 5 2", (3, 2)), mask)
    np.testing.assert_array_equal(rle.decode("2 1 4 1", (3, 2)), [[0, 1], [1, 0], [0, 0]])


def test_documented_example():
    mask = rle.decode("1 3 10 5", (5, 4))
    assert np.flatnonzero(mask.T.ravel() == 1).tolist() == [0, 1, 2, 9, 10, 11, 12, 13]


def test_run_across_a_column_boundary_and_touching_image_ends():
    mask = np.zeros((3, 3), np.uint8)
    mask[2, 0] = mask[0, 1] = 1  # pixels 3 and 4: one run across the column boundary
    mask[2, 2] = 1  # the last pixel
    assert rle.encode(mask) == "3 2 9 1"
    np.testing.assert_array_equal(rle.decode("3 2 9 1", (3, 3)), mask)


@pytest.mark.parametrize("seed", range(6))
def test_round_trip_on_random_masks_matches_reference(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 40, 2))
    mask = (rng.random(shape) < rng.uniform(0.05, 0.95)).astype(np.uint8)
    encoded = rle.encode(mask)
    assert encoded == reference_encode(mask)
    decoded = rle.decode(encoded, shape)
    assert decoded.dtype == np.uint8 and decoded.flags.c_contiguous
    np.testing.assert_array_equal(decoded, mask)


def test_full_and_bool_masks():
    assert rle.encode(np.ones((4, 5), bool)) == "1 20"
    np.testing.assert_array_equal(rle.decode("1 20", (4, 5)), np.ones((4, 5)))
    assert rle.encode(np.array([[0, 7], [0, 0]])) == "3 1"  # any nonzero value is "on"


@pytest.mark.parametrize("empty", ["", "   ", None, float("nan"), np.nan])
def test_empty_decodes_to_empty_mask(empty):
    mask = rle.decode(empty, (3, 4))
    assert mask.shape == (3, 4) and not mask.any()


def test_empty_mask_encodes_to_empty_string():
    assert rle.encode(np.zeros((7, 9), np.uint8)) == ""


def test_default_shape_is_native_kaggle_size():
    mask = rle.decode("1 1400 2940000 1")
    assert mask.shape == (1400, 2100)
    assert mask[:, 0].all() and mask[-1, -1] == 1 and mask.sum() == 1401


@pytest.mark.parametrize(
    "bad, message",
    [
        ("1 2 3", "odd number of values"),
        ("1 2 x 4", "non-integer value 'x'"),
        ("1 2.5", "non-integer value '2.5'"),
        # what Python's int() and NumPy take but no RLE writer writes
        ("1 +5", "non-integer value '\\+5'"),
        ("1_000 2", "non-integer value '1_000'"),
        ("\uff15 1", "non-integer value '\uff15'"),  # a fullwidth 5
        ("1 2 1-2 3", "non-integer value '1-2'"),
        ("NaN", "non-integer value 'NaN'"),  # a spreadsheet's empty cell, not "an odd number of values"
        ("1 2\u00a0\uff15 1", "non-integer value '\uff15'"),  # non-ASCII text: the regular expression's path
        ("0 3", "start 0"),
        ("-2 3", "start -2"),
        ("4 0", "length 0"),
        ("4 -1", "length -1"),
        ("1 13", "past the last pixel 12"),
        ("12 2", "past the last pixel 12"),
        ("5 2 1 2", "unsorted or overlapping"),
        ("1 5 3 2", "unsorted or overlapping"),
    ],
)
def test_malformed_rle_raises_value_error_saying_what(bad, message):
    with pytest.raises(ValueError, match=message):
        rle.decode(bad, (3, 4))


@pytest.mark.parametrize("bad", ["1 1 9223372036854775701 7252", "2 9223372036854775807"])
def test_values_whose_run_end_would_wrap_around_are_refused(bad):
    """A start or length near int64's largest value: start + length wraps negative, which passed
    the order and end-of-image checks, and decode's np.repeat then crashed the process (a
    segmentation fault in `cloudseg check` on one train.csv cell). Would catch any check made
    after the sum rather than on the values."""
    with pytest.raises(ValueError, match="larger than any image's pixel count"):
        rle.runs(bad, (3, 4))


def test_adjacent_runs_are_valid():
    np.testing.assert_array_equal(rle.decode("1 2 3 2", (2, 2)), np.ones((2, 2)))


def test_encode_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        rle.encode(np.zeros((2, 3, 4)))
