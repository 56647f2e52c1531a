"""A real, throw-away Slurm cluster on this machine, for tests that ``sbatch`` our scripts.

``LocalSlurm(num_nodes, cpus_per_node, workdir)`` writes its own ``slurm.conf`` into ``workdir`` and points
``SLURM_CONF`` at it (Debian's Slurm 22.05 daemons and clients honour it, and slurmd passes it on to jobs), so
``/etc/slurm`` is never touched.  It starts munged (only if none answers), slurmctld and one ``slurmd -N nodeK``
per simulated node on unused ports, adds ``127.0.0.1 node1 .. nodeN`` to ``/etc/hosts`` for names that are
missing, and waits until ``sinfo`` shows every node idle.  On exit it cancels its jobs, runs ``scontrol
shutdown``, kills what is left of the daemons it started (by the pids read from its pid files), stops munged
only if it started it, and removes exactly the ``/etc/hosts`` line it added.  It never signals a process it did
not start.  While it is open ``os.environ["SLURM_CONF"]`` points at it, so plain ``sbatch``/``squeue`` calls
from the test process go to this cluster.

Conf choices that matter: ``SlurmdParameters=config_overrides`` (nodes may claim more CPUs than the machine has,
so 4 ranks per "node" fit on 2 cores), ``MinJobAge=600`` (finished jobs stay visible to ``scontrol``; there is
no accounting), ``AuthInfo=cred_expire=10`` (a requeued job waits cred_expire+1 s before it may start again;
the default is 120 s) and ``bf_interval=1`` (it then starts within a second).  Needs root (``ensure_slurm_installed``
installs ``slurm-wlm`` and ``munge`` with apt-get); the ``local_slurm_factory`` fixture skips otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

HOSTS = Path("/etc/hosts")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_PID = Path("/run/munge/munged.pid")
TERMINAL_STATES = frozenset(
    "COMPLETED FAILED TIMEOUT CANCELLED NODE_FAIL PREEMPTED OUT_OF_MEMORY BOOT_FAIL DEADLINE".split()
)
_SBIN = "/usr/sbin:/sbin"


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SBIN)


def ensure_slurm_installed() -> str | None:
    """Install slurm-wlm and munge with apt-get if needed; None when ready, else why not (for pytest.skip)."""
    if all(_which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root"
    if not _which("apt-get"):
        return "Slurm is not installed and apt-get is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    out = subprocess.run(install, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # stale package lists: update once, then retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        out = subprocess.run(install, env=env, capture_output=True, text=True)
    if out.returncode != 0 or not _which("slurmctld"):
        return "apt-get install slurm-wlm munge failed: " + (out.stdout + out.stderr)[-500:]
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie (unreaped daemon, e.g. under a non-reaping init) counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _terminate(pids: list[int], grace_s: float) -> None:
    """Give pids grace_s to exit, then SIGTERM, then SIGKILL whatever is still running."""
    def wait(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    wait(grace_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            if _alive(p):
                with contextlib.suppress(OSError):
                    os.kill(p, sig)
        wait(5)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"--- {path.name}: (missing)"


class LocalSlurm:
    """A Slurm controller plus ``num_nodes`` slurmd daemons named node1..nodeN, all on 127.0.0.1."""

    def __init__(self, num_nodes: int, cpus_per_node: int, workdir: Path, *, real_memory_mb: int = 5000,
                 extra_conf: str = "", start_timeout_s: float = 60.0) -> None:
        self.num_nodes, self.cpus_per_node = num_nodes, cpus_per_node
        self.workdir = Path(workdir).resolve()
        self.conf = self.workdir / "slurm.conf"
        self.nodes = [f"node{i}" for i in range(1, num_nodes + 1)]
        self.real_memory_mb, self.extra_conf, self.start_timeout_s = real_memory_mb, extra_conf, start_timeout_s
        self._pids: list[int] = []
        self._munged_pid: int | None = None
        self._hosts_line: str | None = None
        self._old_conf_env: str | None = None

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalSlurm:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ without any outer job's SLURM_* variables, plus our SLURM_CONF and ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":" + _SBIN
        return {**env, "SLURM_CONF": str(self.conf), **(extra or {})}

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ports = _free_ports(self.num_nodes + 1)
        w = self.workdir
        lines = [
            "ClusterName=threedtest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge", "AuthInfo=cred_expire=10", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "MpiDefault=none", "ReturnToService=2", "SlurmUser=root",
            "SlurmdParameters=config_overrides", "MinJobAge=600",
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            f"StateSaveLocation={w}/state", f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmctldLogFile={w}/slurmctld.log", f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmdSpoolDir={w}/slurmd-%n", f"SlurmdLogFile={w}/slurmd-%n.log",
            *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} "
              f"RealMemory={self.real_memory_mb} State=UNKNOWN" for n, p in zip(self.nodes, ports[1:])),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE",
            self.extra_conf,
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start(self) -> None:
        shutil.rmtree(self.workdir / "state", ignore_errors=True)
        for d in ["state", *(f"slurmd-{n}" for n in self.nodes)]:
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        for stale in self.workdir.glob("*.pid"):
            stale.unlink()
        self._write_conf()
        self._old_conf_env = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        self._start_munge()
        self._add_hosts()
        env = self.env()
        daemons = [("slurmctld", [_which("slurmctld") or "slurmctld"])]
        daemons += [(f"slurmd-{n}", [_which("slurmd") or "slurmd", "-N", n]) for n in self.nodes]
        for name, cmd in daemons:
            subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=30)
            pid_file = self.workdir / f"{name}.pid"
            for _ in range(100):  # the daemon writes its pid file right after it forks
                if pid_file.exists() and pid_file.read_text().strip():
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError(f"{name} wrote no pid file\n{self.log_tails()}")
            self._pids.append(int(pid_file.read_text().split()[0]))
        deadline, states = time.monotonic() + self.start_timeout_s, ""
        while time.monotonic() < deadline:
            out = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = out.stdout.strip()
            idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
            if idle == set(self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {self.start_timeout_s}s: {states!r}\n{self.log_tails()}")

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # someone else's munged answers; use it, never stop it
        if not MUNGE_KEY.exists():
            subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        for d in (MUNGE_PID.parent, Path("/var/lib/munge"), Path("/var/log/munge")):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        MUNGE_PID.unlink(missing_ok=True)
        subprocess.run(["runuser", "-u", "munge", "--", _which("munged") or "munged", "--force"],
                       check=True, capture_output=True, timeout=30)
        for _ in range(100):
            if MUNGE_PID.exists() and MUNGE_PID.read_text().strip():
                self._munged_pid = int(MUNGE_PID.read_text().split()[0])
                return
            time.sleep(0.05)
        raise RuntimeError("munged started but wrote no pid file")

    def _add_hosts(self) -> None:
        text = HOSTS.read_text()
        known = {name for line in text.splitlines() for name in line.split("#")[0].split()[1:]}
        missing = [n for n in self.nodes if n not in known]
        if missing:
            self._hosts_line = f"127.0.0.1 {' '.join(missing)}  # threed LocalSlurm {self.workdir}"
            HOSTS.write_text(text + ("" if text.endswith("\n") or not text else "\n") + self._hosts_line + "\n")

    def stop(self) -> None:
        """Idempotent teardown; every step runs even if an earlier one fails."""
        with contextlib.suppress(Exception):
            if self._pids and _alive(self._pids[0]):
                jobs = self._run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if jobs:
                    self._run("scancel", *jobs, check=False)
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline and self._run("squeue", "-h", check=False).stdout.strip():
                        time.sleep(0.3)
                self._run("scontrol", "shutdown", check=False)
        _terminate(self._pids, grace_s=10)  # slurmctld/slurmd exit by themselves after `scontrol shutdown`
        _terminate([self._munged_pid] if self._munged_pid else [], grace_s=0)
        self._pids, self._munged_pid = [], None
        if self._hosts_line is not None:
            with contextlib.suppress(OSError):
                lines = HOSTS.read_text().splitlines(keepends=True)
                HOSTS.write_text("".join(ln for ln in lines if ln.rstrip("\n") != self._hosts_line))
            self._hosts_line = None
        if os.environ.get("SLURM_CONF") == str(self.conf):
            if self._old_conf_env is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = self._old_conf_env

    # ---------------------------------------------------------------- jobs
    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env(), check=check, capture_output=True, text=True, timeout=60)

    def sbatch(self, script: Path, *args: object, env: Mapping[str, str] | None = None,
               extra_sbatch_args: Sequence[str] = (), cwd: Path | None = None) -> int:
        """Submit ``script args...``; the job sees os.environ + ``env``. Returns the job id."""
        cmd = ["sbatch", "--parsable", *extra_sbatch_args, str(script), *map(str, args)]
        out = subprocess.run(cmd, env=self.env(env), cwd=cwd, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (values may contain spaces, e.g. Reason)."""
        line = self._run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        return dict(re.findall(r"(\S+?)=(.*?)(?= [A-Za-z][\w/:]*=|$)", line))

    def wait(self, job_id: int, timeout_s: float = 120.0) -> str:
        """Poll until the job reaches a terminal state (COMPLETED, FAILED, TIMEOUT, ...) and return it."""
        deadline, info = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info["JobState"]
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s}s: {info}\n{self.log_tails()}")

    def log_tails(self, n: int = 15) -> str:
        return "\n".join(_tail(self.workdir / f, n) for f in
                         ["slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes)])


@pytest.fixture
def local_slurm_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalSlurm]]:
    """``make(num_nodes=2, cpus_per_node=8, **kw) -> LocalSlurm``, started; all are stopped after the test."""
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        def make(num_nodes: int = 2, cpus_per_node: int = 8, **kw: Any) -> LocalSlurm:
            workdir = tmp_path_factory.mktemp("slurm")
            return stack.enter_context(LocalSlurm(num_nodes, cpus_per_node, workdir, **kw))
        yield make
