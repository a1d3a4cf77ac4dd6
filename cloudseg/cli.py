"""The `cloudseg` command line: one subcommand per stretch of the data path (check, train,
oof, tune, predict, evaluate), mapping scenes (segment) and the tools around them (download, synth,
folds, swa, memory, show, config, doctor, convert-checkpoint)."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from cloudseg.files import cache_folder, published_name
from cloudseg.task import IMAGE_SHAPE, LABELS, TRAIN_CSV

# What the machine refuses (a path of the wrong kind, a read-only folder, a full disk: OSError) is
# the user's to mend too: one line naming it.
USER_ERRORS = (ValueError, OSError, KeyError, RuntimeError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    keep_compiled_graphs()
    huge_pages_for_tensors()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    exit_on_sigterm()
    try:
        return args.run(args) or 0
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"cloudseg: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (in training, a second one): what the command had written is whole or gone
        if args.debug:
            raise
        print("cloudseg: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `cloudseg` console script and `python -m cloudseg`: the command, then `exit_now`."""
    exit_now(main())


def exit_now(code: int) -> None:
    """End the process with `code` once its command is done, skipping the interpreter's own end,
    which frees torch's, sympy's and the other modules' objects one by one (1.1 s of the demo's
    7.6 s one-image `cloudseg segment` call on 2 cores, and 116 MB at its peak; BENCHMARKS.md).
    What an exit must do still runs: the exit handlers (logging's flush, the data loaders'
    workers, temporary folders, the others' own), then the flush of the standard streams and of
    the C library's. Objects left alive at any exit may never be finalized (Python's own rule), so
    nothing cloudseg writes waits for that: its files are closed, renamed into place, by then.
    The interpreter ends as usual, and so waits or reports, where a thread other than the main one
    is still running and not a daemon, where a profiler or tracer watches (cProfile, a debugger,
    coverage), and with CLOUDSEG_FAST_EXIT=0 (for tools that collect at the C library's exit, as
    CUDA's profilers may)."""
    if (os.environ.get("CLOUDSEG_FAST_EXIT") == "0" or sys.getprofile() or sys.gettrace()
            or any(thread is not threading.main_thread() and not thread.daemon for thread in threading.enumerate())):
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter's end would run first; os._exit runs none
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except (OSError, ValueError):  # a reader gone (`| head`): Python's own exit says 120
            code = code or 120
    if os.name == "posix":
        ctypes.CDLL(None).fflush(None)  # what extensions printed through C's stdio
    os._exit(code)


