"""The benchmark scripts stay runnable at a tiny size (their figures are not checked), each on the
CPU, named: the rows and defaults that the tests expect are the CPU's (on a GPU the training
benchmark prints bf16 and fp16 rows instead of fp32 ones)."""

import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import import_time, train_speed
from benchmarks.train_speed import kernel_family, winning
from cloudseg.config import load_config


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


TRAIN_SPEED = ["benchmarks/train_speed.py", "--device", "cpu", "--height", "64", "--width", "96", "--encoder", "resnet18",
               "--micro-batch", "2", "--effective-batch", "4", "--steps", "1", "--warmup", "1",
               "--loader-size", "64", "96", "--loader-images", "2"]
ROWS = ("c. Lightning careful, fp32", "c2. Lightning careful, compiled (its guide), fp32",
        "a2. PyTorch loop done well, compiled, fp32", "d. cloudseg eager, fp32", "e. cloudseg compiled, fp32",
        "f. cloudseg eager, fp32, checkpointing=encoder", "f. cloudseg eager, fp32, checkpointing=full",
        "g. cloudseg compiled, fp32, checkpointing=encoder", "g. cloudseg compiled, fp32, checkpointing=full",
        "a. textbook loop", "b. Lightning at its defaults")  # in the order they run: most telling first
COMPILED_ROWS = tuple(row for row in ROWS if "compiled" in row)
CANDIDATE_ROWS = ("h. cloudseg compiled, fp32, cudnn_search", "h. cloudseg compiled, fp32, autotune=reductions",
                  "h. cloudseg compiled, fp32, pad_stem", "e. cloudseg compiled, fp32, again")


def test_training_benchmark_prints_its_table(tmp_path):
    """Would catch: a row lost or renamed, the rows out of their order (the careless baselines a and
    b before cloudseg's rows, where a window's cut would keep them and lose training's essentials),
    a Lightning row skipped though Lightning is installed (the dev extra), a compiled row run with
    --no-compiled, the JSON not written or missing a figure."""
    out = run(*TRAIN_SPEED, "--no-compiled", "--candidates", "--profile", "--json", str(tmp_path / "b.json"))
    table = [line for line in out.splitlines() if line.startswith("| ") and "images/s" not in line]
    positions = [next(i for i, line in enumerate(table) if line.startswith(f"| {row}")) for row in ROWS]
    assert positions == sorted(positions), table
    for row in CANDIDATE_ROWS:
        assert f"| {row}" in out
    for row in COMPILED_ROWS:
        assert f"| {row} | skipped |" in out  # --no-compiled
    assert "| c. Lightning careful, fp32 | skipped" not in out and "| b. Lightning at its defaults, fp32 | skipped" not in out
    assert "| h. cloudseg compiled, fp32, pad_stem | skipped |" in out and "autotune=all" not in out
    assert "| i. cloudseg compiled, fp32, winners: none | skipped |" in out
    assert "data loading:" in out and "4-flip TTA, eager" in out and "3698 test images" in out
    assert "4-flip TTA, compiled" not in out  # --no-compiled
    assert "MFU:" in out and "targets" in out and "checkpointing=full, eager: time per image" in out
    assert "compiled against the fastest alternative, fp32: n/a" in out  # row e did not run
    assert "batch-norm backend in training: fp32 " in out and "fp32, eager, ms per image (CPU self time)" in out
    assert "| kernel family | ms per image | share |" in out and "| convolution forward |" in out
    assert "| optimizer and gradient norm |" in out and "fp32, compiled, ms per image" not in out
    figures = json.loads((tmp_path / "b.json").read_text())
    assert figures["rows"]["a. textbook loop (fp32)"][0] > 0 and figures["loader_samples_per_s_per_core"] > 0
    assert figures["rows"]["c. Lightning careful, fp32"][0] > 0 and figures["against_fastest"] == {}
    assert figures["flops_per_image"] > 0 and figures["profiles"]["fp32"]["batch_norm_ms_per_image"] > 0


