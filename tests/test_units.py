"""`human_duration`: every time printed to a user, in the unit that fits. Device: none (pure Python)."""

import pytest

from cloudseg.units import human_duration


@pytest.mark.parametrize("seconds, text", [
    (0.5, "0.5 s"),
    (4.24, "4.2 s"),
    (9.96, "10 s"),        # not "10.0 s"
    (45, "45 s"),
    (59.4, "59 s"),
    (59.5, "1 min"),       # would round to "60 s"
    (168, "2.8 min"),      # 6 images x 28 s: the CPU refusal of configs/fullres.yaml
    (180, "3 min"),        # not "3.0 min"
    (3569, "59 min"),      # 59.48 min
    (3570, "1 h"),         # 59.5 min would round to "60 min"
    (9000, "2.5 h"),
    (5546 * 28, "43 h"),   # 43.13 h: an epoch of the real training set on a CPU
])
def test_durations_are_written_in_the_unit_that_fits(seconds, text):
    """Hand-computed cases around each change of unit. Would catch: one unit for every size (the
    refusal said "~0 h per epoch of 6 images"), a unit that changes too late ("60 s", "60 min"),
    trailing zeros, and minutes or hours computed with the wrong divisor."""
    assert human_duration(seconds) == text
