"""The notebooks run, today and after every change (executed on a tiny synthetic dataset)."""

import shutil
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from cloudseg.viz import label_stats

NOTEBOOKS = sorted(Path("notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs():
    assert [p.name for p in NOTEBOOKS] == ["01_eda.ipynb", "02_results.ipynb", "03_segment.ipynb"]
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path


def test_label_stats_by_hand():
    labels = pd.DataFrame({"Fish": ["1 1", "", "1 1"], "Flower": ["1 1", "1 1", ""], "Gravel": ["", "", ""],
                           "Sugar": ["", "", "1 1"]}, index=["a", "b", "c"])
    stats = label_stats(labels)
    assert stats["frequency"].tolist() == pytest.approx([2 / 3, 2 / 3, 0, 1 / 3])
    assert stats["cooccurrence"].loc["Fish", "Flower"] == 1 and stats["cooccurrence"].loc["Fish", "Fish"] == 2
    assert stats["per_image"].to_dict() == {1: 1, 2: 2}


@pytest.mark.notebooks
def test_notebooks_execute_on_a_tiny_synthetic_dataset(tiny_data, tmp_path, monkeypatch):
    from cloudseg.config import load_config
    from cloudseg.notebooks import execute
    from cloudseg.train import train
    from cloudseg.tune import tune
    from tests.conftest import TINY

    data = shutil.copytree(tiny_data, tmp_path / "data")
    run = tmp_path / "runs" / "fold0"
    train(load_config("configs/demo.yaml", [f"data.dir={data}", *TINY, "train.epochs=1"]), run)
    tune([run])  # the run's postprocess.json again (training wrote it), which the results notebook shows
    monkeypatch.setenv("CLOUDSEG_DATA", str(data))
    monkeypatch.setenv("CLOUDSEG_RUN", str(run))
    monkeypatch.setenv("CLOUDSEG_SEGMENT_OUT", str(tmp_path / "segment"))  # 03_segment's scenes and maps
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # on the CPU, as TINY trains: the kernel's `auto` sees no GPU
    for path in NOTEBOOKS:
        executed = nbformat.read(execute(path, out_dir=tmp_path / "executed"), as_version=4)
        outputs = [o for cell in executed.cells for o in cell.get("outputs", [])]
        assert not [o for o in outputs if o.output_type == "error"], path
        assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4, path  # the plots are there