def keep_compiled_graphs() -> None:
    """A compile's graphs and kernels go to inductor's cache in a per-user folder that outlives a
    reboot and a job's private /tmp (torch's default is /tmp/torchinductor_USER), so that the next
    call takes them from there instead of compiling again (docs/segment.md). Set before anything
    imports torch._dynamo, which fixes the folder; the user's own TORCHINDUCTOR_CACHE_DIR wins."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    try:
        folder = cache_folder() / "inductor"
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home folder, or a read-only one: torch's default stays
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def huge_pages_for_tensors() -> None:
    """PyTorch's CPU allocator asks the kernel for transparent huge pages for each tensor of 2 MB
    or more (THP_MEM_ALLOC_ENABLE, which PyTorch leaves off for the memory it may add): a
    full-resolution batch's tensors are tens to hundreds of MB, and each new one otherwise faults
    in and zeroes 4 KB pages one at a time. `cloudseg segment` without a GPU on 2 cores: 2.5 → 1.7-2.0
    s for two 4200×8400 scenes, a quarter less CPU (BENCHMARKS.md); on a GPU the large host tensors
    are pinned memory, which this leaves alone. PyTorch reads it once, at its first allocation, so
    it is set before anything imports torch; the user's own setting wins (0: off)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def exit_on_sigterm() -> None:
    """SIGTERM exits through Python's unwinding, so a file being written is removed, not left
    as a temporary (training replaces this with a graceful stop)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def one_line(error: Exception) -> str:
    """The message of a user error, without a traceback; an OSError's file named as the user knows
    it (the file a hidden temporary was for, not the temporary)."""
    if isinstance(error, OSError) and isinstance(error.filename, (str, os.PathLike)) and error.strerror:  # not an fd
        return f"{published_name(Path(error.filename))}: {error.strerror}"
    text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
    if "Original Traceback" in text:  # re-raised from a DataLoader worker, its traceback in the message
        text = text.strip().splitlines()[-1].partition(": ")[2]
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloudseg", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)

    download = commands.add_parser("download", help="download and unpack the Kaggle data (needs the kaggle extra: "
                                   "make data installs it, and API credentials)")
    download.add_argument("--out", default="data/kaggle", help="folder to write")
    download.set_defaults(run=run_download)

    synth = commands.add_parser("synth", help="write a synthetic dataset in the Kaggle layout")
    synth.add_argument("--out", required=True, help="folder to write")
    synth.add_argument("--n-train", type=positive_int, default=64)
    synth.add_argument("--n-test", type=positive_int, default=16)
    synth.add_argument("--height", type=int, default=IMAGE_SHAPE[0])
    synth.add_argument("--width", type=int, default=IMAGE_SHAPE[1])
    synth.add_argument("--seed", type=int_at_least(0), default=0)
    synth.set_defaults(run=run_synth)

    evaluate = commands.add_parser("evaluate", help="score a Kaggle-format submission against a truth file")
    evaluate.add_argument("--submission", required=True)
    evaluate.add_argument("--truth", required=True)
    evaluate.set_defaults(run=run_evaluate)

    folds = commands.add_parser("folds", help="make (once) and show the multilabel-stratified folds")
    folds.add_argument("--data-dir", required=True)
    folds.add_argument("--n-folds", type=int_at_least(2), default=5)
    folds.add_argument("--seed", type=int_at_least(0), default=42)
    folds.set_defaults(run=run_folds)

    check = commands.add_parser("check", help="read every CSV row and image as training would; report every problem")
    check.add_argument("--data-dir", required=True, help="Kaggle-layout folder")
    check.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                       help="expected size (default: the size most images have)")
    check.add_argument("--workers", type=positive_int, help="reader threads (default: one per core this process may use)")
    check.set_defaults(run=run_check)

    train = commands.add_parser("train", help="train a UNet at native resolution")
    train.add_argument("-c", "--config", help="YAML config (see configs/); not needed with --resume")
    train.add_argument("--out", help="run directory (default runs/<timestamp>)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last.pt")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=1e-3")
    train.set_defaults(run=run_train)

    predict = commands.add_parser("predict", help="write a Kaggle submission from one or more checkpoints")
    predict.add_argument("--checkpoint", action="append", required=True, help="best.pt or last.pt; repeat to ensemble")
    predict.add_argument("--data-dir", help="Kaggle-layout folder (default: the data the checkpoint trained on)")
    predict.add_argument("--out", default="submission.csv")
    predict.add_argument("--postprocess", metavar="FILE",
                         help="the rule to apply: a postprocess.json, or none for the config's rule (default: "
                              "the run's own postprocess.json; for the folds of one CV directory, its pooled one)")
    add_device_option(predict)
    predict.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. predict.threshold=0.45")
    predict.set_defaults(run=run_predict)

    segment = commands.add_parser("segment", help="cloud-pattern maps of satellite scenes of any size (JPEG, PNG, "
                                  "GeoTIFF): per-scene maps, area fractions, optional lat/lon grid")
    segment.add_argument("scenes", nargs="+", metavar="SCENE",
                         help="scene files, folders of them, or glob patterns; then config overrides, key=value")
    segment.add_argument("--checkpoint", action="append", required=True, help="best.pt or last.pt; repeat to ensemble")
    segment.add_argument("--out", required=True, help="output folder (a rerun skips the scenes done in it)")
    segment.add_argument("--tile", type=int, nargs=2, metavar=("H", "W"),
                         help="window size (default: the size the model trained on, data.image_size)")
    segment.add_argument("--overlap", type=float,
                         help="share of a window that neighbouring windows have in common, at least (0 to 0.9; default 0.25)")
    segment.add_argument("--grid", type=float, metavar="DEGREES",
                         help="also grid the fractions of georeferenced scenes on a lat/lon grid of this step into grid.nc")
    segment.add_argument("--time-pattern", metavar="REGEX",
                         help="where a scene's time is in its file name: named groups year, month, day (hour, minute) "
                              "or year, doy (default: the first YYYYMMDD or YYYY-MM-DD); the GeoTIFF's "
                              "TIFFTAG_DATETIME comes first")
    segment.add_argument("--postprocess", metavar="FILE", help="the rule whose thresholds make the masks (as predict)")
    segment.add_argument("--outputs", default="probs,masks", metavar="LIST",
                         help="a GeoTIFF's bands, comma-separated: probs (4 probabilities), masks (4 masks), classbits "
                              "(1 band, bit k = class k's mask) (default probs,masks)")
    segment.add_argument("--compress", metavar="CODEC",
                         help="a GeoTIFF's codec: zstd (default: fastest; GDAL >= 2.3, QGIS, rasterio read it), deflate "
                              "(every TIFF reader), lerc or none")
    segment.add_argument("--cog", action="store_true",
                         help="write each GeoTIFF as a Cloud-Optimized GeoTIFF (tiled, overviews; slower to write)")
    add_device_option(segment)
    segment.set_defaults(run=run_segment)

    oof = commands.add_parser("oof", help="write a checkpoint's out-of-fold probabilities (training does this too); "
                              "for an every-fold run's best.pt, its folds' ensemble on every training image")
    oof.add_argument("--checkpoint", required=True)
    oof.add_argument("--out", help="default: oof.npz beside the checkpoint (insample.npz beside an every-fold run's)")
    add_device_option(oof)
    oof.set_defaults(run=run_oof)

    convert = commands.add_parser("convert-checkpoint", help="rewrite a checkpoint of an older cloudseg so that it "
                                  "loads without running code (this once runs the file's code: --trust)")
    convert.add_argument("checkpoint", metavar="OLD")
    convert.add_argument("--out", metavar="NEW", help="default: replace OLD")
    convert.add_argument("--trust", action="store_true",
                         help="I wrote OLD myself: loading it may run any code it holds")
    convert.set_defaults(run=run_convert_checkpoint)

    swa = commands.add_parser("swa", help="average checkpoints' weights (SWA), BatchNorm recomputed over the training "
                              "images, into one checkpoint")
    swa.add_argument("checkpoints", nargs="+", metavar="CKPT", help="e.g. RUN/epochs/epoch6.pt RUN/epochs/epoch7.pt")
    swa.add_argument("--out", required=True, help="the averaged checkpoint to write")
    add_device_option(swa, "the BatchNorm pass runs")
    swa.set_defaults(run=run_swa)

    tune = commands.add_parser("tune", help="search per-class threshold, min area and empty-mask gate on OOF probabilities")
    tune.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs with oof.npz (e.g. every fold), or an "
                      "every-fold run (its folds', and its insample.npz where it has one)")
    tune.add_argument("--out", help="default: RUN_DIR/postprocess.json for one run, where predict finds it; for "
                                    "several, postprocess.json beside the first (make cv's pooled rule)")
    tune.set_defaults(run=run_tune)

    memory = commands.add_parser("memory", help="GPU memory of a training step and the micro-batch that fits each card")
    memory.add_argument("-c", "--config", required=True, help="YAML config")
    memory.add_argument("--micro-batch", type=positive_int,
                        help="micro-batch of the breakdown (default: the config's; for auto, the one training plans)")
    memory.add_argument("--limit-gb", type=float, metavar="GB",
                        help="on a CUDA GPU: cap this process at GB (a card of that size) and run real training steps")
    memory.add_argument("overrides", nargs="*", metavar="key=value")
    memory.set_defaults(run=run_memory)

    show = commands.add_parser("show", help="PNGs of images with their true (and predicted) masks")
    show.add_argument("image_ids", nargs="+", metavar="IMAGE_ID", help="e.g. 0011165.jpg")
    show.add_argument("--data-dir", default="data/kaggle")
    show.add_argument("--submission", help="a Kaggle-format submission: its masks are drawn beside the truth")
    show.add_argument("--out", default="pictures", help="folder for the PNGs")
    show.set_defaults(run=run_show)

    config = commands.add_parser("config", help="print a resolved config, or every key with its doc")
    config.add_argument("-c", "--config", help="YAML config")
    config.add_argument("--keys", action="store_true", help="list every key, its default and what it does")
    config.add_argument("overrides", nargs="*", metavar="key=value")
    config.set_defaults(run=run_config)

    doctor = commands.add_parser("doctor", help="versions, GPUs, precision; why PyTorch cannot use a GPU")
    doctor.set_defaults(run=run_doctor)
    return parser


def add_device_option(command: argparse.ArgumentParser, what: str = "the model runs") -> None:
    """--device of the commands that run a saved model (training reads train.device instead), and
    of the benchmark scripts that run cloudseg's commands."""
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                         help=f"where {what}: auto (default) = a CUDA GPU when PyTorch sees one, else the CPU")


