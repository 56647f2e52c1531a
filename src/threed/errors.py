"""What bad input is, and what every command line does with it.

Bad input (a flag out of range, a missing file, a checkpoint of another model, a corpus that does not parse) is a
`ThreedError` whose message names the problem and the fix. Every entry point (`threed ...`, `python -m
threed.train`, `threed plan`, ...) runs through `guarded`, the one exit policy:

    ThreedError        one line `<prog>: <prefix><message>` on stderr, from rank 0 only under torchrun, exit 2
    KeyboardInterrupt  one line `<prog>: interrupted...`, exit 130 (the shell's code for SIGINT)

Anything else is a bug and keeps its traceback. This module imports nothing of threed: it is the floor.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class ThreedError(ValueError):
    """Bad input: the message names the problem and the fix. Never a bug (those keep their traceback)."""


class ConfigError(ThreedError):
    """A configuration that cannot run. The message names the numbers and how to fix them."""


def is_first_rank() -> bool:
    """Under torchrun every rank fails alike: only global rank 0 speaks (RANK is unset outside torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def guarded(
    prog: str, main: Callable[[], Optional[int]], prefix: str = "error: ", interrupted: str = "interrupted"
) -> int:
    """Run `main` under the exit policy above and return the process's exit status."""
    try:
        return int(main() or 0)
    except ThreedError as e:
        if is_first_rank():
            print(f"{prog}: {prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if is_first_rank():
            print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
