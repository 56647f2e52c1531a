"""What bad input is, and what every command line does with it.

Bad input (a flag out of range, a missing file, a checkpoint of another model, a corpus that does not parse) is a
`ThreedError` whose message names the problem and the fix. Every entry point (`threed ...`, `python -m
threed.train`, `threed plan`, ...) runs through `guarded`, the one exit policy:

    ThreedError        one line `<prog>: <prefix><message>` on stderr, from rank 0 only under torchrun, exit 2
                       (another rank first waits for rank 0 to fail alike: `_after_rank_0`)
    KeyboardInterrupt  one line `<prog>: interrupted...`, exit 130 (the shell's code for SIGINT)

Anything else is a bug and keeps its traceback. This module imports nothing of threed: it is the floor.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Optional

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# How long a rank other than 0 waits for rank 0 to fail alike before it speaks itself (`_after_rank_0`).
PEER_WAIT_S = 15.0


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
        else:
            _after_rank_0()
            print(f"{prog}: rank {os.environ.get('RANK')}: {prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if is_first_rank():
            print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _after_rank_0() -> None:
    """A rank other than 0 that meets bad input waits for rank 0 to say it. Under torchrun every rank
    checks the same config, so rank 0 fails alike and says it; but the rank that exits first makes torchrun stop
    the others, and a quick refusal (a config checked before the heavy imports) could stop rank 0 before its line.
    So this rank waits, and torchrun ends it (SIGTERM, back to its default action here) once rank 0 has failed.
    Still running after PEER_WAIT_S: rank 0 did not fail alike (a problem local to this rank's node), so it speaks."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a training run's stop handler would only set a flag
    except ValueError:  # not the main thread: signals stay as they are
        pass
    time.sleep(PEER_WAIT_S)
