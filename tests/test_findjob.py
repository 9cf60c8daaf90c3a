"""A replacement rank of a job whose name its ranks agreed on (no ``job=``) learns the name from
the daemon: ``a2ad.client.find_job``. Real daemon, real rank processes (two ranks agreeing
through a gloo torch.distributed group, one of them killed, a replacement started later)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from pathlib import Path

import pytest

from a2ad import errors, layout as L, protocol
from test_flashinfer_parity import HIDDEN, INVALID, MAX_TOKENS, NUM_EXPERTS, TOP_K, _expert, _round

GEOMETRY = dict(max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN)


def _one_round(a2a, rank, seed):
    import torch

    rt, inputs, _, combined = _round(seed, 2)
    mine = inputs[rank]
    got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
    out = a2a.combine(_expert(got, rank, 2), rt)
    assert torch.equal(out, combined[rank]), f"rank {rank}: combine of round {seed} differs"


def _member(role, runtime_dir, store, marks, q):
    """role 0 / 1: a rank of the original group; role 2: the replacement for rank 1."""
    try:
        import torch
        import torch.distributed as dist

        from a2ad.client import MoeAlltoAll, find_job
        from helpers import Mapping, wait_for

        marks = Path(marks)
        os.environ["A2AD_RUNTIME_DIR"] = runtime_dir
        if role == 2:
            wait_for(lambda: (marks / "served").exists(), 120, "the group's first round")
            # rank 1 is still held: no job takes a replacement for it yet
            t0 = time.monotonic()
            try:
                find_job(Mapping(1, 2), **GEOMETRY, timeout=0.5)
                q.put((role, "error", "find_job found a job while its rank 1 was alive"))
                return
            except errors.NoSuchJob as exc:
                early = (str(exc), time.monotonic() - t0)
            (marks / "looked").touch()
            name = find_job(Mapping(1, 2), **GEOMETRY, timeout=60.0)
            a2a = MoeAlltoAll(Mapping(1, 2), **GEOMETRY, job=name, timeout=60.0)
            try:
                _one_round(a2a, 1, 1601)
            finally:
                a2a.close()
            q.put((role, "ok", (name, early)))
            return
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=role, world_size=2)
        a2a = MoeAlltoAll(Mapping(role, 2), **GEOMETRY, timeout=60.0)
        _one_round(a2a, role, 1600)
        name = a2a.attachment.job
        if role == 1:
            (marks / "served").touch()
            wait_for(lambda: (marks / "looked").exists(), 120, "the replacement's first look")
            q.put((role, "ok", name))
            q.close()
            q.join_thread()
            os._exit(0)  # dies holding the rank (no close): the daemon sees its lease end
        try:
            try:
                _one_round(a2a, 0, 1601)
                q.put((role, "error", "a round completed without rank 1"))
                return
            except errors.PeerLost:
                pass
            a2a.recover(timeout=90.0)
            _one_round(a2a, 0, 1601)
        finally:
            a2a.close()
            dist.destroy_process_group()
        q.put((role, "ok", name))
    except BaseException:
        q.put((role, "error", traceback.format_exc()))


def test_replacement_learns_the_agreed_job_name_from_the_daemon(daemon, tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, str(daemon.runtime_dir), str(tmp_path / "store"), str(tmp_path), q),
                         daemon=True) for r in range(3)]
    results = {}
    try:
        for p in procs:
            p.start()
        end = time.monotonic() + 240
        while len(results) < 3 and time.monotonic() < end:
            try:
                role, status, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                continue
            assert status == "ok", f"role {role}: {value}"
            results[role] = value
        assert len(results) == 3, f"only {sorted(results)} reported within 240 s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    name, (early_msg, early_s) = results[2]
    assert results[0] == results[1] == name, results
    assert name.startswith("fi-2x"), name  # a name the ranks agreed on, not one anybody passed
    assert "rank 1 dead or left" in early_msg and early_s < 5, (early_msg, early_s)


def test_matching_picks_the_job_with_that_rank_vacant():
    """The decision alone, on listings as the daemon gives them: geometry, owner, the rank's
    state and the name prefix decide; several matches are refused."""
    from a2ad.client.findjob import _spec, matching_jobs

    spec = _spec(2, MAX_TOKENS, TOP_K, NUM_EXPERTS, None, HIDDEN, 0, "raise")
    assert spec["workspace_size_per_rank"] == L.moe_workspace_size_per_rank(2, TOP_K, MAX_TOKENS, HIDDEN)

    def job(name, states, uid=1000, ep=2, **over):
        return {"name": name, "owner_uid": uid, "ep_size": ep, "state": "degraded",
                "spec": dict(spec, **over), "ranks": [{"rank": i, "state": s} for i, s in enumerate(states)]}

    jobs = [job("fi-a", ["attached", "dead"]), job("fi-b", ["attached", "attached"]),
            job("fi-c", ["attached", "dead"], uid=1001), job("fi-d", ["attached", "dead"], top_k=TOP_K + 1),
            job("fi-e", ["attached", "dead", "attached"], ep=3), job("mine", ["attached", "left"])]
    assert matching_jobs(jobs, 1, 2, spec, 1000) == ["fi-a", "mine"]
    assert matching_jobs(jobs, 1, 2, spec, 1000, prefix="fi-") == ["fi-a"]
    assert matching_jobs(jobs, 0, 2, spec, 1000) == []
    other = protocol.normalize_spec(dict(spec, on_peer_loss="degrade"), 2)
    assert matching_jobs(jobs, 1, 2, other, 1000) == []


def test_find_job_without_a_match_ends_in_no_such_job(daemon):
    from a2ad.client import find_job
    from helpers import Mapping

    t0 = time.monotonic()
    with pytest.raises(errors.NoSuchJob, match="rank 1 dead or left"):
        find_job(Mapping(1, 2), **GEOMETRY, runtime_dir=str(daemon.runtime_dir), timeout=0.3)
    assert time.monotonic() - t0 < 10
    with pytest.raises(errors.InputError) as exc:
        find_job(Mapping(0, 2), MAX_TOKENS, TOP_K, NUM_EXPERTS, runtime_dir=str(daemon.runtime_dir))
    assert exc.value.details["argument"] == "hidden_size"
