"""`python -m threed.cli ...` is `threed ...` (torchrun starts the ranks of `threed train --nproc-per-node N` so)."""

import sys

from threed.cli.main import main

sys.exit(main())