def test_the_ratio_is_against_the_fastest_alternative_of_the_same_precision():
    """Would catch: the ratio against careful Lightning alone (the old headline) when a compiled
    alternative is faster, an alternative of another precision (or one of cloudseg's own rows, or
    a skipped row) taken as the fastest, and a ratio claimed before row e has run."""
    rows = {"a. textbook loop (fp32)": (20.0, 20.4, None), "a2. PyTorch loop done well, compiled, bf16": (61.0, 11.0, 70.0),
            "b. Lightning at its defaults, bf16": (18.0, 12.2, None), "c. Lightning careful, bf16": (40.0, 13.0, None),
            "c2. Lightning careful, compiled (its guide), bf16": (64.0, 12.0, 80.0),
            "c2. Lightning careful, compiled (its guide), fp16": (90.0, 12.0, 80.0),
            "a2. PyTorch loop done well, compiled, fp16": None, "d. cloudseg eager, bf16": (48.0, 11.6, None),
            "h. cloudseg compiled, bf16, pad_stem": (99.0, 10.0, 60.0)}
    assert train_speed.against_fastest(rows, "bf16") is None  # no row e yet
    rows["e. cloudseg compiled, bf16"] = (80.0, 10.8, 66.0)
    assert train_speed.against_fastest(rows, "bf16") == {
        "ratio": 1.25, "cloudseg": 80.0, "fastest": "c2. Lightning careful, compiled (its guide), bf16",
        "fastest_images_per_s": 64.0}
    assert train_speed.against_fastest(rows, "fp32") is None  # row a ran, but cloudseg did not in fp32
    assert "1.25x (80.00 images/s against c2. Lightning careful, compiled (its guide), bf16, 64.00)" in \
        train_speed.against_fastest_line(rows, "bf16")
    assert [train_speed.precision_of(row) for row in rows][:3] == ["fp32", "bf16", "bf16"]


def test_the_compiled_alternatives_compile_what_their_users_compile(monkeypatch):
    """Rows c2 and a2 in this process at a toy size, in bf16 as on a GPU (Lightning's bf16-mixed
    plugin on the CPU too), with the tests' aot_eager backend. Would catch: Lightning's row not
    compiling at all (a compiled LightningModule that trainer.fit unwraps and runs eagerly would
    compile no graph), an optimizer Lightning's mixed precision refuses (fused AdamW with clipping:
    it raised on every GPU), the plain loop not compiled, or either without its first window's seconds."""
    from cloudseg import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setattr(sys, "argv", ["train_speed.py", *TRAIN_SPEED[1:], "--compiled", "--backend", "aot_eager"])
    args = train_speed.parse_args()
    config = load_config("configs/fullres.yaml", ["model.encoder_weights=null", "model.encoder=resnet18"])
    batches = train_speed.synthetic_batches(args, args.device)
    for row in (lambda: train_speed.lightning(config, batches, args, args.device, "bf16", careful=True, compile=True),
                lambda: train_speed.done_well(config, batches, args, args.device, "bf16")):
        graphs = compiled.graph_counts()[0]
        images, seconds, first_window = row()
        assert compiled.graph_counts()[0] > graphs and images == 4 and seconds > 0 and first_window > 0


@pytest.mark.slow  # compiles of a resnet18 UNet (warmed two at a time, some in new processes), even with aot_eager: minutes on 2 cores
def test_training_benchmark_runs_its_compiled_rows(tmp_path):
    """Would catch: a compiled row skipped (a candidate's among them: cudnn_search's runs in a new
    process), a compiled row without its first window's time, a warm compile that fails or is left
    out, the winners not decided, the ratio against the fastest alternative missing, the compiled
    step not profiled (issue #32's profile), or its trace not written."""
    out = run(*TRAIN_SPEED, "--compiled", "--candidates", "--backend", "aot_eager", "--profile", "--trace", str(tmp_path),
              "--warm-compiles", "2", "--json", str(tmp_path / "c.json"), timeout=1200)  # 5-9 min on 2 shared cores
    for row in COMPILED_ROWS + CANDIDATE_ROWS:
        assert f"| {row} | skipped" not in out and f"| {row} |" in out
    assert all(line.split("|")[6].strip() for line in out.splitlines() if line.startswith(("| g.", "| h.", "| c2.", "| a2.")))
    warmed = [line for line in out.splitlines() if line.startswith("  warmed ")]
    assert len(warmed) == 8 and not any("failed" in line for line in warmed) and "warmed in " in out, warmed
    assert "compiled (aot_eager), fp32, checkpointing=full" in out and "winners: faster than row e by more than" in out
    assert "| i. cloudseg compiled, fp32, winners: " in out and "compiled against the fastest alternative, fp32: " in out
    assert "4-flip TTA, compiled:" in out and "fp32, compiled, ms per image (CPU self time)" in out
    assert json.loads((tmp_path / "c.json").read_text())["against_fastest"]["fp32"]["ratio"] > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["c.json", "fp32-compiled.json", "fp32-eager.json"]


