"""Full-resolution training and inference speed, memory and MFU, side by side; prints a table.

What a user could run instead of cloudseg (the alternatives, ALTERNATIVES):
  a. textbook accumulation loop: fp32, loss / accumulation_steps, no AMP, no channels_last
  a2. the plain loop done well: loss / accumulation_steps, autocast (GradScaler in fp16), model and
     inputs channels_last, cuDNN's benchmark mode, fused AdamW, torch.compile(model), clipping
  b. PyTorch Lightning at its defaults: Trainer(accumulate_grad_batches=4), precision as cloudseg's auto
  c. Lightning set up carefully: bf16-mixed / 16-mixed, benchmark=True, model and inputs channels_last
  c2. c, and the LightningModule under torch.compile before trainer.fit, as Lightning's guide
     "Speed up models by compiling them" says (not fused AdamW: Lightning refuses it with clipping)
cloudseg:
  d. cloudseg's step, eager (train.compile=false)
  e. cloudseg's step, compiled (train.compile=true; what auto gives on CUDA)
  f. cloudseg eager and g. compiled, with train.checkpointing=encoder and full
  h. the compiled step with one candidate of train.speedups each (issue #37; --candidates, on by
     default with CUDA): cudnn_search (in a fresh process: cuDNN keeps a shape's algorithm for the
     life of a process), autotune=reductions, pad_stem, and with --max-autotune autotune=all;
     then e once more in a fresh process, whose spread from e sets the bar, and i. the winners
     combined: every candidate faster than e by more than twice that spread (at least 1%)
  a2, c, c2, d, e: in each precision of --precisions (bf16 and fp16 where both are native); f-i: the first.

The headline ratio (issue #59) is row e against the fastest alternative that ran in the same
precision, named (`against_fastest`); careful Lightning uncompiled stays a row and a ratio.
The rows run most telling first, so that a run cut short loses the least: in each precision c, c2,
a2, d, e, then (first precision) h, e again, i and the compiled step's split; then f, g; the
careless baselines a and b last. Each row prints as it is measured, and --json is rewritten after
each, the ratios with it. Each compiled row gives its first window's time beside its speed (the
compile, autotuning included). Then the targets (against the fastest alternative and careful
Lightning, checkpointing's cost, fp16 against bf16), which batch-norm backend PyTorch picks per
precision, and with --profile the split of one steady window in each precision, compiled after
its precision's rows and eager at the end: device time per image by kernel family (convolutions
forward / data-grad / weight-grad, batch-norm statistics, normalise + ReLU, upsample +
concatenate, casts, layout copies, loss, optimizer; `kernel_family`) and the top kernels (--trace
DIR for Chrome traces). Also data loading per CPU core, and inference with 4-flip TTA (eager, and
compiled as predict.compile compiles it) projected to Kaggle's 3,698 test images. Every table is a
markdown pipe table.

How long on an H100 (estimated from BENCHMARKS.md's windows; not yet measured as a whole): a row
times 4-6 steps of 16 images after 2 warmup windows, about 1.6 s at 60 images/s (4-5 s for row a);
the uncompiled rows a-d took about 150 s (Lightning's start and cuDNN's search for each new shape);
a compiled row adds its compile, about 1.1 min cold for row e and a few seconds from inductor's
cache. Eleven graphs compile (c2, a2, e in two precisions, g twice, two candidates, inference):
one after another some 12 minutes cold, more than a 10-minute window. So with CUDA the compiles
run first, 4 at a time in processes of their own (--warm-compiles), and the timed rows find them
in inductor's cache (e's rerun and cudnn_search's row reuse e's graph). Max-autotune
(--max-autotune, off by default) benchmarks Triton templates for every convolution shape: likely
10 minutes or more, so it has its own flag; --no-candidates leaves rows h and i out.

MFU: images/s × FLOPs per image (cloudseg.flops: forward + backward, counted on meta tensors)
over the GPU's datasheet dense 16-bit peak; n/a on a CPU or a GPU cloudseg.flops does not list.
Same model (UNet-ResNet34) and the same synthetic batches for every row. On CUDA (--device auto
where there is a GPU) the default is the real size (1400x2100, padded 1408x2112, micro-batch 4,
effective batch 16). On the CPU the script runs a small size in fp32 without compiled rows, so
that it stays testable; its figures mean nothing for GPUs. Lightning comes with the dev extra
(`make install`); without it its rows say skipped.

Usage: python benchmarks/train_speed.py [--device auto|cpu|cuda --height H --width W --steps N
       --precisions bf16 fp16 --compiled --candidates --max-autotune --backend inductor
       --warm-compiles N --profile --trace DIR --json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time

import cv2
import torch

from cloudseg import compiled
from cloudseg.config import SpeedupsConfig, load_config
from cloudseg.data import CloudDataset, build_transform
from cloudseg.files import atomic_path
from cloudseg.engine import StepContext, train_step
from cloudseg.flops import peak_flops, step_flops_per_image
from cloudseg.cli import add_device_option
from cloudseg.hardware import (AUTOCAST_DTYPES, autocast_dtype, needs_grad_scaler, resolve_device, resolve_precision,
                               speed_switches)
from cloudseg.loss import per_image_loss
from cloudseg.model import build_model, pad_stem, prepare_for_training
from cloudseg.predict import predict_probs
from cloudseg.synth import synthesize
from cloudseg.units import human_duration

KAGGLE_TEST_IMAGES = 3698
LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
TEXTBOOK = "a. textbook loop (fp32)"
STEP = {False: "eager", True: "compiled"}  # train.compile
# What a user could run instead of cloudseg: the rows whose fastest, in each precision, cloudseg's
# compiled step is measured against (issue #59).
ALTERNATIVES = ("a. ", "a2. ", "b. ", "c. ", "c2. ")
# Issue #37's candidates, each a setting of train.speedups (off by default until a GPU measures it).
CANDIDATES = {"cudnn_search": SpeedupsConfig(cudnn_search=True), "autotune=reductions": SpeedupsConfig(autotune="reductions"),
              "pad_stem": SpeedupsConfig(pad_stem=True), "autotune=all": SpeedupsConfig(autotune="all")}
MIN_GAIN = 0.01  # a winner beats row e by more than twice the measured spread, and by at least this
WARM_LIMIT_S = 360  # the warm compiles, all of them: what is still compiling then is left to its row


def main() -> None:
    args = parse_args()
    device = args.device
    config = load_config("configs/fullres.yaml", ["model.encoder_weights=null", f"model.encoder={args.encoder}",
                                                  f"train.micro_batch={args.micro_batch}",
                                                  f"train.effective_batch={args.effective_batch}"])
    compiled.BACKEND = args.backend
    batches = synthetic_batches(args, device)
    print(header(args, device))
    flops = step_flops_per_image(config.model, (args.height, args.width))
    peak = peak_flops(device_name(device)) if device.type == "cuda" else None
    figures = Figures(args.json, device=device_name(device), torch=torch.__version__,
                      args={**vars(args), "device": str(device)}, flops_per_image=flops, peak_flops=peak, profiles={})
    if args.warm_compiles and args.compiled:
        warm_compiles(config, args)
    rows = training_rows(config, batches, args, device, figures)
    print_table(rows, flops, peak)
    print_targets(rows, args.precisions)
    print_batch_norm_backends(args.precisions, device)
    for p in args.precisions if args.profile else ():
        profile(figures, config, batches, args, device, p, compile=False)
    loader_rate = loading_rate(args)
    figures.put(loader_samples_per_s_per_core=loader_rate)
    print(f"\ndata loading: {loader_rate:.1f} samples/s per CPU core at {args.loader_size[0]}x{args.loader_size[1]}")
    inference_rate = {STEP[compile]: timed(device, lambda compile=compile: inference(config, batches, args, device,
                                                                                    compile))
                      for compile in (False, True) if args.compiled or not compile}
    figures.put(inference=inference_rate)
    for step, rate in inference_rate.items():
        if rate:  # None: skipped, as timed() said
            print(f"inference, 4-flip TTA, {step}: {rate[0]:.2f} images/s, peak {rate[1]:.2f} GiB; "
                  f"{KAGGLE_TEST_IMAGES} test images in {human_duration(KAGGLE_TEST_IMAGES / rate[0])} (model time only)")


class Figures(dict):
    """Everything measured so far, written to --json (when given) after each addition: a run cut
    short by make bench's time limit leaves what it measured, rows and ratios included."""

    def __init__(self, path: str | None, **head):
        super().__init__(head)
        self.path = path

    def put(self, **items) -> None:
        self.update(items)
        if self.path:
            with atomic_path(self.path) as tmp, open(tmp, "w") as file:
                json.dump(self, file, indent=1)


