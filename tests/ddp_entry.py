"""torchrun entry for the DDP tests: `cloudseg train` in float64 (the default dtype), so that one
process and several sum the same gradients to within 1e-15 whatever their order. With
`--plant-first-sync` first, a planted bug for the control test: DDP's all-reduce runs on every
micro-batch of a window but the last, instead of on the last alone. With `--compile-backend NAME`
first, train.compile uses that torch.compile backend (aot_eager in tests: no code generation)."""

import sys

import torch

from cloudseg import compiled, distributed
from cloudseg.cli import main

torch.set_default_dtype(torch.float64)
arguments = sys.argv[1:]
if arguments[:1] == ["--compile-backend"]:
    compiled.BACKEND, arguments = arguments[1], arguments[2:]
if arguments[:1] == ["--plant-first-sync"]:
    arguments = arguments[1:]
    real_gradient_sync = distributed.gradient_sync
    distributed.gradient_sync = lambda model, now: real_gradient_sync(model, now=not now)
sys.exit(main(arguments))
