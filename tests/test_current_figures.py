"""The GPU figures the README quotes against BENCHMARKS.md's "Current figures" table (issue #60).
Device: none (reads markdown).

A figure is a number, or numbers joined by "-", "/", "to" or "and" ("4.60-4.94", "9.73 / 6.71"),
written before a unit: images/s, megapixels/s, samples/s, GiB, GB, ms, s, min, %, × or x. A number
with no unit after it ("6.71 with `encoder`") is not read. The README's figures are those of its
"What to expect" section, in the bullets and paragraphs that name a GPU ("GPU" in any case, CUDA,
NVIDIA, a card: H100, A100, T4, RTX...); the demo's and the noisy labels' bullets ran on a CPU and
name none, so their Dice and shares are not GPU figures and are left out. docs/what-to-expect.md is
read the same way, whole. The table's figures are those of its "what" and "figure" columns. Every
quoted figure, number and unit, must be one of the table's. docs/memory-and-gpus.md is not held to
it: it also tells why a default is what it is, with the figures of the window that decided it.
"""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
NUMBER = r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = r"images/s|megapixels/s|samples/s|GiB|GB|ms\b|min(?:utes)?\b|s\b|%|×(?!\s*\d)|x\b(?!\s*\d)"
FIGURE = re.compile(rf"({NUMBER}(?:\s*(?:-|–|/|to|and)\s*{NUMBER})*)\s*({UNIT})")
NAMES_A_GPU = re.compile(r"(?i:\bgpus?\b)|\b(CUDA|NVIDIA|RTX|GTX|[AHLTV]\d{1,3})\b")


def figures(text: str) -> set[tuple[float, str]]:
    """Each number written before a unit, with that unit: "4.60-4.94 GiB" gives (4.6, "GiB") and
    (4.94, "GiB")."""
    found = set()
    for numbers, unit in FIGURE.findall(text):
        unit = {"x": "×", "minutes": "min"}.get(unit, unit)
        found |= {(float(n.replace(",", "")), unit) for n in re.findall(NUMBER, numbers)}
    return found


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def gpu_blocks(text: str) -> list[str]:
    """The paragraphs and bullets of `text` that name a GPU."""
    blocks = re.split(r"\n\s*\n|\n(?=- )", text)
    return [block for block in blocks if NAMES_A_GPU.search(block)]


def table(benchmarks: str) -> list[dict[str, str]]:
    """The rows of the first table under "## Current figures", keyed by the header's names."""
    lines = [line for line in section(benchmarks, "Current figures").splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def unquoted(quoting: str, benchmarks: str) -> list[str]:
    """The GPU figures of `quoting` that the Current figures table does not hold."""
    held = set().union(*(figures(row["what"] + " " + row["figure"]) for row in table(benchmarks)))
    quoted = set().union(set(), *(figures(block) for block in gpu_blocks(quoting)))
    return [f"{number:g} {unit}" for number, unit in sorted(quoted - held)]


def readme_figures_text() -> str:
    return section((ROOT / "README.md").read_text(), "What to expect")


BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()


def test_every_gpu_figure_the_readme_quotes_is_in_the_current_figures_table():
    """Would catch: a stale figure left in the README after the table moved on (63.6 images/s and
    1.60× careful Lightning of 2026-11-25 once stood there while the H200 had measured 69.71 and
    1.75×), or a figure typed into the README that no window measured."""
    text = readme_figures_text()
    assert len(set().union(*map(figures, gpu_blocks(text)))) >= 5, "the README's GPU figures were not found"
    assert unquoted(text, BENCHMARKS) == []


def test_every_gpu_figure_of_what_to_expect_is_in_the_current_figures_table():
    """Would catch: docs/what-to-expect.md, the README's figures at length, quoting a superseded
    figure (segment "0.30-0.36× a naive loop ... its GPU figures are still to measure" once did)."""
    text = (ROOT / "docs" / "what-to-expect.md").read_text()
    assert len(set().union(*map(figures, gpu_blocks(text)))) >= 10
    assert unquoted(text, BENCHMARKS) == []


def test_a_stale_figure_planted_in_the_readme_is_reported_and_a_cpu_figure_is_not():
    """The rule's own control: the README's real text with 2026-11-25's figures put back fails with
    both named; a new bullet with an unmeasured GPU figure fails; the demo's Dice (a CPU figure)
    and a GPU figure the table holds pass."""
    text = readme_figures_text()
    assert "69.71 images/s" in text and "1.75×" in text
    stale = text.replace("69.71 images/s", "63.6 images/s").replace("1.75×", "1.60×")
    assert unquoted(stale, BENCHMARKS) == ["1.6 ×", "63.6 images/s"]
    assert unquoted(text + "\n- **On one A100**: 51.5 images/s compiled, 1.3x Lightning.\n",
                    BENCHMARKS) == ["1.3 ×", "51.5 images/s"]
    assert unquoted("- **The demo** (2-core CPU): validation Dice 0.975, 63% of the margin in 12 min.\n"
                    "- **On one H100**: 209.8 megapixels/s.\n", BENCHMARKS) == []


def test_the_figure_reader_reads_ranges_lists_and_units_as_written():
    assert figures("4.60-4.94 GiB; 9.73 / 6.71 GiB; 4.54 and 4.68 GiB") == {
        (4.6, "GiB"), (4.94, "GiB"), (9.73, "GiB"), (6.71, "GiB"), (4.54, "GiB"), (4.68, "GiB")}
    assert figures("1.75× and 1.56x, 88.5%, 3,698 in 1.0 min, about 7 minutes, 5.6 s") == {
        (1.75, "×"), (1.56, "×"), (88.5, "%"), (1.0, "min"), (7.0, "min"), (5.6, "s")}
    assert figures("an H100 at 1400×2100, 126 megapixels, 2026-11-27, 2 scenes, bf16 8 workers") == set()


def test_every_row_of_the_table_names_its_gpu_commit_and_date_and_links_to_its_window():
    """Would catch: a row without the machine, the code or the day it was measured on (unless it
    says it was not measured), or a link to a window heading that was renamed."""
    rows = table(BENCHMARKS)
    assert len(rows) >= 10
    slugs = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
             for heading in re.findall(r"^#+ (.+)$", BENCHMARKS, re.MULTILINE)}
    for row in rows:
        if not row["figure"].startswith("not measured yet"):
            assert re.fullmatch(r"H100|H200", row["GPU"]), row
            assert re.match(r"[0-9a-f]{7}\b", row["commit"]), row
            assert re.fullmatch(r"2026-\d\d-\d\d", row["date"]), row
        anchors = re.findall(r"\]\(#([^)]+)\)", row["where measured"])
        assert anchors and set(anchors) <= slugs, row


def test_the_readme_points_to_the_table():
    assert "(BENCHMARKS.md#current-figures)" in readme_figures_text()
    assert "current-figures" in {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
                                 for h in re.findall(r"^## (.+)$", BENCHMARKS, re.MULTILINE)}