class Rows(dict):
    """The table's rows, each printed the moment it is measured, and kept in `figures` with the
    ratios against the fastest alternatives: a run cut short (make bench's time limit) still
    shows the rows it finished; the table comes at the end."""

    def __init__(self, figures: Figures):
        super().__init__()
        self.figures = figures

    def __setitem__(self, name, result):
        super().__setitem__(name, result)
        if result:
            print(f"  measured {name}: {result[0]:.2f} images/s, peak {result[1]:.2f} GiB", flush=True)
        ratios = {p: against_fastest(self, p) for p in PRECISIONS}
        self.figures.put(rows=dict(self), against_fastest={p: ratio for p, ratio in ratios.items() if ratio})


def training_rows(config, batches, args, device, figures) -> dict:
    """Each row's (images/s, peak GiB, first window s) or None where skipped, most telling first, so
    that a run cut short loses the least: in each precision the alternatives a user would run
    instead (careful Lightning, compiled too, and the plain loop done well), then cloudseg's step,
    eager and compiled, and in the first precision the candidates and the compiled step's split;
    then the checkpointing modes, and last the careless baselines a and b."""
    first = args.precisions[0]
    rows = Rows(figures)
    for p in args.precisions:
        torch.backends.cudnn.benchmark = False  # each alternative switches it as its user would
        rows[f"c. Lightning careful, {p}"] = timed(device, lambda: lightning(config, batches, args, device, p, careful=True))
        name = f"c2. Lightning careful, compiled (its guide), {p}"
        rows[name] = compiled_row(args, name, lambda: lightning(config, batches, args, device, p, careful=True,
                                                                compile=True))
        name = f"a2. PyTorch loop done well, compiled, {p}"
        rows[name] = compiled_row(args, name, lambda: done_well(config, batches, args, device, p))
        speed_switches(device)  # as `cloudseg train` does
        for letter, compile in (("d", False), ("e", True)):
            rows[f"{letter}. cloudseg {STEP[compile]}, {p}"] = cloudseg_row(config, batches, args, device, p, compile)
        if p == first and args.candidates:
            for name, result in candidate_rows(config, batches, args, device, first,
                                               base=rows[f"e. cloudseg compiled, {first}"]).items():
                rows[name] = result
        if args.profile and args.compiled:
            profile(figures, config, batches, args, device, p, compile=True)
    for letter, compile in (("f", False), ("g", True)):
        for mode in ("encoder", "full"):
            rows[f"{letter}. cloudseg {STEP[compile]}, {first}, checkpointing={mode}"] = cloudseg_row(
                config, batches, args, device, first, compile, mode)
    torch.backends.cudnn.benchmark = False  # a and b as their authors leave it
    default = resolve_precision("auto", device)
    rows[TEXTBOOK] = timed(device, lambda: textbook(config, batches, args, device))
    rows[f"b. Lightning at its defaults, {default}"] = timed(device, lambda: lightning(
        config, batches, args, device, default, careful=False))
    speed_switches(device)
    return rows


