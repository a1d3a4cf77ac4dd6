"""torchrun entry for the DDP tests: `cloudseg train` in float64 (the default dtype), so that one
process and several sum the same gradients to within 1e-15 whatever their order. With
`--plant-first-sync` first, a planted bug for the control test: DDP's all-reduce runs on every
micro-batch of a window but the last, instead of on the last alone. With `--compile-backend NAME`
first, train.compile uses that torch.compile backend (aot_eager in tests: no code generation).
With `--record-scenes FILE` first, `cloudseg segment` appends "RANK SCENE" to FILE for each scene
it maps (the test of sharding reads who did what)."""

import os

import sys

import torch

from cloudseg import compiled, distributed, segment
from cloudseg.cli import main

torch.set_default_dtype(torch.float64)
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
            log.write(f"{os.environ['RANK']} {path.name}\n")
        return real_segment_scene(path, *args)
    segment.segment_scene = recorded
sys.exit(main(arguments))
