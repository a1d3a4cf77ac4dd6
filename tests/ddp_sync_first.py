"""torchrun entry for a control test: `cloudseg train` with a planted bug, DDP's all-reduce on
every micro-batch of a window but the last (instead of on the last alone)."""

import sys

from cloudseg import distributed
from cloudseg.cli import main

real_gradient_sync = distributed.gradient_sync
distributed.gradient_sync = lambda model, now: real_gradient_sync(model, now=not now)
sys.exit(main(sys.argv[1:]))