PRECISIONS = ("bf16", "fp16", "fp32")


def precision_of(row: str) -> str:
    """The precision a row ran in: the last of its words that names one (row a's is in brackets)."""
    return [word for word in row.replace("(", " ").replace(")", " ").replace(",", " ").split() if word in PRECISIONS][-1]


def against_fastest(rows: dict, precision: str) -> dict | None:
    """cloudseg's compiled step (row e) against the fastest alternative (ALTERNATIVES) that ran in
    `precision`: {ratio, cloudseg, fastest, its images/s}; None until both have run."""
    ours = rows.get(f"e. cloudseg compiled, {precision}")
    runs = {name: result[0] for name, result in rows.items()
            if name.startswith(ALTERNATIVES) and result and precision_of(name) == precision}
    if not ours or not runs:
        return None
    fastest = max(runs, key=runs.get)
    return {"ratio": ours[0] / runs[fastest], "cloudseg": ours[0], "fastest": fastest, "fastest_images_per_s": runs[fastest]}


def against_fastest_line(rows: dict, precision: str) -> str:
    """The ratio of issue #59 in words: cloudseg compiled against the fastest alternative, named."""
    result = against_fastest(rows, precision)
    if result is None:
        return f"compiled against the fastest alternative, {precision}: n/a (row e or every alternative not run)"
    return (f"compiled against the fastest alternative, {precision}: {result['ratio']:.2f}x ({result['cloudseg']:.2f} "
            f"images/s against {result['fastest']}, {result['fastest_images_per_s']:.2f})")


def compiled_row(args, name, run):
    """An alternative's compiled row, timed, or None with --no-compiled."""
    if not args.compiled:
        print(f"  skipped {name}: --no-compiled")
        return None
    return timed(args.device, run)


def profile(figures, config, batches, args, device, precision, compile) -> None:
    """The split of one window (op_profile), kept in `figures` under its precision and step."""
    split = op_profile(config, batches, args, device, precision, compile)
    figures.put(profiles={**figures["profiles"], f"{precision}{', compiled' if compile else ''}": split})


def cloudseg_row(config, batches, args, device, precision, compile, checkpointing="none", speedups=None, fresh=False):
    """A row of cloudseg's step; `fresh`, or cuDNN's full search (it keeps each shape's pick for the
    process's life, whatever the limit was), runs it in a new process."""
    if compile and not args.compiled:
        print(f"  skipped cloudseg compiled, {precision}, checkpointing={checkpointing}: --no-compiled")
        return None
    speedups = speedups or SpeedupsConfig()
    if speedups.cudnn_search or fresh:
        return in_fresh_process(config, args, precision, speedups)
    return timed(device, lambda: cloudseg(config, batches, args, device, precision, checkpointing, compile, speedups))


def candidate_rows(config, batches, args, device, precision, *, base) -> dict:
    """Rows h (each candidate of train.speedups on the compiled step), row e once more (its
    spread against `base`, row e's result), and row i (the winners combined; skipped when none won).
    Row e's rerun runs in a new process, as cudnn_search's row must: the spread then covers what
    a process of its own changes too, so the bar holds for that row as well."""
    rows = {f"h. cloudseg compiled, {precision}, {name}": cloudseg_row(config, batches, args, device, precision, True,
                                                                       speedups=speedups)
            for name, speedups in CANDIDATES.items() if args.max_autotune or name != "autotune=all"}
    again = f"e. cloudseg compiled, {precision}, again"
    rows[again] = cloudseg_row(config, batches, args, device, precision, True, fresh=True)
    winners, bar = winning(rows, base, rows[again])
    if bar is not None:
        print(f"  winners: faster than row e by more than {bar:.1%} (twice e's spread against its rerun, at least "
              f"{MIN_GAIN:.0%}): {', '.join(winners) or 'none'}")
    combined = SpeedupsConfig(**{key: value for name in winners
                                 for key, value in CANDIDATES[name].model_dump(exclude_defaults=True).items()})
    name = f"i. cloudseg compiled, {precision}, winners: {' + '.join(winners) or 'none'}"
    rows[name] = cloudseg_row(config, batches, args, device, precision, True, speedups=combined) if winners else None
    return rows


