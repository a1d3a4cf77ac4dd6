"""A user with a dozen images gets a run, not a refusal (issue 12)."""

import numpy as np
import pandas as pd
import pytest

from cloudseg.cli import main
from cloudseg.data import read_train_csv
from cloudseg.synth import synthesize
from cloudseg.task import FOLDS_CSV

SMALL_MODEL = ["model.arch=unet", "model.decoder_channels=[16,8,8,8,8]", "train.micro_batch=2",
               "train.effective_batch=4", "train.warmup_steps=1", "train.min_steps=0"]


@pytest.mark.parametrize("n_images", [12, 24])
def test_train_runs_to_the_end_on_a_dozen_images_with_five_folds(n_images, tmp_path):
    """Catches make_folds refusing datasets where no label set is shared by 5 images (it did),
    and folds that leave the validation fold empty or lopsided."""
    data = synthesize(tmp_path / "data", n_train=n_images, n_test=4, height=64, width=96, seed=3)
    label_sets = read_train_csv(data).ne("").to_numpy() @ [1, 2, 4, 8]
    assert np.bincount(label_sets).max() < 5  # the case that used to be refused
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=f"{n_images} images are too few for 5 well-balanced folds"):
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}",
                     "train.epochs=1", "data.num_workers=0", "train.device=cpu", "train.every_fold=false",
                     *SMALL_MODEL]) == 0
    assert (run / "best.pt").is_file()
    assert pd.read_csv(run / "metrics.csv")["epoch"].tolist() == [1]
    sizes = pd.read_csv(data / FOLDS_CSV)["fold"].value_counts()
    assert sorted(sizes.index) == [0, 1, 2, 3, 4] and sizes.max() - sizes.min() <= 1


@pytest.mark.slow
def test_two_processes_train_a_dozen_images_with_five_folds(tmp_path):
    """The 2-process torchrun demo on 12 images runs to the end (short windows, a process with
    nothing in some windows, a 2- or 3-image validation fold sharded over two processes)."""
    import os
    import subprocess
    import sys

    data = synthesize(tmp_path / "data", n_train=12, n_test=4, height=64, width=96, seed=3)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "cloudseg", "train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}",
               "train.epochs=1", "data.num_workers=0", "train.device=cpu", "train.every_fold=false", *SMALL_MODEL]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"best.pt", "oof.npz", "postprocess.json"} <= {p.name for p in run.iterdir()}