def test_the_split_groups_kernels_into_families_by_name():
    """Names as profilers print them: inductor's generated kernels (named by the aten ops they fuse,
    as in its output code), cuDNN's and CUTLASS's convolutions, ATen's CUDA kernels, and the CPU's
    ops. Would catch: a batch-norm reduction counted as pointwise (or back), a weight gradient as a
    forward, a cast as a layout copy, the optimizer's kernels or an upsample lost in "other"."""
    cases = {
        "triton_per_fused__native_batch_norm_legit_functional_relu_3": train_speed.STATISTICS,
        "triton_red_fused_native_batch_norm_backward_threshold_backward_23": train_speed.STATISTICS,
        "triton_poi_fused__native_batch_norm_legit_functional_relu_4": train_speed.NORMALISE,
        "triton_poi_fused_add_threshold_backward_12": train_speed.NORMALISE,
        "triton_poi_fused__unsafe_index_cat_5": train_speed.UPSAMPLE,
        "triton_poi_fused__to_copy_2": train_speed.CASTS,
        "triton_poi_fused_clone_7": train_speed.LAYOUT,
        "triton_red_fused_binary_cross_entropy_with_logits_sigmoid_sum_9": train_speed.LOSS,
        "triton_tem_fused_convolution_relu_0": train_speed.CONV_FORWARD,
        "triton_poi_fused_add_mul_8": train_speed.OTHER_FUSED,
        # inductor on this CPU (torch 2.15): smp's upsample + cat as one kernel, and CloudNet's input path
        "cpp_fused__to_copy__unsafe_index_add_arange_cat_clone_mul_unsqueeze_0": train_speed.UPSAMPLE,
        "cpp_fused__to_copy_clone_constant_pad_nd_div_sub_0": train_speed.CASTS,
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cudnn": train_speed.CONV_FORWARD,
        "sm80_xmma_dgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64": train_speed.CONV_DATA,
        "sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize32x256x32": train_speed.CONV_WEIGHT,
        "void cudnn::cnn::wgrad2d_grouped_direct_kernel<float, float, float>": train_speed.CONV_WEIGHT,
        "cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_128x128_32x5_nhwc_align8>":
            train_speed.CONV_FORWARD,
        "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float>": train_speed.LAYOUT,
        "void at::native::(anonymous namespace)::upsample_nearest2d_nhwc_out_frame<c10::BFloat16>": train_speed.UPSAMPLE,
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<c10::BFloat16, unsigned int, 4>":
            train_speed.UPSAMPLE,
        "void at::native::batch_norm_collect_statistics_channels_last_kernel<c10::BFloat16, float>": train_speed.STATISTICS,
        "void at::native::batch_norm_transform_input_channels_last_kernel<c10::BFloat16, float>": train_speed.NORMALISE,
        "void cudnn::bn_fw_tr_1C11_kernel_NCHW<__half, float, 512, true, 1>": train_speed.BATCH_NORM,
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": train_speed.OPTIMIZER,
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>": train_speed.COPIES,
        "aten::convolution_backward": train_speed.CONV_BACKWARD, "aten::mkldnn_convolution": train_speed.CONV_FORWARD,
        "aten::native_batch_norm": train_speed.BATCH_NORM, "aten::_foreach_add_": train_speed.OPTIMIZER,
        "aten::cat": train_speed.UPSAMPLE, "aten::_to_copy": train_speed.CASTS, "aten::add_": train_speed.OTHER,
    }
    assert {name: kernel_family(name) for name in cases} == cases


