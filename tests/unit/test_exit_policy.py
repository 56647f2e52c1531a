"""The exit policy's ranks (threed.errors.guarded): under torchrun rank 0 says a refusal; another rank waits for
rank 0 to fail alike (torchrun then ends it, silently), and speaks itself, naming its rank, only when rank 0 did not.

    .venv/bin/python -m pytest -q tests/unit/test_exit_policy.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import SRC

# One rank's refusal: RANK from the environment, PEER_WAIT_S from argv.
PROBE = """
import sys
import threed.errors as errors
errors.PEER_WAIT_S = float(sys.argv[1])
def refuse():
    raise errors.ConfigError("--steps must be >= 0, got -1")
sys.exit(errors.guarded("threed", refuse, prefix="configuration error: "))
"""


def refusal(rank: str, wait: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "RANK": rank}
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, str(wait)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_rank_0_speaks_at_once() -> None:
    p = refusal("0", 60)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 2 and err == "threed: configuration error: --steps must be >= 0, got -1\n", err


def test_another_rank_is_silent_when_torchrun_ends_it() -> None:
    # What torchrun does once rank 0 has exited 2: SIGTERM to the others, which must not have spoken yet.
    p = refusal("1", 60)
    time.sleep(2.0)  # the refusal raised, the rank waiting
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGTERM and err == "", err


def test_another_rank_speaks_naming_itself_when_rank_0_did_not_fail() -> None:
    p = refusal("3", 0.2)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 2 and err == "threed: rank 3: configuration error: --steps must be >= 0, got -1\n", err
