"""torchrun entry for the DDP tests: `cloudseg train` in float64 (the default dtype), so that one
process and several sum the same gradients to within 1e-15 whatever their order. With
`--plant-first-sync` first, a planted bug for the control test: DDP's all-reduce runs on every
micro-batch of a window but the last, instead of on the last alone. With `--compile-backend NAME`
first, train.compile uses that torch.compile backend (aot_eager in tests: no code generation).
With `--record-scenes FILE` first, `cloudseg segment` appends "RANK SCENE DEVICE" to FILE for each
scene it maps (the tests of sharding read who did what, and where). With `--memory-probe` first, `cloudseg segment`
runs a per-pixel stand-in for the checkpoint's model (a scene of 160 megapixels in seconds) and
prints the process's peak resident memory before and after each scene, "peak_rss_mib SCENE MIB MIB"."""

import os

import sys

import torch

from cloudseg import compiled, distributed, segment
from cloudseg.cli import main

arguments = sys.argv[1:]
if arguments[:1] == ["--compile-backend"]:
    compiled.BACKEND, arguments = arguments[1], arguments[2:]
if arguments[:1] == ["--plant-first-sync"]:
    arguments = arguments[1:]
    real_gradient_sync = distributed.gradient_sync
    distributed.gradient_sync = lambda model, now: real_gradient_sync(model, now=not now)
if arguments[:1] == ["--record-scenes"]:
    record, arguments = arguments[1], arguments[2:]
    real_segment_scene = segment.segment_scene

    def recorded(path, *args):
        with open(record, "a") as log:  # appends of a short line from several processes do not interleave
            log.write(f"{os.environ['RANK']} {path.name} {args[1].device}\n")  # args: out_dir, ensemble, ...
        return real_segment_scene(path, *args)
    segment.segment_scene = recorded
if arguments[:1] == ["--memory-probe"]:
    import concurrent.futures
    import resource

    arguments = arguments[1:]
    real_load_ensemble, real_scene = segment.load_ensemble, segment.segment_scene

    def per_pixel(images):
        return images.float().mean(1, keepdim=True).expand(-1, 4, -1, -1) / 64 - 2

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

    def probed(path, *args):
        before = peak_mib()
        finish = real_scene(path, *args)
        concurrent.futures.wait([finish])  # the scene's finish (in the writer's thread) measured with it
        print(f"peak_rss_mib {path.name} {before} {peak_mib()}", flush=True)
        return finish

    segment.load_ensemble = lambda *a, **k: real_load_ensemble(*a, **k)._replace(forwards=[per_pixel])
    segment.segment_scene = probed
if arguments[:1] == ["train"]:
    torch.set_default_dtype(torch.float64)
sys.exit(main(arguments))
