"""`python -m threed.train FLAGS` (torchrun command lines in users' scripts run it): `threed train FLAGS` without the
`threed` console script. A door, nothing more: the command is threed.cli's (one parser, one exit policy).

    torchrun --nproc-per-node 8 -m threed.train --model tiny --tp 2 --pp 2 --data-path ... --steps 50
"""

import sys
from typing import Optional

from threed.cli.main import main as threed_main


def main(argv: Optional[list[str]] = None) -> int:
    return threed_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
