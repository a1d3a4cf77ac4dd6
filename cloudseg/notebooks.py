"""`python -m cloudseg.notebooks NB.ipynb ...`: execute notebooks headless (the notebooks
look at every step of the data path through `cloudseg.viz`).

The executed copies go to runs/notebooks/, so the notebooks in git stay without outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

OUT_DIR = Path("runs/notebooks")


def execute(path: str | Path, out_dir: Path = OUT_DIR, timeout: int = 600) -> Path:
    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(Path.cwd())}}).execute()
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, out_dir / path.name)
    return out_dir / path.name


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"executed {name} -> {execute(name)}")
