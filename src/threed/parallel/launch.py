"""Start ranks with torchrun. `run_ranks` starts N local ranks (what `threed verify` and the tests use);
`torchrun_main` is torchrun with our exit policy (`python -m threed.parallel.launch TORCHRUN_ARGS...`: what
`threed train --nproc-per-node N` and recipes/launch.sh run, on one machine or one node of many)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

from threed.errors import ConfigError

NPROC_FLAG = "--nproc-per-node"


class RanksFailed(RuntimeError):
    pass


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """`module` is a dotted module name, or a path to a script (ending in .py)."""
    target = [module] if module.endswith(".py") else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target, *args]


def run_ranks(
    nproc: int,
    module: str,
    args: Sequence[str],
    env: Optional[dict[str, str]] = None,
    timeout: Optional[float] = None,
    capture: bool = True,
) -> subprocess.CompletedProcess:
    """Run `python -m module args` on `nproc` local ranks; raises RanksFailed with the output tail."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        **(env or {}),
    }
    proc = subprocess.run(
        torchrun_command(nproc, module, args),
        env=full_env,
        timeout=timeout,
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )
    if proc.returncode != 0:
        raise RanksFailed(
            f"{' '.join(proc.args)} exited {proc.returncode}; output tail:\n{(proc.stdout or '')[-8000:]}"
        )
    return proc


def _quiet_torchrun_loggers() -> None:
    """torchrun's agent logs every failed rank at ERROR ("failed (exitcode: 2) local_rank: 0 ...") and more at
    WARNING; the ranks have already said what went wrong, so only its CRITICAL lines stay."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)


SHUTDOWN_TIMEOUT_S = 1800  # how long torchrun's agent lets stopped ranks finish their save (see torchrun_main)


def failure_status(exitcode: int) -> int:
    """A rank's exit code as a shell reports it: a signal (negative in torch's ProcessFailure) is 128 + signal."""
    return 128 - exitcode if exitcode < 0 else exitcode


def torchrun_takes(option: str) -> bool:
    """Whether this torch's torchrun has the command-line option `option` (e.g. `--shutdown-timeout`: torch 2.13's
    has it, 2.11's exits 2 on it before any rank starts). Asked of torchrun's own parser, not of a version."""
    from torch.distributed.run import get_args_parser  # torch: torchrun's parser; only where ranks are started

    # argparse keeps its option strings in this table; it has no public accessor.
    return option in get_args_parser()._option_string_actions


def with_shutdown_timeout(argv: Sequence[str]) -> list[str]:
    """torchrun's arguments with `--shutdown-timeout=SHUTDOWN_TIMEOUT_S` first, where this torchrun takes it and
    neither the arguments nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT say otherwise.

    On Ctrl-C / SIGTERM the agent forwards the signal and gives the ranks --shutdown-timeout (torch's default: 30 s)
    before it SIGKILLs them; the ranks are then saving a checkpoint (a stop request), which at 70B takes minutes. The
    time limit that matters is Slurm's (it SIGKILLs the job anyway). A torchrun without the option keeps its 30 s
    (docs/torch-versions.md): a save cut short leaves the previous checkpoint the newest complete one."""
    argv = list(argv)
    given = any(a.split("=")[0] in ("--shutdown-timeout", "--shutdown_timeout") for a in argv)
    if given or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ or not torchrun_takes("--shutdown-timeout"):
        return argv
    return [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}", *argv]


def refuse_nested_launch() -> None:
    """`--nproc-per-node` starts the ranks itself: refused in one line where a launcher already started them."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK"):
        raise ConfigError(f"{NPROC_FLAG} starts the ranks itself: under torchrun (or srun) leave it out")


def without_nproc(argv: Sequence[str]) -> list[str]:
    """`argv` less `--nproc-per-node N` / `--nproc-per-node=N`: what each rank runs."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == NPROC_FLAG:
            skip = True
        elif not a.startswith(NPROC_FLAG + "="):
            rest.append(a)
    return rest


def run_local_ranks(nproc: int, argv: Sequence[str]) -> int:
    """`threed ARGV` on `nproc` local ranks under torchrun, ending as the ranks do (`torchrun_main`): what
    `threed train|generate|eval-harness --nproc-per-node N` run."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return torchrun_main(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "threed.cli", *argv])


def torchrun_main(argv: Sequence[str]) -> int:
    """torchrun (`python -m torch.distributed.run ARGV`) with our exit policy: when the ranks fail, nothing more is
    printed than what they printed themselves (a refusal: rank 0's one `threed: ...` line), no ChildFailedError
    traceback, and the exit status is the first failed rank's (2 for bad input, 3 for a diverged run), not 1. A
    rank killed by a signal printed nothing, so that one gets a line. `threed train --nproc-per-node N` and
    recipes/launch.sh start their ranks through this."""
    # torch: torchrun's agent; only for the commands that start ranks
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(with_shutdown_timeout(argv))
    _quiet_torchrun_loggers()
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(
                f"threed: rank {rank} was killed by {failure.signal_name()} (exit {failure_status(failure.exitcode)})"
                f"; see the lines above for the cause",
                file=sys.stderr,
                flush=True,
            )
        return failure_status(failure.exitcode) or 1
    except SignalException as e:
        # Ctrl-C (the terminal signals the launcher and its ranks) or SIGTERM to the launcher: torchrun's agent has
        # already forwarded the signal to the ranks and waited for them (--shutdown-timeout, SHUTDOWN_TIMEOUT_S), and
        # the ranks treat it as a stop request (threed.train.guard.StopRequest: save at the step boundary, exit 0, and
        # say so). Without this, the agent's SignalException ended the launcher with a traceback and exit 1 after a
        # clean save (issue 19, tests/cli/test_ctrl_c_ranks.py). Any other signal: the shell's 128 + signal.
        return 0 if e.sigval in (signal.SIGINT, signal.SIGTERM) else 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
