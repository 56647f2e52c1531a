"""A real, throw-away Slurm cluster on this machine, for tests that ``sbatch`` our scripts.

``LocalSlurm(num_nodes, cpus_per_node, workdir)`` writes its own ``slurm.conf`` into ``workdir`` and points
``SLURM_CONF`` at it (Debian's Slurm 22.05 daemons and clients honour it, and slurmd hands it on to jobs, even
with ``--export=NONE``), so ``/etc/slurm`` is never touched.  It runs a private munged (own key and socket in
``workdir``, ``AuthInfo=socket=...``), slurmctld and one ``slurmd -N nodeK`` per simulated node on unused
ports, adds its own ``127.0.0.1 node1 .. nodeN`` line to ``/etc/hosts`` and waits until ``sinfo`` shows every
node idle.  On exit it cancels its jobs, runs ``scontrol shutdown``, kills what is left of the daemons it
started (pids read from the pid files they wrote), and removes exactly the ``/etc/hosts`` line it added.  It
never signals a process it did not start, and several instances (or pytest sessions) can run side by side.
While it is open ``os.environ["SLURM_CONF"]`` points at it, so plain ``sbatch``/``squeue`` calls from the
test process go to this cluster.

Conf choices that matter: ``SlurmdParameters=config_overrides`` (nodes may claim more CPUs than the machine
has, so 4 ranks per "node" fit on 2 cores), ``MinJobAge=600`` (finished jobs stay visible to ``scontrol``;
there is no accounting), ``AuthInfo=cred_expire=10`` (a requeued job is held cred_expire+1 s before it may
start again; the default is 120 s) and ``sched_interval=2`` (it then starts within ~2 s, not 60).
Needs root; ``ensure_slurm_installed`` apt-get installs ``slurm-wlm`` and ``munge``, and the
``local_slurm_factory`` fixture (tests/cli/conftest.py) skips with its reason when it cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


HOSTS = Path("/etc/hosts")
HOSTS_LOCK = Path("/run/threed-local-slurm-hosts.lock")
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
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name ([state, ppid, ...]); [] once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    """A zombie (a daemon nobody reaps, e.g. under a container's init) counts as gone."""
    return _stat(pid)[:1] not in ([], ["Z"])


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


def _our_leftovers(conf: Path) -> list[int]:
    """Processes started under this cluster (slurmstepd, job tasks that escaped): SLURM_CONF names our conf."""
    own, pid, mine = set(), os.getpid(), f"SLURM_CONF={conf}".encode()
    while pid > 1 and pid not in own:  # never this process or its ancestors
        own.add(pid)
        pid = int((_stat(pid) + ["0", "0"])[1])
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in own:
            with contextlib.suppress(OSError):
                if mine in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
    return found


def _tail(path: Path, n: int = 15) -> str:
    try:
        return f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"--- {path.name}: (missing)"


class LocalSlurm:
    """A Slurm controller plus ``num_nodes`` slurmd daemons named node1..nodeN, all on 127.0.0.1."""

    def __init__(
        self,
        num_nodes: int,
        cpus_per_node: int,
        workdir: Path,
        *,
        real_memory_mb: int = 5000,
        cred_expire_s: int = 10,
        extra_conf: str = "",
        start_timeout_s: float = 60.0,
    ) -> None:
        self.num_nodes, self.cpus_per_node = num_nodes, cpus_per_node
        self.workdir = Path(workdir).resolve()
        self.conf = self.workdir / "slurm.conf"
        self.munge_socket = self.workdir / "munge.sock"
        self.nodes = [f"node{i}" for i in range(1, num_nodes + 1)]
        self.real_memory_mb, self.cred_expire_s = real_memory_mb, cred_expire_s
        self.extra_conf, self.start_timeout_s = extra_conf, start_timeout_s
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
            "ClusterName=threedtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SlurmUser=root",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MinJobAge=600",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            f"StateSaveLocation={w}/state",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmctldLogFile={w}/slurmctld.log",
            f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmdSpoolDir={w}/slurmd-%n",
            f"SlurmdLogFile={w}/slurmd-%n.log",
            *(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} "
                f"RealMemory={self.real_memory_mb} State=UNKNOWN"
                for n, p in zip(self.nodes, ports[1:])
            ),
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
        self._edit_hosts(add=True)
        self._start_munge()
        self._pids.append(self._launch("slurmctld", [_which("slurmctld") or "slurmctld"]))
        for n in self.nodes:
            self._pids.append(self._launch(f"slurmd-{n}", [_which("slurmd") or "slurmd", "-N", n]))
        deadline, states = time.monotonic() + self.start_timeout_s, ""
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = out.stdout.strip()
            idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
            if idle == set(self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {self.start_timeout_s}s: {states!r}\n{self.log_tails()}")

    def _start_munge(self) -> None:
        w = self.workdir
        if len(str(self.munge_socket)) > 100:
            raise RuntimeError(f"workdir path too long for a unix socket: {w}")
        subprocess.run(
            [_which("mungekey") or "mungekey", "-c", "-f", "-k", str(w / "munge.key")], check=True, capture_output=True
        )
        self._munged_pid = self._launch(
            "munged",
            [
                _which("munged") or "munged",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={w}/munge.key",
                f"--pid-file={w}/munged.pid",
                f"--log-file={w}/munged.log",
                f"--seed-file={w}/munged.seed",
            ],
        )

    def _launch(self, name: str, cmd: list[str]) -> int:
        """Start a self-daemonizing daemon; return the pid from the pid file it writes (workdir/NAME.pid)."""
        out = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{name} failed to start ({out.returncode}): {out.stderr}\n{self.log_tails()}")
        for _ in range(100):  # it writes its pid file right after it forks
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int((self.workdir / f"{name}.pid").read_text().split()[0])
            time.sleep(0.05)
        raise RuntimeError(f"{name} wrote no pid file\n{self.log_tails()}")

    def _edit_hosts(self, add: bool) -> None:
        """Append or remove our own line, under a lock shared with other instances (duplicates are harmless)."""
        with open(HOSTS_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            text = HOSTS.read_text()
            if add:
                self._hosts_line = f"127.0.0.1 {' '.join(self.nodes)}  # threed LocalSlurm {self.workdir}"
                HOSTS.write_text(text + ("\n" if text and not text.endswith("\n") else "") + self._hosts_line + "\n")
            else:
                lines = text.splitlines(keepends=True)
                HOSTS.write_text("".join(ln for ln in lines if ln.rstrip("\n") != self._hosts_line))
                self._hosts_line = None

    def stop(self) -> None:
        """Idempotent teardown; every step runs even if an earlier one fails."""
        with contextlib.suppress(Exception):
            if self._pids and _alive(self._pids[0]):
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    deadline = time.monotonic() + 15
                    while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                        time.sleep(0.3)
                self.run("scontrol", "shutdown", check=False)
        _terminate(self._pids, grace_s=10)  # slurmctld/slurmd exit by themselves after `scontrol shutdown`
        _terminate(_our_leftovers(self.conf), grace_s=0)
        _terminate([self._munged_pid] if self._munged_pid else [], grace_s=0)
        self._pids, self._munged_pid = [], None
        if self._hosts_line is not None:
            with contextlib.suppress(OSError):
                self._edit_hosts(add=False)
        if os.environ.get("SLURM_CONF") == str(self.conf):
            os.environ.pop("SLURM_CONF")
            if self._old_conf_env is not None:
                os.environ["SLURM_CONF"] = self._old_conf_env

    # ---------------------------------------------------------------- jobs
    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (scontrol, squeue, scancel, ...) against this cluster; text output."""
        return subprocess.run(cmd, env=self.env(), check=check, capture_output=True, text=True, timeout=60)

    def sbatch(
        self,
        script: Path,
        *args: object,
        env: Mapping[str, str] | None = None,
        extra_sbatch_args: Sequence[str] = (),
        cwd: Path | None = None,
    ) -> int:
        """Submit ``script args...``; the job sees os.environ + ``env``. Returns the job id."""
        cmd = ["sbatch", "--parsable", *extra_sbatch_args, str(script), *map(str, args)]
        out = subprocess.run(cmd, env=self.env(env), cwd=cwd, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (values may contain spaces, e.g. Reason)."""
        line = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
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
        return "\n".join(
            _tail(self.workdir / f, n)
            for f in ["munged.log", "slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes)]
        )
