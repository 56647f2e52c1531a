"""The session's shared launches (tests/ranks/rank_pool.py) keep a failure to its own run: a worker that raises on one
rank while the others wait for it in a collective fails with its traceback and ends its launch, and the next run
starts a fresh one; a run that outlives its timeout is killed within it, ranks included; a worker's non-zero exit
status fails its run; `fresh=True` gets a launch that has run nothing. A pool of its own on 2 ranks
(tests/ranks/probe_worker.py), not the session's. And on the session's pool: a launch makes each group once, however
many engines its requests build (dispatch_worker.share_groups_by_membership), and it times each request, CPU summed
over its ranks. A rank's pid, done and error files appear whole (dispatch_worker.publish)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dispatch_worker
from helpers import RANKS
from probe_worker import SPIN_CPU_SECONDS
from rank_pool import RankPool
from threed.parallel.launch import RanksFailed

PROBE = RANKS / "probe_worker.py"
SLEEP_TIMEOUT = 20


def rank_processes(inbox: Path) -> list[int]:
    """The live processes started for the launch whose inbox is `inbox` (its path is on their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(inbox).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.mark.slow  # four 2-rank launches (~1 min on 2 busy cores); every rank test uses the pool's good path
def test_a_failure_ends_only_its_own_run(tmp_path):
    pool = RankPool(tmp_path / "pool")
    try:
        pool.run(2, PROBE, ["ok", "--out", str(tmp_path / "ok1")], timeout=300)
        assert [json.loads((tmp_path / "ok1" / f"probe_rank{r}.json").read_text()) for r in (0, 1)] == [
            {"rank": 0, "world": 2},
            {"rank": 1, "world": 2},
        ]
        first = pool.current[2]
        with pytest.raises(RanksFailed, match="probe_worker.py raise") as failed:
            pool.run(2, PROBE, ["raise", "--out", str(tmp_path / "raise")], timeout=300)
        assert "ValueError: planted failure on rank 1" in str(failed.value)
        assert not first.alive() and not rank_processes(first.inbox)

        pool.run(2, PROBE, ["ok", "--out", str(tmp_path / "ok2")], timeout=300)  # a new launch
        pool.run(2, PROBE, ["ok", "--out", str(tmp_path / "ok3")], timeout=300, fresh=True)  # and another
        assert pool.launches == 3 and pool.current[2].seq == 1

        hung = pool.current[2]
        start = time.monotonic()
        with pytest.raises(RanksFailed, match=f"did not finish in {SLEEP_TIMEOUT} s"):
            pool.run(2, PROBE, ["sleep", "--out", str(tmp_path / "sleep")], timeout=SLEEP_TIMEOUT)
        assert time.monotonic() - start < SLEEP_TIMEOUT + 10
        assert not hung.alive() and not rank_processes(hung.inbox)

        with pytest.raises(RanksFailed, match="probe_worker.py exited 3"):
            pool.run(2, PROBE, ["exit3", "--out", str(tmp_path / "exit3")], timeout=300)
        assert pool.launches == 4
    finally:
        pool.close()


def test_a_launch_makes_each_group_once(tmp_path, rank_pool):
    """A request that makes megatron-core's groups twice gets the first ones back, and a second request adds no thread:
    the threads of the groups made afresh per engine build were what made 8-rank launches slow."""
    for run in ("one", "two"):
        rank_pool.run(2, PROBE, ["groups", "--out", str(tmp_path / run)], timeout=300)
    got = {
        run: [json.loads((tmp_path / run / f"groups_rank{r}.json").read_text()) for r in (0, 1)]
        for run in ("one", "two")
    }
    assert all(r["same"] == [True, True] for runs in got.values() for r in runs), got
    assert [r["threads"] for r in got["two"]] == [r["threads"] for r in got["one"]], got


def states(pids: list[int]) -> list[str]:
    """Each process's state letter (/proc/PID/stat: R running, S sleeping, T stopped); "gone" once it has exited."""
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            out.append("gone")
    return out


def settle(pids: list[int], want: list[str], seconds: float = 60) -> list[str]:
    """The processes' states once they are `want` (a signal takes effect when its process next runs), or after
    `seconds`, whatever they are then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and states(pids) != want:
        time.sleep(0.1)
    return states(pids)


def test_a_launch_waits_stopped_between_requests(tmp_path, rank_pool):
    """Between two requests a launch's ranks are stopped (their gloo groups' event loops would wake 100 times a second
    each), and the next request continues them."""
    rank_pool.run(2, PROBE, ["ok", "--out", str(tmp_path / "a")], timeout=300)
    launch = rank_pool.current[2]
    pids = [int(f.read_text()) for f in sorted(launch.inbox.glob("rank*.pid"))]
    assert settle(pids, ["T", "T"], 10) == ["T", "T"]
    rank_pool.run(2, PROBE, ["ok", "--out", str(tmp_path / "b")], timeout=300)
    assert (tmp_path / "b").exists() and settle(pids, ["T", "T"], 10) == ["T", "T"]


def test_each_request_is_timed_with_the_cpu_of_all_its_ranks(tmp_path, rank_pool):
    """What `--junitxml` runs write as <name>.rank-pool.json: the request's arguments without its temporary paths,
    the slowest rank's seconds, and every rank's CPU seconds added up (2 ranks each busy SPIN_CPU_SECONDS)."""
    rank_pool.run(2, PROBE, ["spin", "--out", str(tmp_path)], timeout=300)
    took = rank_pool.requests[-1]
    assert took["world"] == 2 and took["request"] == "probe_worker.py spin --out", took
    assert took["seconds"] >= SPIN_CPU_SECONDS, took
    assert 2 * SPIN_CPU_SECONDS <= took["cpu_seconds"] < 2 * SPIN_CPU_SECONDS + 2, took


@pytest.mark.slow  # a 2-rank launch of its own (~15 s of start-up on 2 busy cores)
def test_stopped_ranks_exit_when_the_pytest_process_is_killed(tmp_path):
    """The pool's watchdog continues the stopped ranks of a pytest process killed by SIGKILL (no fixture teardown
    runs), and they exit: nothing is left stopped for ever."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path[:0] = [{str(RANKS)!r}, {str(RANKS.parent)!r}]\n"
        "from pathlib import Path\nfrom rank_pool import RankPool\n"
        f"pool = RankPool(Path({str(tmp_path / 'pool')!r}))\n"
        f"pool.run(2, {str(PROBE)!r}, ['ok', '--out', {str(tmp_path / 'ok')!r}], timeout=300)\n"
        "print('ran', flush=True)\ntime.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "ran"
    pids = [int(f.read_text()) for f in sorted((tmp_path / "pool").glob("*/inbox/rank*.pid"))]
    assert settle(pids, ["T", "T"], 10) == ["T", "T"]
    owner.kill()
    owner.wait()
    assert settle(pids, ["gone", "gone"]) == ["gone", "gone"]


def test_a_rank_file_appears_only_whole(tmp_path, monkeypatch):
    """The pytest side reads a done file as soon as its name exists and then SIGSTOPs the ranks: the name must appear
    by a rename of a file that already holds the text (a rank stopped between open and write once left an empty done
    file)."""
    target = tmp_path / "0007.rank1.done"
    text = json.dumps({"seconds": 1.5, "cpu_seconds": 0.25})
    renames = []
    rename = os.replace

    def watched(src, dst):
        renames.append((target.exists(), Path(src).read_text(), Path(dst)))
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", watched)
    dispatch_worker.publish(target, text)
    assert renames == [(False, text, target)]
    assert target.read_text() == text and [p.name for p in tmp_path.iterdir()] == [target.name]
