"""``a2ad-ctl abort JOB``: the abort word carries rank -1 (docs/OPERATIONS.md) and every rank's
PeerLost says so, including a rank whose wait on a peer the abort ended (it must not name that
peer as if its loss caused the abort). Real daemon, real rank processes, the real a2ad-ctl."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import REPO, run_ranks, wait_for


def _abort_rank(rank, runtime_dir, job, marker_dir):
    """Rank 0 dispatches and waits for rank 1, which never dispatches; after the abort every rank
    reports the PeerLost its next call raises (both ranks stay alive throughout)."""
    import torch

    from a2ad import errors
    from a2ad.client import MoeAlltoAll
    from helpers import Mapping

    marker = Path(marker_dir)
    a2a = MoeAlltoAll(Mapping(rank, 2), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=16, job=job,
                      runtime_dir=runtime_dir, timeout=60)
    try:
        (marker / f"ready-{rank}").touch()
        experts = torch.tensor([[0, 2], [1, 3], [2, 3], [0, 1]], dtype=torch.int32)
        hidden = torch.randn(4, 16).to(torch.bfloat16)
        t0 = time.monotonic()
        if rank == 0:
            try:
                a2a.dispatch(experts, [hidden], runtime_max_tokens_per_rank=4)
                return ["returned"]
            except errors.PeerLost as exc:
                got = exc
            (marker / "rank0-left").touch()
        else:
            wait_for(lambda: (marker / "rank0-left").exists(), 90, "rank 0 to leave its wait")
            try:
                a2a.check()
                return ["check passed"]
            except errors.PeerLost as exc:
                got = exc
        return [type(got).__name__, got.rank, got.details.get("reason_name"), str(got), time.monotonic() - t0,
                got.details.get("waited_for")]
    finally:
        a2a.close()


def test_operator_abort_names_no_rank_on_any_rank(daemon, tmp_path):
    runtime_dir = daemon.runtime_dir
    out = {}

    def run():
        try:
            out["res"] = run_ranks(_abort_rank, range(2), args=(str(runtime_dir), "opab", str(tmp_path)), timeout=180)
        except BaseException as exc:  # surfaced below
            out["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)) or not t.is_alive(), 120,
                 "both ranks constructed")
        time.sleep(0.5)  # rank 0 is inside dispatch, waiting for rank 1
        r = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), "--json",
                            "abort", "opab"], capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 0, r
        assert json.loads(r.stdout)["aborted"] == "opab"
    finally:
        t.join(180)
    assert "err" not in out, out.get("err")
    for rank, res in out["res"].items():
        name, lost, reason, message, waited, waited_for = res
        assert name == "PeerLost" and reason == "aborted by operator", (rank, res)
        assert lost == -1, f"rank {rank}: an operator's abort named rank {lost}: {message!r}"
        assert "(rank" not in message, (rank, message)
    assert out["res"][0][4] < 30, "rank 0's wait was not ended by the abort"
    assert out["res"][0][5] == 1 and out["res"][1][5] is None  # the wait the abort ended, where there was one
