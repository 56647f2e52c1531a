"""The local Slurm cluster of tests/cli/slurm_cluster.py: multi-node srun, host names, signals, requeue."""

from __future__ import annotations

import re
import socket
import textwrap
import time
from pathlib import Path

import pytest

from slurm_cluster import LocalSlurm

pytestmark = pytest.mark.slurm


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
    return path


def test_two_nodes_srun_and_hostnames(local_slurm_factory, tmp_path: Path) -> None:
    slurm: LocalSlurm = local_slurm_factory(num_nodes=2)
    out = tmp_path / "job.out"
    script = _script(
        tmp_path / "job.sh",
        f"""
        #SBATCH --nodes=2 --ntasks-per-node=1
        #SBATCH --output={out}
        srun bash -c 'echo TASK $SLURM_PROCID $SLURMD_NODENAME \
            $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)'
        echo HOSTS $(getent hosts node1)
    """,
    )
    job = slurm.sbatch(script)
    assert slurm.wait(job, timeout_s=60) == "COMPLETED", out.read_text() if out.exists() else ""
    text = out.read_text()
    tasks = sorted(line.split()[1:] for line in text.splitlines() if line.startswith("TASK "))
    assert tasks == [["0", "node1", "node1"], ["1", "node2", "node1"]], text
    assert re.search(r"^HOSTS 127\.0\.0\.1\s+node1\b", text, re.M), text
    info = slurm.job_info(job)
    assert info["NodeList"] == "node[1-2]" and info["ExitCode"] == "0:0", info


def test_master_addr_rendezvous_over_tcp(local_slurm_factory, tmp_path: Path) -> None:
    """What torchrun's c10d rendezvous needs: every node reaches a TCP port on the head node's name."""
    slurm: LocalSlurm = local_slurm_factory(num_nodes=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "job.out"
    task = textwrap.dedent("""
        import os, socket, time
        rank, addr, port = int(os.environ["SLURM_PROCID"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        ip = socket.gethostbyname(addr)
        if rank == 0:
            srv = socket.create_server((addr, port))
            srv.settimeout(30)
            conn, _ = srv.accept()
            print("SERVER", ip, conn.recv(64).decode(), flush=True)
        else:
            for _ in range(300):
                try:
                    c = socket.create_connection((addr, port), timeout=5)
                    break
                except OSError:
                    time.sleep(0.1)
            c.sendall(os.environ["SLURMD_NODENAME"].encode())
            print("CLIENT", ip, flush=True)
    """)
    (tmp_path / "task.py").write_text(task)
    script = _script(
        tmp_path / "job.sh",
        f"""
        #SBATCH --nodes=2 --ntasks-per-node=1
        #SBATCH --output={out}
        export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
        srun python3 {tmp_path / "task.py"}
    """,
    )
    job = slurm.sbatch(script, env={"MASTER_PORT": str(port)})
    assert slurm.wait(job, timeout_s=90) == "COMPLETED", out.read_text() if out.exists() else ""
    lines = sorted(out.read_text().split("\n"))
    assert "CLIENT 127.0.0.1" in lines and "SERVER 127.0.0.1 node2" in lines, lines


def test_requeue_restarts_with_restart_count(local_slurm_factory, tmp_path: Path) -> None:
    slurm: LocalSlurm = local_slurm_factory(num_nodes=1)
    out = tmp_path / "job.out"
    script = _script(
        tmp_path / "job.sh",
        f"""
        #SBATCH --nodes=1 --ntasks=1 --requeue --open-mode=append
        #SBATCH --output={out}
        echo RUN ${{SLURM_RESTART_COUNT:-0}}
        [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && sleep 300
        echo DONE
    """,
    )
    job = slurm.sbatch(script)
    deadline = time.monotonic() + 30
    while not (out.exists() and "RUN 0" in out.read_text()):
        assert time.monotonic() < deadline, slurm.job_info(job)
        time.sleep(0.2)
    slurm.run("scontrol", "requeue", str(job))
    t0 = time.monotonic()
    assert slurm.wait(job, timeout_s=120) == "COMPLETED", out.read_text()
    print(f"requeue -> COMPLETED in {time.monotonic() - t0:.1f}s")
    runs = [line for line in out.read_text().splitlines() if line.startswith(("RUN", "DONE"))]
    assert runs == ["RUN 0", "RUN 1", "DONE"], out.read_text()
    assert slurm.job_info(job)["Restarts"] == "1"


@pytest.mark.slow
def test_signal_before_time_limit(local_slurm_factory, tmp_path: Path) -> None:
    """--signal=B:USR1@30 reaches the batch shell before the 1-minute limit (Slurm may send it up to 60 s early)."""
    slurm: LocalSlurm = local_slurm_factory(num_nodes=1)
    out = tmp_path / "job.out"
    script = _script(
        tmp_path / "job.sh",
        f"""
        #SBATCH --nodes=1 --ntasks=1 --time=1 --signal=B:USR1@30
        #SBATCH --output={out}
        start=$(date +%s)
        trap 'echo USR1 $(( $(date +%s) - start )); exit 0' USR1
        while true; do sleep 1 & wait $!; done
    """,
    )
    job = slurm.sbatch(script)
    assert slurm.wait(job, timeout_s=150) == "COMPLETED", out.read_text()
    elapsed = int(re.search(r"^USR1 (\d+)$", out.read_text(), re.M)[1])
    print(f"USR1 after {elapsed}s of a 60s limit")
    assert 0 <= elapsed <= 31
