"""A one-scene call in seconds (issue #38): predict.compile=auto compiles only for a job that
repays the compile, and a compile done once is taken from inductor's on-disk cache by the next
process. Device: CPU (the rule's CUDA branch through a CUDA device object and Triton's
presence faked); the reuse tests compile with inductor on the CPU in new processes."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from cloudseg import cli, compiled, geo
from cloudseg import predict as predict_module
from cloudseg import segment as segment_module
from cloudseg.cli import main
from cloudseg.compiled import COMPILE_REPAID_PIXELS, resolve_compile
from tests.conftest import write_tiny_checkpoint

CUDA = torch.device("cuda")


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)


def test_auto_compiles_only_for_a_job_that_repays_the_compile(with_triton, caplog):
    """Would catch: a one-scene call compiling (tens of seconds for a second of work), a large job
    not compiling, an unknown amount of work (None: train, predict) no longer compiling on CUDA,
    true or false overruled by the rule, and a CPU compiling for a large job."""
    below, at = COMPILE_REPAID_PIXELS - 1, COMPILE_REPAID_PIXELS
    assert [resolve_compile("auto", CUDA, work_pixels=work) for work in (2800 * 4200, below, at, None)] == [
        False, False, True, True]
    assert resolve_compile(True, CUDA, work_pixels=1) is True and resolve_compile(False, CUDA, work_pixels=at) is False
    assert resolve_compile("auto", torch.device("cpu"), work_pixels=10 * at) is False
    with caplog.at_level(logging.INFO, logger="cloudseg"):
        resolve_compile("auto", CUDA, "predict.compile", work_pixels=2_000_000_000)
    assert ("predict.compile=auto: not compiling for 2.00 gigapixels of model input (compiling repays from "
            f"{COMPILE_REPAID_PIXELS / 1e9:.0f};") in caplog.text


def write_scenes(folder: Path) -> dict[str, tuple[int, int]]:
    """A JPEG, a PNG and a GeoTIFF scene of different sizes, and a file that is none: name -> (H, W)."""
    transform = pytest.importorskip("rasterio.transform")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = {"a.jpg": (70, 130), "b.png": (90, 50), "c.tif": (40, 60)}
    for name, (height, width) in shapes.items():
        image = rng.integers(20, 255, (height, width, 3), dtype=np.uint8)
        if name.endswith(".tif"):
            geo.write_rgb_geotiff(folder / name, image, "EPSG:4326", transform.from_origin(-60, 15, 0.1, 0.1))
        else:
            cv2.imwrite(str(folder / name), image)
    (folder / "d.jpg").write_bytes(b"not an image")
    return {**shapes, "d.jpg": (0, 0)}


def test_a_scene_s_shape_is_read_from_its_header(tmp_path):
    """Would catch: width and height swapped (a PNG's IHDR holds the width first), a header read
    that gives up on a JPEG whose frame header lies beyond the first read (a large metadata
    segment), an unreadable file that stops the run (mapping it says why, later)."""
    shapes = write_scenes(tmp_path)
    assert {name: geo.scene_shape(tmp_path / name) for name in shapes} == shapes
    jpeg = (tmp_path / "a.jpg").read_bytes()
    comment = b"\xff\xfe" + (65535).to_bytes(2, "big") + bytes(65533)  # COM segments push the frame header out
    (tmp_path / "late.jpg").write_bytes(jpeg[:2] + comment * 5 + jpeg[2:])
    assert cv2.imread(str(tmp_path / "late.jpg")).shape[:2] == geo.scene_shape(tmp_path / "late.jpg") == (70, 130)


def test_segment_counts_the_pixels_still_to_map_times_the_flips(tmp_path, monkeypatch):
    """Would catch: the rule fed every scene (the done ones too), the windows' count instead of
    the pixels, the test-time flips left out (4 flips are 4 forwards), and segment not asking the
    rule at all."""
    write_scenes(tmp_path / "in")
    (tmp_path / "in" / "d.jpg").unlink()
    checkpoint = write_tiny_checkpoint(tmp_path / "best.pt")
    asked = []
    real = predict_module.resolve_compile
    monkeypatch.setattr(predict_module, "resolve_compile",
                        lambda setting, device, key, work=None: asked.append(work) or real(setting, device, key, work))
    out = tmp_path / "out"
    out.mkdir()
    (out / "b.json").write_text(json.dumps({"grid": None}))  # b.png done by an earlier call
    assert main(["segment", str(tmp_path / "in"), "predict.tta=d4-lite", "--checkpoint", str(checkpoint),
                 "--out", str(out), "--device", "cpu", "--postprocess", "none"]) == 0
    assert asked == [4 * (70 * 130 + 40 * 60)]  # a.jpg and c.tif, four flips each


def test_the_command_line_keeps_compiled_graphs_in_a_per_user_folder(tmp_path, monkeypatch):
    """Would catch: the user's own TORCHINDUCTOR_CACHE_DIR overruled, XDG_CACHE_HOME ignored, a
    folder that changes from call to call, and a home folder that cannot be written stopping the
    command (torch's default then stays)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cli.keep_compiled_graphs()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "cloudseg" / "inductor")
    assert (tmp_path / "cache" / "cloudseg" / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cli.keep_compiled_graphs()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file: no folder can be made below it
    cli.keep_compiled_graphs()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


# A process that compiles a convolution with inductor as prediction does (compiled.compiled,
# compile_logged), after the command line's cache setting, and prints torch._dynamo's counters.
COMPILE_ONCE = """
import json, logging, sys
import torch
from cloudseg import cli
cli.keep_compiled_graphs()
from cloudseg import compiled
logging.basicConfig(level=logging.INFO, format="%(message)s")
torch.manual_seed(0)
model = torch.nn.Conv2d(3, 4, 3, padding=1).eval()  # no kernel to generate: nothing for a C++ compiler to build
forward = compiled.compiled(model)
images = torch.rand(2, 3, 16, 24)
with torch.no_grad(), compiled.compile_logged(True, images.shape, what="prediction batches"):
    forward(images)
counters = compiled.dynamo_counters()
print(json.dumps({"graphs": compiled.graph_counts()[0], **counters["inductor"], **counters["aot_autograd"]}))
"""


def in_new_process(cache_home: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`python ARGUMENTS` in a new process whose cache folder is under `cache_home`."""
    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(cache_home), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # two new processes compiling with inductor: about a minute on the 2-core VM (make test-all)
def test_a_second_process_takes_the_compiled_graph_from_inductor_s_cache(tmp_path):
    """Two new processes compile the same model with inductor on the CPU; the second compiles
    nothing itself. Would catch: a cache folder that changes from process to process (a
    temporary one, say), compile options that keep inductor from caching the graph (a bypass),
    and the log not saying that the graph came from the cache."""
    runs = [in_new_process(tmp_path / "cache", "-c", COMPILE_ONCE) for _ in range(2)]
    first, second = (json.loads(run.stdout.splitlines()[-1]) for run in runs)
    first_log, second_log = (run.stderr for run in runs)
    assert first["graphs"] == second["graphs"] == 1  # torch._dynamo still traces the model in each process
    assert first.get("fxgraph_cache_miss") == 1 and not first.get("autograd_cache_hit")
    assert second.get("autograd_cache_hit") == 1 and not second.get("fxgraph_cache_miss")
    folder = tmp_path / "cache" / "cloudseg" / "inductor"
    assert f"(0 graph(s) from inductor's cache in {folder})" in first_log
    assert f"(1 graph(s) from inductor's cache in {folder})" in second_log


@pytest.mark.slow
def test_a_second_segment_call_takes_its_compiled_model_from_inductor_s_cache(tmp_path):
    """`cloudseg segment` twice, each a new process, predict.compile=true, the tiny UNet with
    inductor on the CPU (a minute or more of compiling on two cores). Would catch: anything in
    segment's compiled forward that changes from call to call and so misses the cache (a
    different batch shape, a per-call constant in the graph), and the compile not logged."""
    checkpoint = write_tiny_checkpoint(tmp_path / "best.pt")
    scene = tmp_path / "scene.png"
    cv2.imwrite(str(scene), np.random.default_rng(0).integers(20, 255, (64, 96, 3), dtype=np.uint8))
    logs = [in_new_process(tmp_path / "cache", "-m", "cloudseg", "segment", str(scene), "predict.compile=true",
                           "--checkpoint", str(checkpoint), "--out", str(tmp_path / f"out{index}"), "--device", "cpu",
                           "--postprocess", "none").stderr for index in range(2)]
    assert "1 graph(s) compiled" in logs[0] and "(0 graph(s) from inductor's cache" in logs[0]
    assert "1 graph(s) compiled" in logs[1] and "(1 graph(s) from inductor's cache" in logs[1]