def winning(candidates: dict, base, again) -> tuple[list[str], float | None]:
    """The candidates (by CANDIDATES' name) faster than `base` (row e's result) by more than the bar,
    and the bar: twice the relative spread between row e and `again` (its rerun), at least MIN_GAIN.
    None for the bar where row e or its rerun did not run."""
    if not base or not again:
        return [], None
    bar = max(2 * abs(again[0] - base[0]) / base[0], MIN_GAIN)
    winners = [row.rsplit(", ", 1)[1] for row, result in candidates.items()
               if row.startswith("h. ") and result and result[0] > base[0] * (1 + bar)]
    return winners, bar


def warm_compiles(config, args) -> None:
    """Every compiled row's graphs compiled first, --warm-compiles of them at a time, each in a new
    process of its own, so that the timed rows find them in inductor's on-disk cache (the timed
    rows' first windows then show a cached compile; these lines show the cold ones). A UNet's compile
    is mostly one Python thread's work: side by side, a cold cache costs a window a fraction of the
    minutes it costs one compile after another. A job that fails is said and left to its row."""
    first = args.precisions[0]
    jobs = [*((f"c2, {p}", "lightning", p, {"careful": True, "compile": True}) for p in args.precisions),
            *((f"a2, {p}", "done_well", p, {}) for p in args.precisions),
            *((f"e, {p}", "cloudseg_compiled", p, {}) for p in args.precisions),
            *((f"g, {mode}", "cloudseg_compiled", first, {"checkpointing": mode}) for mode in ("encoder", "full")),
            *((f"h, {name}", "cloudseg_compiled", first, {"speedups": CANDIDATES[name]}) for name in CANDIDATES
              if args.candidates and name != "cudnn_search" and (args.max_autotune or name != "autotune=all")),
            ("inference", "compiled_inference", first, {})]
    start = time.perf_counter()
    print(f"warming {len(jobs)} compiles, {args.warm_compiles} at a time, each in a new process", flush=True)
    with multiprocessing.get_context("spawn").Pool(args.warm_compiles, maxtasksperchild=1) as pool:
        pending = [(name, pool.apply_async(_warm, (kind, config, args, precision, options)))
                   for name, kind, precision, options in jobs]
        for name, result in pending:
            try:  # a worker that dies hard (the host's OOM killer) never reports: its row compiles itself
                seconds, error = result.get(timeout=max(1.0, start + WARM_LIMIT_S - time.perf_counter()))
            except multiprocessing.TimeoutError:
                seconds, error = time.perf_counter() - start, f"no answer within {WARM_LIMIT_S} s"
            print(f"  warmed {name}: {human_duration(seconds)}" + (f", failed: {error}" if error else ""), flush=True)
    print(f"warmed in {human_duration(time.perf_counter() - start)}", flush=True)


def _warm(kind, config, args, precision, options) -> tuple[float, str | None]:
    """One warm job: its row's function on two windows (the compiling one and one more), its output
    silenced; (seconds, the error or None)."""
    sys.stdout = sys.stderr = open(os.devnull, "w")
    compiled.BACKEND = args.backend
    speed_switches(args.device)
    short = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 1})
    batches, start = synthetic_batches(short, args.device), time.perf_counter()
    runs = {"lightning": lambda: lightning(config, batches, short, args.device, precision, **options),
            "done_well": lambda: done_well(config, batches, short, args.device, precision),
            "cloudseg_compiled": lambda: cloudseg(config, batches, short, args.device, precision,
                                                  options.get("checkpointing", "none"), True, options.get("speedups")),
            "compiled_inference": lambda: inference(config, batches, short, args.device, compile=True)}
    try:
        runs[kind]()
    except Exception as error:  # an out-of-memory beside the other jobs, say: the row compiles it itself
        return time.perf_counter() - start, said(error)
    return time.perf_counter() - start, None


def in_fresh_process(config, args, precision, speedups):
    """A compiled row timed in a new process (spawned: CUDA cannot fork), with cuDNN's algorithm
    search as `speedups` says; the same synthetic batches, made again there."""
    sys.stdout.flush()  # what this process printed comes before what the new one prints
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_row_in_this_process, (config, args, precision, speedups))


def _row_in_this_process(config, args, precision, speedups):
    compiled.BACKEND = args.backend
    speed_switches(args.device, cudnn_search=speedups.cudnn_search)
    batches = synthetic_batches(args, args.device)
    try:
        return timed(args.device, lambda: cloudseg(config, batches, args, args.device, precision, "none", True,
                                                   speedups))
    finally:
        sys.stdout.flush()  # the pool ends its process without flushing