def run_download(args) -> None:
    from cloudseg.download import download

    download(Path(args.out))
    print(f"the Kaggle data is in {args.out}")


def int_at_least(low: int):
    """argparse's type of a whole number of at least `low` (a count, a seed)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value: 'x'"
    return parse


positive_int = int_at_least(1)


def run_synth(args) -> None:
    from cloudseg.synth import synthesize

    if (Path(args.out) / TRAIN_CSV).exists():  # another dataset, perhaps Kaggle's: never written over
        raise FileExistsError(f"{Path(args.out) / TRAIN_CSV}: --out already holds a dataset; name a new folder")
    synthesize(args.out, args.n_train, args.n_test, args.height, args.width, args.seed)
    print(f"wrote {args.n_train} train and {args.n_test} test images ({args.height}x{args.width}) to {args.out}")


def run_evaluate(args) -> None:
    from cloudseg.metrics import evaluate_submission

    summary = evaluate_submission(args.submission, args.truth)
    print(f"mean Dice {summary['dice']:.4f}")
    for label in LABELS:
        print(f"  {label:<7} {summary[label]:.4f}")


def run_folds(args) -> None:
    from cloudseg.data import load_folds, read_train_csv
    from cloudseg.task import FOLDS_CSV

    folds = load_folds(args.data_dir, args.n_folds, args.seed)
    present = read_train_csv(args.data_dir).ne("").groupby(folds).mean()
    present.insert(0, "images", folds.value_counts().sort_index())
    print(f"{args.data_dir}/{FOLDS_CSV}: share of images with each label, per fold")
    print(present.round(3).to_string())


def print_report(lines: list[str], problems: list[str]) -> int:
    """The report of `check` and `doctor`: its lines, then every problem; exit status 1 if any."""
    print("\n".join(lines))
    if not problems:
        print("no problems found")
        return 0
    print(f"{len(problems)} problem(s):")
    for problem in problems:
        print(f"  {problem}")
    return 1


def run_check(args) -> int:
    from cloudseg.check import check_dataset

    problems, summary = check_dataset(args.data_dir, args.image_size, args.workers)
    return print_report(summary, [problem.message for problem in problems])


def run_train(args) -> int | None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from cloudseg import distributed
    from cloudseg.checkpoint import load_checkpoint
    from cloudseg.config import load_config, resumed_config
    from cloudseg.every_fold import is_every_fold_run, train_run
    from cloudseg.train import Interrupted

    if args.resume:
        if args.config or args.out:
            raise ValueError(f"--resume {args.resume} continues that run with its own config, in its own folder: "
                             "leave out -c and --out (key=value overrides still apply)")
        run_dir = Path(args.resume)
        if is_every_fold_run(run_dir):  # its folds' checkpoints are its own; the run's config is config.yaml
            saved, raw = run_dir / "config.yaml", load_config(run_dir / "config.yaml").model_dump(mode="json")
        else:
            saved = run_dir / "last.pt"
            raw = load_checkpoint(saved)["config"]
        config = resumed_config(raw, args.overrides, source=str(saved))
    else:
        if not args.config:
            raise ValueError("train needs -c CONFIG (or --resume RUN_DIR)")
        config = load_config(args.config, args.overrides)
        if not args.out and distributed.world_size() > 1:  # each process would pick its own timestamp
            raise ValueError("train on several processes needs --out RUN_DIR")
        run_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        started = [run_dir / "last.pt", *run_dir.glob("fold*/last.pt")]  # a run, or an every-fold run's fold
        if distributed.is_main() and any(path.exists() for path in started):  # rank 0's own config.yaml comes next
            raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --out")
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = None
    if distributed.is_main():  # one log: the other processes say only warnings, on stderr
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logging.getLogger().addHandler(handler)
    else:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        with logging_redirect_tqdm():
            summary = train_run(config, run_dir, resume=bool(args.resume), overrides=args.overrides)
    except Interrupted as stopped:
        print(f"cloudseg: {stopped}", file=sys.stderr)
        return 130
    except BaseException:
        if created and handler is not None:
            remove_unstarted_run(run_dir, handler)
        raise
    if distributed.is_main():
        print(summary)


def remove_unstarted_run(run_dir: Path, handler: logging.Handler) -> None:
    """A run refused before it wrote anything but its log (a CPU refusal, a bad data folder)
    leaves no folder behind: the error is on the terminal, and runs/ lists only real runs."""
    logging.getLogger().removeHandler(handler)
    handler.close()
    if [path.name for path in run_dir.iterdir()] == ["train.log"]:
        (run_dir / "train.log").unlink()
        run_dir.rmdir()


def run_predict(args) -> None:
    from cloudseg.predict import predict

    path = predict(args.checkpoint, args.data_dir, args.out, args.overrides, args.postprocess, args.device)
    print(f"wrote {path}")


def run_segment(args) -> int:
    from cloudseg.geo import DEFAULT_CODEC, TIME_PATTERN
    from cloudseg.segment import OVERLAP, SegmentOptions, segment

    # both come as positionals: a key=value is an override unless a file or folder has that name
    overrides = [item for item in args.scenes if re.match(r"\w+(\.\w+)+=", item) and not Path(item).exists()]
    scenes = [item for item in args.scenes if item not in overrides]
    options = SegmentOptions(args.tile and tuple(args.tile), OVERLAP if args.overlap is None else args.overlap,
                             args.grid, args.time_pattern or TIME_PATTERN, tuple(args.outputs.split(",")),
                             (DEFAULT_CODEC if args.compress is None else args.compress).lower(), args.cog)
    failed = segment(scenes, args.checkpoint, args.out, options, postprocess_file=args.postprocess,
                     overrides=overrides, device=args.device, tracebacks=args.debug)
    return min(failed, 100)  # the exit status: how many scenes failed (100 for 100 or more)


def run_oof(args) -> None:
    from cloudseg.oof import oof_from_checkpoint

    print(f"wrote {oof_from_checkpoint(args.checkpoint, args.out, args.device)}")


def run_convert_checkpoint(args) -> None:
    from cloudseg.checkpoint import convert_checkpoint

    print(f"wrote {convert_checkpoint(args.checkpoint, args.out, trust=args.trust)}")


def run_swa(args) -> None:
    from cloudseg.hardware import resolve_device
    from cloudseg.swa import swa

    print(f"wrote {swa(args.checkpoints, args.out, resolve_device(args.device, '--device'))}")


def run_tune(args) -> None:
    from cloudseg.tune import table, tune

    print(table(tune(args.run_dirs, args.out)))


def run_config(args) -> None:
    from cloudseg.config import describe, dump, load_config

    if args.keys and args.overrides:
        raise ValueError(f"cloudseg config --keys lists every key; it takes no overrides ({' '.join(args.overrides)})")
    print(describe() if args.keys else dump(load_config(args.config, args.overrides)), end="\n")


def run_memory(args) -> None:
    from cloudseg.config import load_config
    from cloudseg.memory import capped, planned_micro_batch, report
    from cloudseg.hardware import resolve_device, speed_switches

    config = load_config(args.config, args.overrides)
    micro_batch = args.micro_batch or planned_micro_batch(config, 1)  # auto: the one training plans for
    device = resolve_device(config.train.device)
    # as train.start does: the step training runs
    speed_switches(device, config.train.deterministic, config.train.speedups.cudnn_search)
    if args.limit_gb is None:
        print(report(config, micro_batch, device))
    elif device.type != "cuda":
        raise ValueError("cloudseg memory --limit-gb runs real training steps under the cap: it needs a CUDA GPU "
                         "(without --limit-gb, cloudseg memory estimates on the CPU)")
    else:
        print(capped(config, args.limit_gb, micro_batch, device))


def run_show(args) -> None:
    from cloudseg.viz import show

    for path in show(args.image_ids, args.data_dir, args.submission, args.out):
        print(f"wrote {path}")


def run_doctor(args) -> int:
    from cloudseg.hardware import doctor

    lines, problems = doctor()
    return print_report(lines, problems)
