"""Quantities as people read them. Durations: tqdm's format_interval writes a clock ("02:48"),
which says nothing of the unit in a sentence such as "~3 min per epoch"."""

from __future__ import annotations


def human_duration(seconds: float) -> str:
    """`seconds` in the unit that fits: `4.2 s`, `45 s`, `3 min`, `2.5 h`, `43 h`. Two figures at
    most below 10, whole units above; the unit changes where the smaller one would round to 60."""
    if seconds < 59.5:
        value, unit = seconds, "s"
    elif seconds < 59.5 * 60:
        value, unit = seconds / 60, "min"
    else:
        value, unit = seconds / 3600, "h"
    text = f"{value:.1f}".rstrip("0").rstrip(".") if value < 9.95 else f"{value:.0f}"
    return f"{text} {unit}"