def parse_args():
    """The options; where one is not given, its default follows --device: the real size, both native
    16-bit precisions, the compiled rows and the profile on CUDA; a small fp32 run on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(parser, "the benchmark runs")
    parser.add_argument("--height", type=int, help="default: 1400 on CUDA, 128 on the CPU")
    parser.add_argument("--width", type=int, help="default: 2100 on CUDA, 192 on the CPU")
    parser.add_argument("--encoder", default="resnet34")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--effective-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run (default: 6 on CUDA, 2 on the CPU)")
    parser.add_argument("--warmup", type=int,
                        help="untimed optimizer steps first (the compiled rows compile in the first; default 2 / 1)")
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "fp16", "fp32"),
                        help="precisions of rows c, d, e (the first also for f, g; default: bf16 and fp16 where "
                             "bf16 is native, fp16 on older GPUs, fp32 on the CPU)")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction,
                        help="run the compiled rows (default: on CUDA only; on 2 CPU cores a compile takes minutes)")
    parser.add_argument("--candidates", action=argparse.BooleanOptionalAction,
                        help="rows h and i: the compiled step with each candidate of train.speedups, and the winners "
                             "combined (default: on with CUDA and the compiled rows)")
    parser.add_argument("--max-autotune", action="store_true",
                        help="with --candidates, also the row of train.speedups.autotune=all (inductor's "
                             "max-autotune-no-cudagraphs: likely 10 minutes or more of compiling at full size)")
    parser.add_argument("--backend", default=compiled.BACKEND, help="torch.compile backend of the compiled rows")
    parser.add_argument("--warm-compiles", type=int, metavar="N",
                        help="compile every compiled row's graphs first, N processes at a time, into inductor's cache "
                             "(default: 4 on CUDA with the compiled rows, else 0: none)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction,
                        help="the split of one window in each precision, eager and (with --compiled) compiled: time "
                             "per image by kernel family, and the top kernels (torch.profiler; default on CUDA; on a "
                             "CPU each op's CPU time, AdamW's per-tensor ops among 'other')")
    parser.add_argument("--trace", metavar="DIR", help="with --profile, also write each profiled window's Chrome trace "
                                                       "(chrome://tracing, Perfetto) into DIR")
    parser.add_argument("--loader-images", type=int, default=8)
    parser.add_argument("--loader-size", type=int, nargs=2, default=(1400, 2100), metavar=("H", "W"),
                        help="image size of the loading benchmark (a CPU measure: full resolution by default)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    args.device = resolve_device(args.device)
    cuda = args.device.type == "cuda"
    native = resolve_precision("auto", args.device)
    defaults = {"height": 1400 if cuda else 128, "width": 2100 if cuda else 192, "steps": 6 if cuda else 2,
                "warmup": 2 if cuda else 1, "compiled": cuda, "profile": cuda,
                "precisions": ["bf16", "fp16"] if native == "bf16" else [native]}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.candidates is None:
        args.candidates = cuda and args.compiled
    if args.warm_compiles is None:
        args.warm_compiles = 4 if cuda and args.compiled else 0
    return args


def synthetic_batches(args, device) -> list[dict]:
    """Enough random micro-batches for warmup + timed steps, already on the device."""
    g = torch.Generator().manual_seed(0)
    count = (args.warmup + args.steps) * args.effective_batch // args.micro_batch
    shape = (args.micro_batch, 3, args.height, args.width)
    return [{"image": torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device),
             "mask": (torch.rand(args.micro_batch, 4, args.height, args.width, generator=g) < 0.3).to(torch.uint8).to(device)}
            for _ in range(count)]


def timed(device, run):
    """(images/s, peak GiB, first window s or None) of `run`, which returns (images, seconds) of its
    timed part, and a compiled row also the seconds of its first window (compiling included); None,
    said, where it raised."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        images, seconds, *first_window = run()
    except Exception as error:  # one row's failure (Lightning missing, an out-of-memory) leaves the others to run
        print(f"  skipped: {said(error)}", flush=True)
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return images / seconds, peak, first_window[0] if first_window else None


def said(error: Exception) -> str:
    """An error in one line: its class and its message's first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def textbook(config, batches, args, device):
    """The loop of the well-known gradient-accumulation tutorials."""
    model = build_model(config.model, pretrained=False).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    accumulation = args.effective_batch // args.micro_batch

    def window_step(window):
        for batch in window:
            (per_image_loss(model(batch["image"]), batch["mask"]).mean() / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()

    return timed_windows(batches, args, device, window_step)


def done_well(config, batches, args, device, precision):
    """The plain loop with every flag PyTorch's own tutorials offer: `loss / accumulation`, autocast
    (and GradScaler in fp16), model and inputs channels_last, cuDNN's benchmark mode, fused AdamW,
    `torch.compile(model)`, clipping as cloudseg and Lightning clip; compiled in its first window."""
    torch._dynamo.reset()
    torch.backends.cudnn.benchmark = True
    model = build_model(config.model, pretrained=False).to(device).train().to(memory_format=torch.channels_last)
    forward = torch.compile(model, backend=compiled.BACKEND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, fused=True)
    dtype = AUTOCAST_DTYPES[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype))
    accumulation = args.effective_batch // args.micro_batch

    def window_step(window):
        for batch in window:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = per_image_loss(forward(batch["image"].contiguous(memory_format=torch.channels_last)),
                                      batch["mask"]).mean() / accumulation
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return timed_windows(batches, args, device, window_step, f"plain loop, {precision}")


def timed_windows(batches, args, device, window_step, compiling: str | None = None):
    """(images, seconds) of the timed windows after the warmup ones, each window's micro-batches
    given to `window_step`; `compiling` (what compiles, for the log): also its first window's
    seconds, compiling included."""
    accumulation = args.effective_batch // args.micro_batch
    windows = [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]
    start, first_window = time.perf_counter(), None
    for i, window in enumerate(windows):
        if i == 1 and compiling:
            synchronize(device)
            first_window = time.perf_counter() - start
            print(f"  compiled ({args.backend}), {compiling}: first window {human_duration(first_window)}, "
                  "compiling included")
        if i == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        window_step(window)
    synchronize(device)
    return args.steps * args.effective_batch, time.perf_counter() - start, first_window


def step_context(config, device, precision, checkpointing="none", compile=False, speedups=None) -> StepContext:
    """A fresh model and optimizer behind cloudseg's step, switched as `cloudseg train` switches
    them, with `speedups` (train.speedups; cuDNN's search is the process's, speed_switches')."""
    speedups = speedups or SpeedupsConfig()
    model = build_model(config.model, pretrained=False).to(device).train()
    prepare_for_training(model, config.train.channels_last, checkpointing)
    pad_stem(model, speedups.pad_stem)
    dtype = AUTOCAST_DTYPES[precision]
    return StepContext(model, torch.optim.AdamW(model.parameters(), lr=config.train.lr),
                       torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(dtype)), device, dtype,
                       config.train.grad_clip, config.train.dice_weight, compile, autotune=speedups.autotune)