def test_winners_beat_row_e_by_more_than_twice_its_spread():
    """Would catch: a winner within the noise of row e (its rerun 4% off: the bar is 8%), the bar
    below MIN_GAIN when e and its rerun agree, a skipped candidate counted, and winners declared
    where row e did not run."""
    rows = {"h. cloudseg compiled, bf16, pad_stem": (70.0, 9.0, 30.0), "h. cloudseg compiled, bf16, cudnn_search": (64.0, 9.0, 30.0),
            "h. cloudseg compiled, bf16, autotune=reductions": None}
    assert winning(rows, (60.0, 9.0, 30.0), (62.4, 9.0, 5.0)) == (["pad_stem"], pytest.approx(0.08))
    assert winning(rows, (60.0, 9.0, 30.0), (60.0, 9.0, 5.0)) == (["pad_stem", "cudnn_search"], train_speed.MIN_GAIN)
    assert winning(rows, None, (60.0, 9.0, 5.0)) == ([], None)


def test_rle_benchmark_prints_its_table():
    out = run("benchmarks/rle_speed.py", "--repeat", "2")
    assert "decode ms" in out and "4 boxes" in out


def test_tuning_benchmark_prints_its_table():
    out = run("benchmarks/tune_speed.py", "--images", "4")
    assert "total" in out and "Sugar" in out


@pytest.mark.slow  # four trainings and predictions: run with make test-all
def test_recipes_benchmark_prints_one_row_per_option(tmp_path):
    """Catches an option that is not trained or not scored (a missing row or a Dice outside [0, 1]).
    On the CPU, as the demo it benchmarks (eight cloudseg processes: on a GPU machine each would
    start CUDA on a GPU that every test worker shares)."""
    out = run("benchmarks/recipes.py", "--epochs", "1", "--n-train", "12", "--n-test", "4", "--size", "64", "96",
              "--device", "cpu", "--out", str(tmp_path / "r"))
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-4:]}
    assert {load_config(tmp_path / "r" / option / "config.yaml").train.device for option in rows} == {"cpu"}
    assert set(rows) == {"unet", "ema", "fpn", "unetplusplus"}
    assert all(0 <= float(row[3]) <= 1 and 0 <= float(row[4]) <= 1 for row in rows.values())


SEGMENT_SPEED = ["benchmarks/segment_speed.py", "--scenes", "1", "--height", "128", "--width", "192", "--tile", "64", "96",
                 "--repeat", "1", "--device", "cpu"]


def test_segment_benchmark_prints_its_table():
    """Would catch: a row missing, the pipeline without a model among them, a segment row without
    its stage line (or the naive loop given one it cannot have), the writes-alone table missing a
    codec or timing files at once that are not there (writes_alone itself checks each file read
    back against row c's map), a writing thread's CPU seconds not its own (the process's clock
    counts GDAL's compression threads too, and so runs ahead of the wall clock where they work),
    row i (GDAL's writer, as before geo.CompressedStrips) not timed in turn with row c again,
    row c with other --outputs missing, or --switch-interval not set (the header reads Python's)."""
    out = run(*SEGMENT_SPEED, "--scenes", "2", "--no-fixed-cost", "--rows", "abcdefi",  # two scenes: two files at once
              "--outputs", "probs,masks", "classbits", "--switch-interval", "0.002")
    assert "; switch interval 2 ms" in out
    for row in ("a. naive loop (batch 1, no overlap)", "b. cloudseg segment, overlap 0.0 (batch 4)",
                "c. cloudseg segment, overlap 0.25 (batch 4)", "d. naive loop, no model (batch 1, no overlap)",
                "e. cloudseg segment, no model, overlap 0.0 (batch 4)", "f. cloudseg segment, no model, overlap 0.25 (batch 4)",
                "c. cloudseg segment, overlap 0.25 (batch 4), again",
                "i. cloudseg segment, overlap 0.25 (batch 4), GDAL's writer",
                "c. cloudseg segment, overlap 0.25 (batch 4), --outputs classbits"):
        assert f"| {row} |" in out
    assert "scenes/s | megapixels/s" in out and "fixed cost" not in out
    stages = [line for line in out.splitlines() if "| stages: read " in line]
    assert [line.split()[1] for line in stages] == ["b.", "c.", "e.", "f.", "c.", "i.", "c.", "g."]
    # row i and row c again in turn, two runs each (the fastest shown): four runs, then classbits' and g's
    assert re.findall(r"run (\d) of (c\. again|i\. GDAL)", out) == [
        ("1", "c. again"), ("1", "i. GDAL"), ("2", "c. again"), ("2", "i. GDAL")]
    assert "| g. cloudseg segment, overlap 0.25 (batch 4), 2 files at once |" in out
    assert all(" — bound by: " in line and "; from the first read: read 0.00 to " in line for line in stages)
    writes = [line.split(" | ") for line in out.splitlines() if line.startswith(("| deflate", "| zstd"))]
    assert [row[:2] for row in writes] == [[f"| {codec}", at_once] for codec in (
        "deflate", "deflate, strips of 16 rows", "zstd", "zstd, GDAL's writer", "zstd, strips of 16 rows",
        "zstd, strips of 256 rows") for at_once in ("1", "2")]
    # the busiest writing thread's own CPU: within the process's, and within the seconds, as one
    # thread's must be (all three printed to 0.01 s)
    assert "| writing thread's CPU s |" in out
    assert all(float(row[4]) <= min(float(row[2]), float(row[3])) + 0.01 for row in writes), writes


