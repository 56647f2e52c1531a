"""On the local Slurm cluster (tests/cli/slurm_cluster.py; `make test-slurm`): a job on 2 nodes x 4 ranks (tp2 pp2 dp2)
saves, and the same script resubmitted on 1 node (dp1, the same global batch) resumes from it through a
universal checkpoint, optimizer state included, and trains on."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import learnable_tokens, write_dataset

from slurm_cluster import LocalSlurm
from test_slurm_jobs import job_report, latest_step, losses, submit


def node_logs(log_dir: Path) -> str:
    """Every node log of the first start: the start-up line (global rank 0) and the step lines (the last stage)
    may come from different nodes."""
    return "\n".join(f.read_text(errors="replace") for f in sorted(log_dir.glob("start0-node*.log")))


@pytest.mark.slurm
@pytest.mark.slow
def test_job_resubmitted_on_another_node_count_resumes(local_slurm_factory, tmp_path: Path) -> None:
    slurm: LocalSlurm = local_slurm_factory(num_nodes=2, cpus_per_node=4)
    data = write_dataset(tmp_path / "data" / "corpus", learnable_tokens(40000), 512)
    save = tmp_path / "ckpt"
    # GLOBAL instead of GAS: the global batch stays 32 when dp halves (gas doubles), so the run continues as is.
    # Every document trains (SPLIT 100,0,0), so no validation: EVAL_INTERVAL= clears the recipe's (it needs a split).
    env = {
        "DATA": data,
        "TOKENIZER": "",
        "GPUS_PER_NODE": "4",
        "SAVE": str(save),
        "STEPS": "6",
        "GAS": "",
        "GLOBAL": "32",
        "SEQ": "64",
        "DTYPE": "fp32",
        "SPLIT": "100,0,0",
        "EVAL_INTERVAL": "",
    }
    job, logs = submit(slurm, "slurm/train.sh", tmp_path / "first", env, "recipes/tiny.sh", nodes=2)
    assert slurm.wait(job, timeout_s=300) == "COMPLETED", job_report(slurm, job, tmp_path / "first")
    first = losses(node_logs(logs))
    assert "tp 2 x pp 2 x dp 2" in node_logs(logs) and latest_step(save) == 6

    job2, logs2 = submit(
        slurm, "slurm/train.sh", tmp_path / "second", {**env, "STEPS": "9"}, "recipes/tiny.sh", nodes=1
    )
    assert slurm.wait(job2, timeout_s=300) == "COMPLETED", job_report(slurm, job2, tmp_path / "second")
    log2 = node_logs(logs2)
    assert "tp 2 x pp 2 x dp 1" in log2 and "resuming through a universal checkpoint" in log2, log2
    assert f"resumed from {save} at step 6" in log2, log2
    second = losses(log2)
    assert sorted(second) == [7, 8, 9] and max(second.values()) < first[1], (first, second)
    assert latest_step(save) == 9