def cloudseg(config, batches, args, device, precision, checkpointing, compile, speedups=None):
    """cloudseg's step; a compiled row compiles in its first warmup window (from a clean
    torch._dynamo), whose seconds it returns too."""
    if compile:
        torch._dynamo.reset()
    ctx = step_context(config, device, precision, checkpointing, compile, speedups)
    what = f"{precision}, checkpointing={checkpointing}, speedups {speedups.model_dump() if speedups else 'none'}"
    return timed_windows(batches, args, device, lambda window: train_step(ctx, window), what if compile else None)


def lightning(config, batches, args, device, precision, careful, compile=False):
    """Lightning's own accumulation; `careful`: a user who also knows cuDNN's benchmark mode and
    channels_last (model and inputs); `compile`: also the LightningModule under torch.compile
    before `trainer.fit`, as Lightning's guide "Speed up models by compiling them" says (Lightning
    then compiles its *_step methods), with its first window's seconds. Not fused AdamW: Lightning's
    mixed precision refuses gradient clipping with a fused optimizer (pytorch_lightning 2.6)."""
    import pytorch_lightning as pl  # the dev extra has it (make install)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(config.model, pretrained=False)
            if careful:
                prepare_for_training(self.model, channels_last=True, checkpointing="none")

        def training_step(self, batch, index):
            images = batch["image"].contiguous(memory_format=torch.channels_last) if careful else batch["image"]
            return per_image_loss(self.model(images), batch["mask"]).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=config.train.lr)  # fused: Lightning refuses it with clipping

    class Clock(pl.Callback):
        begin = start = first_window = None

        def on_train_start(self, trainer, module):
            Clock.begin = time.perf_counter()

        def on_train_batch_start(self, trainer, module, batch, index):
            if index == accumulation and compile:
                synchronize(device)
                Clock.first_window = time.perf_counter() - Clock.begin
                print(f"  compiled ({args.backend}), Lightning, {precision}: first window "
                      f"{human_duration(Clock.first_window)}, compiling included")
            if index == args.warmup * accumulation:
                synchronize(device)
                Clock.start = time.perf_counter()

    accumulation = args.effective_batch // args.micro_batch
    module = Module()
    if compile:
        torch._dynamo.reset()
        module = torch.compile(module, backend=compiled.BACKEND)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision=LIGHTNING_PRECISION[precision], benchmark=True if careful else None,
                         accumulate_grad_batches=accumulation, max_steps=args.warmup + args.steps,
                         gradient_clip_val=config.train.grad_clip, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    synchronize(device)
    return args.steps * args.effective_batch, time.perf_counter() - Clock.start, Clock.first_window


# The split's kernel families (issue #37). Names as the profiler gives them: cuDNN's and CUTLASS's
# convolution kernels (sm90_xmma_fprop_implicit_gemm_..., ..._dgrad_..., ..._wgrad_..., cudnn::...),
# ATen's CUDA kernels (void at::native::batch_norm_collect_statistics_channels_last_kernel<...>),
# inductor's generated ones, named by the aten ops they fuse (triton_{poi,red,per,tem}_fused_<ops>_N
# on a GPU: pointwise, reduction, persistent reduction, template; cpp_fused_<ops>_N on a CPU), and
# on a CPU the aten ops themselves.
CONV_FORWARD, CONV_DATA, CONV_WEIGHT = "convolution forward", "convolution data-grad", "convolution weight-grad"
CONV_BACKWARD = "convolution backward (data and weight grad in one op, CPU)"
STATISTICS, NORMALISE = "batch-norm statistics (and their backward)", "normalise + ReLU (and their backward)"
BATCH_NORM = "batch norm, statistics and normalise in one kernel"
UPSAMPLE, LOSS, OPTIMIZER = "upsample + concatenate", "loss", "optimizer and gradient norm"
CASTS, LAYOUT, COPIES = "casts", "layout copies", "copies, cast or layout (eager copy_)"
OTHER_FUSED, OTHER = "other inductor kernels", "other"