@pytest.mark.parametrize("interval", ["0", "-0.001"])
def test_segment_benchmark_refuses_a_switch_interval_python_would_refuse(interval):
    """Would catch: a switch interval of 0 or below passed on to sys.setswitchinterval, which raises
    a ValueError of its own (a traceback, where the option's error names the option)."""
    done = subprocess.run([sys.executable, *SEGMENT_SPEED, "--switch-interval", interval], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and f"argument --switch-interval: must be above 0 seconds, got {interval}" in done.stderr


def test_segment_benchmark_times_the_command_in_one_process_and_in_several(tmp_path):
    """Row j (--processes 2): `cloudseg segment` under torchrun, one process then two, on the CPU.
    Would catch: a row missing or the two counts swapped, a run that failed (left out silently, or
    a torchrun that maps nothing where the processes share a device), or a stage line missing."""
    out = run(*SEGMENT_SPEED, "--scenes", "2", "--rows", "c", "--processes", "2", "--no-writes", "--no-fixed-cost",
              "--files-at-once", "1")
    assert "failed" not in out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| j. cloudseg segment command")]
    assert rows == [f"| j. cloudseg segment command, overlap 0.25 (batch 4), {n}" for n in ("1 process", "2 processes")]
    stages = [line for line in out.splitlines() if line.startswith("| j. ") and " — bound by: " in line]
    assert [line.split(" | ")[0] for line in stages] == ["| j. 1 process", "| j. 2 processes"]


def test_two_versions_are_timed_in_turn_each_with_its_own_code(tmp_path):
    """benchmarks/in_turn.sh with a copy of this tree as BASE, marked so that its cloudseg says it
    was imported, twice each, on the CPU, called from another folder with a PYTHONPATH of its own;
    then once with BASE's benchmark failing. Would catch: the base's benchmark importing this tree's
    cloudseg (PYTHONPATH, or the script's folder, not the version's own), the caller's PYTHONPATH
    dropped (a lent machine's wheels), runs not in turn (base, this, base, this), a run's row lost
    from the table, a failed run left out of it with exit status 0, and a BASE without cloudseg/ taken."""
    base = tmp_path / "base"
    for folder in ("cloudseg", "benchmarks", "configs"):
        shutil.copytree(folder, base / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with open(base / "cloudseg" / "__init__.py", "a") as init:
        init.write("\nimport marker  # noqa: F401 -- from the caller's PYTHONPATH\n"
                   "print('BASE cloudseg imported from', __file__, flush=True)\n")
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "marker.py").write_text("")
    script = Path("benchmarks/in_turn.sh").resolve()

    def in_turn(runs, *options):
        return subprocess.run(["bash", str(script), str(base), str(runs), *options], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path / "out"),
                                                              "PY": sys.executable, "PYTHONPATH": str(tmp_path / "path")})

    done = in_turn(2, *SEGMENT_SPEED[1:], "--rows", "f", "--no-writes", "--no-fixed-cost", "--files-at-once", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if re.match(r"\| \d \|", line)]
    assert [(row[0], row[1], row[2][:2]) for row in rows] == [("| 1", "base", "f."), ("| 1", "this", "f."),
                                                              ("| 2", "base", "f."), ("| 2", "this", "f.")]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 and row[5].strip(" |") for row in rows), rows
    for run in (1, 2):
        assert f"BASE cloudseg imported from {base}/cloudseg/__init__.py" in (tmp_path / "out" / f"{run}-base.log").read_text()
        assert "BASE cloudseg" not in (tmp_path / "out" / f"{run}-this.log").read_text()
    (base / "benchmarks" / "segment_speed.py").write_text("raise SystemExit(3)\n")
    failed = in_turn(1, *SEGMENT_SPEED[1:], "--rows", "e", "--no-writes", "--no-fixed-cost", "--files-at-once", "1")
    assert failed.returncode == 1 and "| 1 | base | failed (exit 3;" in failed.stdout and "| 1 | this | e." in failed.stdout
    refused = subprocess.run(["bash", str(script), str(tmp_path), "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "BASE: a folder with cloudseg/" in refused.stderr


@pytest.mark.slow  # four new processes that import cloudseg: about 95 s on 2 cores
def test_segment_benchmark_reports_a_call_s_fixed_cost():
    """Would catch: a fixed-cost figure missing, or the split of the second call lost because
    segment's log lines (its loading time, its stage line's seconds) changed their wording."""
    out = run(*SEGMENT_SPEED)
    assert "fixed cost of a call" in out and "a second call" in out and "of which imports" in out
    assert "failed, a new process" not in out
    assert re.search(r"the interpreter's exit after those imports: -?[\d.]+ s", out)
    split = re.search(r"the second call: ([\d.]+) s = imports ([\d.]+) \+ loading ([\d.]+) \+ mapping ([\d.]+) "
                      r"\+ the rest (-?[\d.]+)", out)  # read from the call's own log
    assert split, "the call's log no longer says how long loading and mapping took"


def test_cudnn_search_benchmark_prints_both_switches_in_turn():
    """CPU (the switch does nothing there; the table is what is checked). Would catch: a row lost
    or out of turn, figures not parsed from the measuring process (a first batch as cheap as zero,
    a steady batch missing)."""
    out = run("benchmarks/cudnn_search.py", "--config", "configs/demo.yaml", "--tile", "64", "96", "--repeat", "1",
              "--device", "cpu")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| off |", "| on |"))]
    assert [row[0] for row in rows] == ["| off", "| on"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0 and float(row[4].strip(" |")) > 0
               for row in rows)


def test_bytecode_state_counts_the_modules_compiled_for_this_python(tmp_path, monkeypatch):
    """CPU. Would catch: counting sources instead of their bytecode, or looking for it where this
    Python does not (beside the source rather than in __pycache__ under its cache tag)."""
    package = tmp_path / "probe_of_bytecode"
    package.mkdir()
    for name in ("__init__.py", "compiled.py", "also_compiled.py", "not_compiled.py"):
        (package / name).write_text("x = 1\n")
    for name in ("compiled.py", "also_compiled.py"):
        py_compile.compile(str(package / name), doraise=True)  # where an import would look for it
    (package / "not_compiled.pyc").write_bytes(b"")  # beside its source: the legacy place, not read here
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "probe_of_bytecode 2 of 4" in import_time.bytecode_state(("probe_of_bytecode",))


@pytest.mark.slow  # four new processes that import cloudseg's commands
def test_import_benchmark_prints_its_table():
    """Would catch: a row missing, a heavy module not reported (segment's --help loads no torch)."""
    out = run("benchmarks/import_time.py", "--repeat", "1")
    for row in ("cloudseg segment --help", "import cloudseg.segment", "import cloudseg.predict", "import cloudseg.train"):
        assert f"| {row} |" in out
    assert "| cloudseg segment --help | " in out and "| none |" in out and "tensorboard" in out
    assert re.search(r"^- import cloudseg.segment: .*[:,] torch \d+\.\d\d", out, re.M)  # where its seconds go
    assert re.search(r"^modules with bytecode: torch \d+ of \d+", out, re.M)
