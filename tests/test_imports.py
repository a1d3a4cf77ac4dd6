"""What a command imports (issue #38): a one-scene `cloudseg segment` pays for every module it
imports, so the heavy ones it does not use stay out, each imported by the one function that
needs it. Each check runs in a new process (sys.modules of this one holds everything). Device:
none (imports only; the processes start beside the fake GPU, as every test subprocess).

torch._dynamo comes with any model: segmentation_models_pytorch imports timm, which imports
torchvision.ops, which imports torch._dynamo. So it is checked on cloudseg's modules that build
no model, where only cloudseg itself could bring it in."""

import importlib.util
import json
import subprocess
import sys

import pytest

# The heavy modules a command may import only when it uses them, and what uses them.
HEAVY = {
    "torch._dynamo": "compiling (and any model, through torchvision)",
    "sklearn": "making folds (data.make_folds)",
    "matplotlib": "plots (viz)",
    "albumentations": "training's augmentation (data.build_transform)",
    "tensorboard": "training's log (train)",
    "scipy.sparse.csgraph": "the rule search (postprocess, tune)",
    "rasterio": "GeoTIFF scenes (geo.geo_module)",
    "pandas": "tables: train.csv, the folds, the submission, the notebooks' statistics (segment writes its own CSV)",
}


def imported_by(code: str) -> set[str]:
    """The modules in sys.modules of a new Python process after it runs `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def heavy(modules: set[str]) -> set[str]:
    return {name for name in HEAVY if name in modules}


SEGMENT_HELP = """
from cloudseg.cli import main
try:
    main(["segment", "--help"])
except SystemExit:
    pass
"""


@pytest.mark.parametrize("code, allowed", [
    ("import cloudseg.segment", {"torch._dynamo"}),  # through smp -> timm -> torchvision.ops
    ("import cloudseg.predict", {"torch._dynamo"}),
    ("import cloudseg.compiled, cloudseg.data, cloudseg.decode, cloudseg.viz, cloudseg.postprocess", set()),
], ids=["segment", "predict", "no-model-modules"])
def test_a_module_imports_no_heavy_module_it_does_not_use(code, allowed):
    """Would catch: `import matplotlib.pyplot` back at the top of viz (segment imports viz for its
    overlay), scikit-learn or pandas at the top of data (segment reads scenes through data), pandas
    at the top of predict or viz, albumentations
    at the top of decode, SciPy's csgraph at the top of postprocess, torch._dynamo imported by
    compiled at its top."""
    found = heavy(imported_by(code)) - allowed
    assert not found, {name: HEAVY[name] for name in found}


def test_a_command_s_help_imports_no_torch():
    """Would catch: the command line importing a command's module (and torch) before the
    command runs, so that `cloudseg segment --help` waits seconds for PyTorch."""
    modules = imported_by(SEGMENT_HELP)
    assert "cloudseg.cli" in modules and "torch" not in modules


def test_the_checker_sees_each_heavy_module_once_its_user_runs():
    """The control: the functions that use each heavy module still import it (and the checker
    finds it in a process that did). Would catch: a checker that never finds anything (a typo
    in a module's name, sys.modules read from the wrong process), and a lazy import lost from
    the function that needs it."""
    code = """
import numpy as np
import pandas as pd
import torch
from cloudseg import compiled, data, postprocess, viz
from cloudseg.task import LABELS
labels = pd.DataFrame({label: ["1 1"] * 5 + [""] * 5 for label in LABELS})
data.make_folds(labels, n_folds=2)
data.build_transform(hflip=0.5)
viz.plot_curves(pd.DataFrame({"epoch": [1], "train_loss": [1.0], "valid_loss": [1.0], "dice": [0.5], "lr": [0.1],
                              **{f"dice_{label}": [0.5] for label in LABELS}}))
postprocess.grid_scores(np.zeros((1, 8, 8), np.uint8), np.zeros((1, 8, 8), bool))
compiled.graph_counts()
import cloudseg.train
"""
    gdal = importlib.util.find_spec("rasterio") is not None  # the geo extra (make test installs it)
    if gdal:
        code += "from cloudseg import geo\ngeo.check_codec(geo.DEFAULT_CODEC)\n"
    assert heavy(imported_by(code)) == set(HEAVY) - (set() if gdal else {"rasterio"})


def test_a_call_on_a_jpeg_scene_imports_no_gdal(tmp_path):
    """`cloudseg segment` on a JPEG scene, which writes PNGs, in a new process; then a bad codec's
    name for the same job, refused (in this one). Would catch: the codec's check (a GeoTIFF written in memory by
    rasterio, 0.4 s of the demo's one-image call on 2 cores) run for a job with no GeoTIFF, or
    --compress no longer checked at all for one; pandas imported to write fractions.csv (0.3 s)."""
    import cv2
    import numpy as np

    from tests.conftest import write_tiny_checkpoint

    scene = tmp_path / "scene.jpg"
    cv2.imwrite(str(scene), np.full((64, 96, 3), 90, np.uint8))
    checkpoint = write_tiny_checkpoint(tmp_path / "best.pt")
    call = f"""
from cloudseg.cli import main
assert main(["segment", {str(scene)!r}, "--checkpoint", {str(checkpoint)!r}, "--out", {str(tmp_path / "out")!r},
             "--device", "cpu"]) == 0
"""
    modules = imported_by(call)
    assert "cloudseg.segment" in modules and not {"rasterio", "pandas"} & modules
    assert (tmp_path / "out" / "scene_masks.png").is_file() and (tmp_path / "out" / "fractions.csv").is_file()
    from cloudseg.cli import main  # a bad name refused for a JPEG job too (what the call imports: above)

    assert main(["segment", str(scene), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "refused"),
                 "--compress", "jpeg2000", "--device", "cpu"]) == 2