def kernel_family(name: str) -> str:
    """The family of a profiled kernel (or, on a CPU, op) by its name."""
    n = name.lower()
    if any(key in n for key in ("multi_tensor_apply", "foreach", "adam", "optimizer.", "clip_grad")):
        return OPTIMIZER
    if n.startswith(("triton_", "cpp_fused")):
        return _fused_family(n)
    for family, keys in ((CONV_WEIGHT, ("wgrad",)), (CONV_DATA, ("dgrad",)), (CONV_BACKWARD, ("convolution_backward",)),
                         (BATCH_NORM, ("bn_fw", "bn_bw")),  # cuDNN's batch norm (fp16, eager)
                         (LAYOUT, ("nchwtonhwc", "nhwctonchw", "clone", "contiguous")),
                         (CONV_FORWARD, ("fprop", "convolve", "conv2d", "convolution", "implicit_gemm", "cudnn")),
                         (STATISTICS, ("batch_norm_collect_statistics", "batch_norm_backward_reduce", "batch_norm_reduce")),
                         (NORMALISE, ("batch_norm_transform_input", "batch_norm_backward_elemt", "batch_norm_elemt",
                                      "relu", "clamp", "threshold")),
                         (BATCH_NORM, ("batch_norm",)),
                         (UPSAMPLE, ("upsample", "catarray", "aten::cat")),
                         (LOSS, ("binary_cross_entropy", "sigmoid", "softplus")),
                         (CASTS, ("_to_copy",)), (COPIES, ("copy", "memcpy"))):
        if any(key in n for key in keys):
            return family
    return OTHER


def _fused_family(name: str) -> str:
    """An inductor kernel's family by the first of its fused ops that decides one: a reduction
    (red, per) over batch norm is its statistics, a pointwise kernel its normalisation."""
    reduction = name.startswith(("triton_red", "triton_per"))
    for family, keys in ((CONV_FORWARD, ("convolution",)),  # a Triton template, epilogue fused (max-autotune)
                         (LOSS, ("binary_cross_entropy", "sigmoid", "softplus")),
                         (STATISTICS if reduction else NORMALISE, ("batch_norm", "var_mean")),
                         (NORMALISE, ("relu", "threshold")),
                         (UPSAMPLE, ("upsample", "_unsafe_index", "_cat_", "fused_cat")),
                         (CASTS, ("_to_copy", "convert_element_type")), (LAYOUT, ("clone", "copy"))):
        if any(key in name for key in keys):
            return family
    return OTHER_FUSED


def op_profile(config, batches, args, device, precision, compile=False) -> dict:
    """The split of one window of cloudseg's step, eager or compiled, in milliseconds per image (on
    CUDA each kernel's GPU time, on a CPU each op's CPU self time), after the windows that compile
    and let cuDNN pick its algorithms: by kernel family (`kernel_family`), and the top kernels;
    with --trace DIR also a Chrome trace of the window."""
    if compile:
        torch._dynamo.reset()
    ctx = step_context(config, device, precision, compile=compile)
    window = batches[: args.effective_batch // args.micro_batch]
    for _ in range(2 if compile else 1):
        train_step(ctx, window)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        train_step(ctx, window)
        synchronize(device)
    step = STEP[compile]
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(args.trace, f"{precision}-{step}.json"))
    per_image = kernel_times(profiler.key_averages(), device, args.effective_batch)
    split = {}
    for key, ms in per_image.items():
        split[kernel_family(key)] = split.get(kernel_family(key), 0.0) + ms
    split = dict(sorted(split.items(), key=lambda item: -item[1]))
    top = dict(sorted(per_image.items(), key=lambda item: -item[1])[:15])
    total = sum(per_image.values())
    print(f"\n{precision}, {step}, ms per image ({'GPU time of its kernels' if device.type == 'cuda' else 'CPU self time'}),"
          f" {total:.2f} in all\n\n| kernel family | ms per image | share |\n| --- | ---: | ---: |")
    for family, ms in split.items():
        print(f"| {family} | {ms:.3f} | {ms / total:.1%} |")
    print("\n| kernel | family | ms per image |\n| --- | --- | ---: |")
    for key, ms in top.items():
        print(f"| `{key[:90]}` | {kernel_family(key)} | {ms:.3f} |")
    batch_norm = sum(split.get(family, 0.0) for family in (STATISTICS, NORMALISE, BATCH_NORM))
    return {"batch_norm_ms_per_image": batch_norm, "split_ms_per_image": split, "top_ms_per_image": top}


def kernel_times(events, device, images: int) -> dict:
    """Milliseconds per image of each profiled name: on CUDA the GPU kernels' own time (the ops that
    launch them are left out, or each kernel would count twice), on a CPU each op's self time."""
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        times = {e.key: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in kernels}
    else:
        times = {e.key: e.self_cpu_time_total for e in events if not e.key.startswith("ProfilerStep")}
    return {key: us / 1e3 / images for key, us in times.items() if us > 0}


