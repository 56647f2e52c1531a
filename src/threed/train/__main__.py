"""`python -m threed.train FLAGS` (torchrun command lines in users' scripts run it): `threed train` without the
`threed` console script. The flags are training's (`threed.cli.flags`); the loop is `threed.train.loop`.

    torchrun --nproc-per-node 8 -m threed.train --model tiny --tp 2 --pp 2 --data-path ... --steps 50
"""

import sys
from typing import Optional

from threed.cli.flags import parse_run_config
from threed.errors import guarded
from threed.parallel.distributed import shutdown_distributed
from threed.train.loop import train


def main(argv: Optional[list[str]] = None) -> int:
    def run() -> None:
        train(parse_run_config(sys.argv[1:] if argv is None else argv))
        shutdown_distributed()

    # as `threed train`: one line from rank 0, no traceback per rank
    return guarded("threed", run, prefix="configuration error: ")


if __name__ == "__main__":
    sys.exit(main())
