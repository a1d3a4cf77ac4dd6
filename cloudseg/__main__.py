"""`python -m cloudseg` (and `torchrun -m cloudseg`) runs the command line."""

import sys

from cloudseg.cli import main

sys.exit(main())