def inference(config, batches, args, device, compile):
    """As cloudseg predict runs the model: in its training memory format, eval mode, compiled
    where predict.compile says so (the first batch compiles, untimed). cuDNN's search stays as the
    training rows left it (on), unlike predict's: it changes the untimed first batch, not the
    timed ones (benchmarks/cudnn_search.py)."""
    model = build_model(config.model, pretrained=False)
    model = prepare_for_training(model, config.train.channels_last, "none").to(device).eval()
    forward = compiled.compiled(model) if compile else model
    dtype = autocast_dtype(config.train.precision, device)
    predict_probs(forward, batches[0]["image"], dtype, tta="d4-lite")
    synchronize(device)
    start, images = time.perf_counter(), 0
    for batch in batches[: max(2, args.steps)]:
        predict_probs(forward, batch["image"], dtype, tta="d4-lite")
        images += len(batch["image"])
    synchronize(device)
    return images, time.perf_counter() - start


def loading_rate(args) -> float:
    """Samples/s of one process with one thread: JPEG decode, 4 RLE decodes, flips, to tensors."""
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as folder:
        synthesize(folder, n_train=args.loader_images, n_test=1, height=args.loader_size[0], width=args.loader_size[1], seed=1)
        dataset = CloudDataset(folder, transform=build_transform(hflip=0.5, vflip=0.5))
        for index in range(len(dataset)):
            dataset[index, index]  # warm the page cache
        rates = []
        for repeat in range(5):
            start = time.perf_counter()
            for index in range(len(dataset)):
                dataset[index, index + repeat]
            rates.append(len(dataset) / (time.perf_counter() - start))
    rates.sort()
    return rates[len(rates) // 2]


def print_table(rows, flops_per_image, peak) -> None:
    base = (rows[TEXTBOOK] or (float("nan"),))[0]
    print("\n| run | images/s | peak GiB | MFU | vs (a) | first window s |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, result in rows.items():
        if result is None:
            print(f"| {name} | skipped | | | | |")
            continue
        mfu = f"{result[0] * flops_per_image / peak:.1%}" if peak else "n/a"
        first_window = f"{result[2]:.1f}" if result[2] is not None else ""
        print(f"| {name} | {result[0]:.2f} | {result[1]:.2f} | {mfu} | {result[0] / base:.2f}x | {first_window} |")
    print(f"\nMFU: {flops_per_image / 1e12:.3f} TFLOP per image (forward + backward), "
          + (f"datasheet dense 16-bit peak {peak / 1e12:.1f} TFLOP/s" if peak else "no datasheet peak for this device"))


def print_targets(rows, precisions) -> None:
    """The issue's targets, from the rows that ran (n/a where one was skipped)."""
    def rate(name):
        return rows[name][0] if rows.get(name) else None

    def ratio(numerator, denominator, form="{:.2f}x"):
        top, bottom = rate(numerator), rate(denominator)
        return form.format(top / bottom) if top and bottom else "n/a"

    print("\ntargets")
    for p in precisions:
        print(f"  {against_fastest_line(rows, p)} (issue #59: >= 1.3x, moonshot 1.5x; >= 90 images/s in bf16 on an H100)")
        print(f"  compiled against careful Lightning uncompiled, {p}: "
              f"{ratio(f'e. cloudseg compiled, {p}', f'c. Lightning careful, {p}')}")
    combined = next((name for name in rows if name.startswith("i. ") and rows[name]), None)
    fastest = against_fastest(rows, precisions[0])
    if combined and fastest:
        print(f"  {combined[3:]} against the fastest alternative: {ratio(combined, fastest['fastest'])}")
    for letter, step in (("f", "eager"), ("g", "compiled")):
        base = f"{'d' if step == 'eager' else 'e'}. cloudseg {step}, {precisions[0]}"
        for mode in ("encoder", "full"):
            cost = ratio(base, f"{letter}. cloudseg {step}, {precisions[0]}, checkpointing={mode}", "{:.2f}x")
            print(f"  checkpointing={mode}, {step}: time per image {cost} of none (target <= 1.25x; issue #37: full, compiled <= 1.2x)")
    if {"bf16", "fp16"} <= set(precisions):
        for letter, step in (("d", "eager"), ("e", "compiled")):
            print(f"  fp16 against bf16, {step}: {ratio(f'{letter}. cloudseg {step}, fp16', f'{letter}. cloudseg {step}, bf16')}")


def print_batch_norm_backends(precisions, device) -> None:
    """Which batch-norm implementation PyTorch picks for a channels_last activation of each
    precision (its own rule, aten's _select_batch_norm_backend): cuDNN refuses bf16 there."""
    select = getattr(torch._C, "_select_batch_norm_backend", None)
    if select is None:
        print("\nbatch-norm backend: this PyTorch does not say")
        return
    weight = torch.ones(64, device=device)
    picks = []
    for p in precisions:
        x = torch.zeros(4, 64, 32, 32, device=device, dtype=AUTOCAST_DTYPES[p] or torch.float32)
        backend = select(x.contiguous(memory_format=torch.channels_last), weight, torch.zeros_like(weight),
                         torch.zeros_like(weight), torch.ones_like(weight), True, 1e-5)
        picks.append(f"{p} {backend.name}")
    print(f"\nbatch-norm backend in training: {', '.join(picks)}")


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def header(args, device) -> str:
    return (f"{device_name(device)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: UNet-{args.encoder} "
            f"at {args.height}x{args.width}, micro-batch {args.micro_batch}, effective batch {args.effective_batch}, "
            f"{args.steps} timed steps after {args.warmup} warmup")


if __name__ == "__main__":
    main()
