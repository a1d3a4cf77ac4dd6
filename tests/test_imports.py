"""What a command imports (issue #38): a one-scene `cloudseg segment` pays for every module it
imports, so the heavy ones it does not use stay out, each imported by the one function that
needs it. Each check runs in a new process (sys.modules of this one holds everything). Device:
none (imports only; the processes start beside the fake GPU, as every test subprocess).

torch._dynamo would come with any model: segmentation_models_pytorch imports timm and torchvision,
which load it as they are imported; cloudseg.model imports smp with it deferred
(`compiled.dynamo_deferred`), and builds a checkpoint's model on the meta device without
touching it (`model.initialisation_skipped`)."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The heavy modules a command may import only when it uses them, and what uses them.
HEAVY = {
    "torch._dynamo": "compiling",
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
    ("import cloudseg.segment", set()),
    ("import cloudseg.predict", set()),
    ("import cloudseg.compiled, cloudseg.data, cloudseg.decode, cloudseg.viz, cloudseg.postprocess", set()),
], ids=["segment", "predict", "no-model-modules"])
def test_a_module_imports_no_heavy_module_it_does_not_use(code, allowed):
    """Would catch: `import matplotlib.pyplot` back at the top of viz (segment imports viz for its
    overlay), scikit-learn or pandas at the top of data (segment reads scenes through data), pandas
    at the top of predict or viz, albumentations
    at the top of decode, SciPy's csgraph at the top of postprocess, torch._dynamo imported by
    compiled at its top, or by smp's timm and torchvision (model importing smp outside
    `dynamo_deferred`, or a stand-in that loads the real module on Python's own questions)."""
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
    --compress no longer checked at all for one; pandas imported to write fractions.csv (0.3 s);
    torch._dynamo imported by the checkpoint's model built on the meta device (torch.nn.init's
    normal_ or the normalization's product computed there: 2 s of that call)."""
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
    assert "cloudseg.segment" in modules and not {"rasterio", "pandas", "torch._dynamo"} & modules
    assert (tmp_path / "out" / "scene_masks.png").is_file() and (tmp_path / "out" / "fractions.csv").is_file()
    from cloudseg.cli import main  # a bad name refused for a JPEG job too (what the call imports: above)

    assert main(["segment", str(scene), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "refused"),
                 "--compress", "jpeg2000", "--device", "cpu"]) == 2


DEFERRED_THEN_USED = """
import sys
import torch
import cloudseg.model  # smp, timm and torchvision, torch._dynamo deferred
import timm.layers
assert "torch._dynamo" not in sys.modules and "torch._dynamo.utils" not in sys.modules  # no stand-in left
assert torch.compiler.disable.__module__ == "torch.compiler"

@timm.layers.disable_compiler  # torch.compiler.disable as timm took it, deferred
def doubled(x):
    return x * 2

roi_align = sys.modules["torchvision.ops.roi_align"]
assert "torch._dynamo" not in sys.modules  # decorating loaded nothing
supported = roi_align.is_compile_supported("cpu")  # the stand-in's: loads the real torch._dynamo
assert type(sys.modules["torch._dynamo.utils"]) is type(sys)  # the module itself, no stand-in
from torch._dynamo.utils import counters, is_compile_supported
assert supported == is_compile_supported("cpu")
eager = doubled(torch.ones(3))
compiled = torch.compile(lambda x: doubled(x + 1), backend="eager")(torch.ones(3))
assert eager.sum() == 6 and compiled.sum() == 12
assert len(counters["graph_break"]) == 1, counters["graph_break"]  # the disabled call
"""


def test_what_imports_with_torch_dynamo_deferred_works_once_it_is_loaded():
    """Device: CPU (a new process). After `import cloudseg.model`: torchvision's
    `is_compile_supported` answers as the real one (and loads it), torch.compile works, and
    timm's torch.compiler.disable, which it took while deferred, decorates without loading
    anything, runs eagerly, and is skipped by a compile (one graph break, as timm means). Would
    catch: a stand-in's function that answers a constant without loading the real one, the
    stand-in left in sys.modules after the block (compiling would find it), torch.compiler.disable
    not restored, a deferred decorator that loads torch._dynamo, loses its function's arguments,
    or is never applied (no graph break: dynamo traces into the function)."""
    imported_by(DEFERRED_THEN_USED)


