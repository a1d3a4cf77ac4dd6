"""What a command costs before it does anything: its imports. Prints one table.

Each row runs in a new process under `python -X importtime`: `cloudseg segment --help`, the
modules of `segment`, `predict` and `train` imported, and with --scene and --checkpoint a whole
`cloudseg segment` call on that scene (on the CPU). Seconds: the process's wall-clock time (the
fastest of --repeat by CPU seconds), its CPU seconds (what other processes on the machine
change least), and -X importtime's cumulative time of the row's module; then the heavy
modules the process loaded that a command imports only where it uses them (tests/test_imports.py).
Below the table, each row's largest top-level packages by -X importtime's cumulative time (a
package's own imports included, so a package imported by another counts in both): where the
imports' seconds go on a machine this script cannot be watched on.
With --baseline DIR (another checkout, e.g. `git worktree add /tmp/base COMMIT`) each row runs
there too, alternating with this checkout, so both see the same load.

Usage: python benchmarks/import_time.py [--repeat N] [--baseline DIR] [--scene FILE --checkpoint CKPT]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LARGEST = 8  # packages named per row below the table
HEAVY = ("torch", "torch._dynamo", "sklearn", "matplotlib", "albumentations", "tensorboard", "scipy.sparse.csgraph")
ROWS = {  # row -> (python's arguments, the module whose import time -X importtime gives)
    "cloudseg segment --help": (["-m", "cloudseg", "segment", "--help"], "cloudseg.cli"),
    "import cloudseg.segment": (["-c", "import cloudseg.segment"], "cloudseg.segment"),
    "import cloudseg.predict": (["-c", "import cloudseg.predict"], "cloudseg.predict"),
    "import cloudseg.train": (["-c", "import cloudseg.train"], "cloudseg.train"),
}


def run(checkout: Path, arguments: list[str], module: str) -> tuple[float, float, float, set[str], dict]:
    """(wall-clock s, CPU s, module's cumulative import s, heavy modules loaded, {top-level package:
    cumulative import s}) of `python -X importtime ARGUMENTS` in a new process on `checkout`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    start, cpu = time.perf_counter(), children_cpu_seconds()
    done = subprocess.run([sys.executable, "-X", "importtime", *arguments], cwd=checkout, env=env,
                          capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed in {checkout}:\n{done.stderr[-2000:]}")
    cumulative, loaded, packages = 0.0, set(), {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, total, name = (part.strip() for part in line[len("import time:"):].split("|"))
            loaded.add(name)
            if name == module and total.isdigit():
                cumulative = int(total) / 1e6
            if "." not in name and total.isdigit():
                packages[name] = int(total) / 1e6
    return seconds, cpu, cumulative, {name for name in HEAVY if name in loaded}, packages


def bytecode_state(packages=("torch", "torchvision", "timm", "sympy")) -> str:
    """How many of each package's modules have their bytecode compiled for this Python: where
    Python may not write that cache (PYTHONDONTWRITEBYTECODE), each process compiles the sources
    of the modules without it again, seconds that a user's install (pip's, `make install`'s) does
    not pay. A count can stay one short of the total: a file this Python cannot compile (torch
    ships one)."""
    import importlib.util

    counts = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        folders = spec.submodule_search_locations or []  # a package's folders; a single-file module alone
        sources = [path for folder in folders for path in Path(folder).rglob("*.py")] or [Path(spec.origin)]
        compiled = sum(Path(importlib.util.cache_from_source(str(path))).exists() for path in sources)
        counts.append(f"{name} {compiled} of {len(sources)}")
    return ("modules with bytecode: " + ", ".join(counts) +
            f"; PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')}")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children: what a run costs, less what other
    processes on the machine take from its wall-clock time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fastest(results: list[tuple]) -> tuple:
    return min(results, key=lambda result: result[1])  # by CPU seconds


def main() -> None:
    args = parse_args()
    rows = dict(ROWS)
    if args.scene:
        rows["cloudseg segment SCENE (whole call, CPU)"] = (
            ["-m", "cloudseg", "segment", str(Path(args.scene).resolve()), "--checkpoint",
             str(Path(args.checkpoint).resolve()), "--out", "{out}", "--device", "cpu"], "cloudseg.segment")
    checkouts = {"baseline": Path(args.baseline).resolve()} if args.baseline else {}
    checkouts["this checkout"] = HERE
    load = os.getloadavg()[0]
    results = {name: {checkout: [] for checkout in checkouts} for name in rows}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeat):
            for name, (arguments, module) in rows.items():
                for index, (label, checkout) in enumerate(checkouts.items()):  # alternating: the same load for both
                    out = str(Path(folder) / f"out{repeat}-{index}")  # a new folder: a call skips scenes done
                    results[name][label].append(run(checkout, [a.replace("{out}", out) for a in arguments], module))
    print_table(results, checkouts, args, load)


def print_table(results: dict, checkouts: dict, args, load: float) -> None:
    import torch

    print(f"imports, {datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, Python {platform.python_version()}; fastest of {args.repeat} by CPU s; load average "
          f"before: {load:.1f}")
    print(bytecode_state())
    labels = list(checkouts)
    header = " | ".join(f"{label}: wall s, CPU s (importtime s)" for label in labels)
    print(f"| row | {header} | {'CPU speed-up | ' if len(labels) > 1 else ''}heavy modules loaded |")
    print("|---|" + "---|" * (len(labels) + (2 if len(labels) > 1 else 1)))
    for name, by_checkout in results.items():
        best = {label: fastest(by_checkout[label]) for label in labels}
        cells = " | ".join(f"{best[label][0]:.2f}, {best[label][1]:.2f} ({best[label][2]:.2f})" for label in labels)
        ratio = f"{best[labels[0]][1] / best[labels[-1]][1]:.2f}x | " if len(labels) > 1 else ""
        heavy = " → ".join(", ".join(sorted(best[label][3])) or "none" for label in labels)
        print(f"| {name} | {cells} | {ratio}{heavy} |")
    print(f"\nLargest top-level packages ({labels[-1]}; cumulative import s, each with what it imports):")
    for name, by_checkout in results.items():
        packages = fastest(by_checkout[labels[-1]])[4]
        largest = sorted(packages.items(), key=lambda item: -item[1])[:LARGEST]
        print(f"- {name}: " + ", ".join(f"{package} {seconds:.2f}" for package, seconds in largest))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per row and checkout; the fastest is shown")
    parser.add_argument("--baseline", metavar="DIR", help="another checkout to run each row in too, alternating")
    parser.add_argument("--scene", help="also time a whole `cloudseg segment` call on this scene (needs --checkpoint)")
    parser.add_argument("--checkpoint", help="the model of the --scene row")
    args = parser.parse_args()
    if bool(args.scene) != bool(args.checkpoint):
        parser.error("--scene and --checkpoint go together")
    return args


if __name__ == "__main__":
    main()