def test_a_stand_in_loads_its_module_at_the_first_name_read_from_it(tmp_path, monkeypatch):
    """Device: none. Would catch: Python's own questions (`__file__`, which `inspect` asks every
    module; `__path__`, which `from X import Y` asks) loading the module, and a stand-in that stays
    in sys.modules (import_module would hand it back: no module, endless recursion)."""
    from cloudseg.compiled import LoadedOnUse

    (tmp_path / "cloudseg_deferred_target.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stand_in = LoadedOnUse("cloudseg_deferred_target")
    monkeypatch.setitem(sys.modules, "cloudseg_deferred_target", stand_in)
    assert not hasattr(stand_in, "__file__") and not hasattr(stand_in, "__path__")
    assert sys.modules["cloudseg_deferred_target"] is stand_in  # nothing loaded yet
    assert stand_in.VALUE == 42
    loaded = sys.modules["cloudseg_deferred_target"]
    assert loaded is not stand_in and loaded.__file__ == str(tmp_path / "cloudseg_deferred_target.py")


def test_a_deferred_disable_is_applied_once_at_the_first_call_with_its_options():
    """Device: none. Would catch: torch.compiler.disable applied when a function is decorated
    (torch._dynamo imported then), applied at every call, its options (recursive, reason) or the
    function's arguments lost, the decorator-factory form (`@disable(recursive=False)`) broken, a
    decorated class turned into a function (subclasses and isinstance would break)."""
    from cloudseg.compiled import disabled_on_first_call

    applied = []

    def disable(function, recursive, **options):
        applied.append((function.__name__, recursive, options))
        return lambda *args, **kwargs: ("disabled", function(*args, **kwargs))

    @functools.partial(disabled_on_first_call, disable)
    def add(x, y=0):
        return x + y

    @functools.partial(disabled_on_first_call, disable)(recursive=False, reason="why")
    def negate(x):
        return -x

    assert applied == [] and add.__name__ == "add"
    assert add(1, y=2) == add(3) == ("disabled", 3) and negate(4) == ("disabled", -4)
    assert applied == [("add", True, {}), ("negate", False, {"reason": "why"})]

    class Module:
        pass

    kept = []  # a class is disabled at once, and stays a class (as torch.compiler.disable keeps it)
    decorated = disabled_on_first_call(lambda function, recursive, **options: kept.append(function) or function, Module)
    assert kept == [Module] and decorated is Module


def test_deferring_changes_nothing_once_torch_dynamo_is_loaded():
    """Device: none. Would catch: the block putting its stand-in over a loaded torch._dynamo.utils,
    or its deferred disable over torch's (a compile in the same process would meet them)."""
    import torch
    import torch._dynamo.utils

    from cloudseg.compiled import dynamo_deferred

    loaded, disable = sys.modules["torch._dynamo.utils"], torch.compiler.disable
    with dynamo_deferred():
        assert sys.modules["torch._dynamo.utils"] is loaded and torch.compiler.disable is disable
    assert sys.modules["torch._dynamo.utils"] is loaded and torch.compiler.disable is disable


HUGE_PAGES = """
import sys
from cloudseg.cli import main
assert "torch" not in sys.modules
main(["doctor"])  # a command that imports torch
import torch
tensor = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
address, inside = tensor.data_ptr(), False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end
        start, end = (int(bound, 16) for bound in head.split("-"))
        inside = start <= address < end
    elif line.startswith("VmFlags:") and inside:
        print("FLAGS", *line.split()[1:])
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file(),
                    reason="a kernel without transparent huge pages")
@pytest.mark.parametrize("setting, huge", [(None, True), ("0", False)], ids=["default", "user-off"])
def test_a_command_s_large_tensors_ask_for_huge_pages_unless_the_user_says_no(setting, huge):
    """Device: CPU (a new process; Linux). A 64 MB tensor made after a command ran lies in memory
    the kernel was asked to back with huge pages (MADV_HUGEPAGE, VmFlags "hg"), and not where the
    user set THP_MEM_ALLOC_ENABLE=0. Would catch: the setting made after torch's import (PyTorch
    reads it at its first allocation, during the import) or not at all, and the user's own setting
    overridden."""
    env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    flags = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("FLAGS"))
    assert ("hg" in flags) == huge, flags
