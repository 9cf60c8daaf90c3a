"""Clear outcomes for clients, with a real daemon and real client processes (host backend):
a destroyed job says so (JobDestroyed, no recover advice), a peer that left cleanly is
reported as left (PeerLeft), and several MoeAlltoAll of one rank in one process share
one attachment (one per layer, as FlashInfer users do), which a forked child does not
inherit."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from a2ad import errors, layout as L
from helpers import run_ranks, wait_for

HIDDEN, TOP_K, EXPERTS, MAX_T = 32, 2, 8, 12
SOLO = dict(max_num_tokens=8, top_k=2, num_experts=4, workspace_size_per_rank=L.workspace_size_per_rank(1, 8, 64, 64))


def _job(runtime_dir, name: str):
    import dataplane_cases as dc

    return dc.JobSpec(str(runtime_dir), name, "host", 2, MAX_T, TOP_K, EXPERTS, HIDDEN, timeout=20.0)


def _rank_info(runtime_dir, job: str, rank: int) -> dict | None:
    from a2ad.connection import DaemonClient

    with DaemonClient(runtime_dir, timeout=5.0) as c:
        try:
            return c.request("job_info", job=job)["ranks"][rank]
        except errors.NoSuchJob:
            return None


def _verified_round(a2a, rank: int, job, seed: int, dtype: str = "bfloat16", during=None) -> None:
    """One dispatch / toy expert / combine round, dispatch and combine checked against the
    reference; ``during()`` runs between dispatch and combine. The shared flag value must
    advance by one."""
    import dataplane_cases as dc

    from a2ad.client import reference as ref

    plan = dc.Plan(seed=seed, dtype=dtype)
    flag = int(dc._aux_row(a2a, rank)["flag_val"][0])
    tokens, rt, inputs, payloads = dc._round_inputs(job, plan, 0)
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, dc.INVALID_ID, 1)
    got = a2a.dispatch(inputs[rank].experts, payloads[rank], rt, dc.INVALID_ID, 1)
    assert a2a.phase == "dispatched"
    dc._check_dispatch(a2a, rank, job, plan, rt, got, received[rank], routings[rank], payloads[rank])
    if during is not None:
        during()
    out = a2a.combine(ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size), rt)
    outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
               for q, r in enumerate(received)]
    dc._assert_combined(out, ref.combine(routings, outputs)[rank], "host", f"rank {rank} seed {seed}")
    assert int(dc._aux_row(a2a, rank)["flag_val"][0]) == flag + 1


def _small_dispatch(a2a):
    import torch

    return a2a.dispatch(torch.zeros(1, TOP_K, dtype=torch.int32), [torch.zeros(1, 4)], 1)


def _outcome(fn) -> tuple[str, str, float]:
    """(exception class name, message, seconds) of ``fn()``, which must raise."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "nothing", "", time.monotonic() - t0


def _run_with_parent(fn, args, parent, timeout=120):
    """run_ranks(fn, [0, 1]) in a thread while ``parent()`` runs here; returns the ranks' results."""
    out = {}

    def body():
        try:
            out["res"] = run_ranks(fn, range(2), args=args, timeout=timeout, ctx=CTX)
        except BaseException as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=body)
    t.start()
    try:
        parent()
    finally:
        t.join(timeout + 30)
    if "err" in out:
        raise out["err"]
    return out["res"]


CTX = mp.get_context("spawn")


# --------------------------------------------------------------------------- destroyed
def destroyed_rank(rank, runtime_dir, ready, go):
    import dataplane_cases as dc

    job = _job(runtime_dir, "doomed")
    a2a = job.open(rank)
    _verified_round(a2a, rank, job, 1)
    ready.put(rank)
    assert go.wait(60)
    res = {
        "dispatch": _outcome(lambda: _small_dispatch(a2a)),
        "check": _outcome(a2a.check),
        "recover": _outcome(lambda: a2a.recover(timeout=30)),
        "att_recover": _outcome(lambda: a2a.attachment.recover(timeout=30)),
        "destroyed": a2a.attachment.destroyed,
    }
    # the advice holds: attaching again (the old object still open) starts a new job
    fresh = job.open(rank)
    assert fresh.attachment.handles == 1 and fresh.workspace.data_ptr() != a2a.workspace.data_ptr()
    _verified_round(fresh, rank, job, 2)
    t0 = time.monotonic()
    a2a.close()
    res["close_s"] = time.monotonic() - t0
    _verified_round(fresh, rank, job, 3)  # closing the destroyed one left the new job alone
    res["info"] = _rank_info(runtime_dir, "doomed", rank)
    fresh.close()
    dc._OPEN.clear()
    return res


def test_destroyed_job_raises_job_destroyed_without_recover_advice(daemon):
    ready, go = CTX.Queue(), CTX.Event()

    def parent():
        got = {ready.get(timeout=90), ready.get(timeout=90)}
        assert got == {0, 1}
        out = subprocess.run(
            [sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "destroy", "doomed"],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        go.set()

    res = _run_with_parent(destroyed_rank, (str(daemon.runtime_dir), ready, go), parent)
    for rank, r in res.items():
        assert r["destroyed"], rank
        for what in ("dispatch", "check", "recover", "att_recover"):
            name, msg, secs = r[what]
            assert name == "JobDestroyed", (rank, what, name, msg)
            assert "doomed" in msg and "destroyed" in msg and "attach again" in msg, msg
            assert "recover" not in msg.lower(), msg
            assert secs < 1.0, (rank, what, secs)  # at once: no wait on the daemon
        assert r["close_s"] < 2.0
        assert r["info"]["state"] == "attached" and r["info"]["attaches"] == 1  # the new job's rank


# --------------------------------------------------------------------------- left
def leave_rank(rank, runtime_dir, barrier):
    import dataplane_cases as dc

    name = "leaving"
    job = _job(runtime_dir, name)
    a2a = job.open(rank)
    for i in range(2):
        _verified_round(a2a, rank, job, 10 + i)
    barrier.wait(60)
    res = {}
    if rank == 1:
        a2a.close()  # a clean leave while the job runs
        wait_for(lambda: (_rank_info(runtime_dir, name, 0) or {}).get("recovering"), 30, "rank 0 recovering")
        a2a = job.open(1)  # the replacement; its join completes the re-arm
        res["generation"] = a2a.generation
    else:
        wait_for(lambda: _rank_info(runtime_dir, name, 1)["state"] == "left", 30, "rank 1 left")
        try:
            _small_dispatch(a2a)
        except errors.PeerLost as exc:
            res["error"] = (type(exc).__name__, isinstance(exc, errors.PeerLeft), exc.rank,
                            exc.details.get("reason"), str(exc), exc.details.get("reason_name"))
        else:
            res["error"] = None
        res["generation"] = a2a.recover(timeout=60)
    for i in range(2):
        _verified_round(a2a, rank, job, 20 + i)
    barrier.wait(60)
    a2a.close()
    dc._OPEN.clear()
    return res


def test_clean_leave_is_reported_as_peer_left(daemon):
    """Needs the daemon to set ABORT_PEER_LEFT (not ABORT_PEER_LOST) when a live rank of a
    running job leaves cleanly."""
    res = run_ranks(leave_rank, range(2), args=(str(daemon.runtime_dir), CTX.Barrier(2)), timeout=120, ctx=CTX)
    err = res[0]["error"]
    assert err is not None, "rank 0's call after rank 1 left raised nothing"
    name, is_left, rank, reason, msg, reason_name = err
    assert name == "PeerLeft" and is_left and rank == 1 and reason == L.ABORT_PEER_LEFT, err
    assert reason_name == "peer left", err
    assert "rank 1 left" in msg and "recover()" in msg and "replacement" in msg, msg
    assert res[0]["generation"] == res[1]["generation"] == 1


def test_peer_left_is_a_peer_lost_with_its_own_code():
    from a2ad.control import ControlBlock

    cb = ControlBlock(bytearray(L.CONTROL_BLOCK_SIZE))
    cb.initialize(2)
    cb.set_abort(L.ABORT_PEER_LEFT, 1)
    with pytest.raises(errors.PeerLost) as ei:
        cb.raise_for(0, "j")
    assert type(ei.value) is errors.PeerLeft and ei.value.rank == 1 and ei.value.code == "peer_left"
    assert ei.value.details["reason"] == L.ABORT_PEER_LEFT and ei.value.details["reason_name"] == "peer left"
    assert L.ABORT_NAMES[L.ABORT_PEER_LEFT] == "peer left"
    assert L.ABORT_PEER_LEFT not in (L.ABORT_NONE, L.ABORT_PEER_LOST, L.ABORT_OPERATOR, L.ABORT_DESTROYED, L.ABORT_REARM)
    cb.set_abort(L.ABORT_PEER_LOST, 1)
    with pytest.raises(errors.PeerLost) as ei:
        cb.raise_for(0, "j")
    assert type(ei.value) is errors.PeerLost
    assert ei.value.details["reason"] == L.ABORT_PEER_LOST and ei.value.details["reason_name"] == "peer lost"
    for word in (L.ABORT_OPERATOR, L.ABORT_REARM):  # every abort word is named, as a string beside the number
        cb.set_abort(word, 1)
        with pytest.raises(errors.PeerLost) as ei:
            cb.raise_for(0, "j")
        assert ei.value.details["reason"] == word and ei.value.details["reason_name"] == L.ABORT_NAMES[word]
        assert isinstance(ei.value.details["reason_name"], str)
    cb.set_abort(L.ABORT_DESTROYED, -1)
    with pytest.raises(errors.JobDestroyed, match="destroyed"):
        cb.raise_for(0, "j")


# --------------------------------------------------------------------------- shared
def shared_rank(rank, runtime_dir, barrier):
    import dataplane_cases as dc

    name = "layers"
    job = _job(runtime_dir, name)
    a = job.open(rank)
    b = job.open(rank)  # a second layer: shares the attachment, no second join
    assert a.attachment is not b.attachment and a.workspace.data_ptr() == b.workspace.data_ptr()
    assert a.attachment.handles == 2
    res = {"attaches": _rank_info(runtime_dir, name, rank)["attaches"]}
    for i in range(3):  # interleaved: A's round, B's round, ...
        _verified_round(a, rank, job, 100 + i, "bfloat16")
        _verified_round(b, rank, job, 200 + i, "float16")

    # one round at a time per rank: B cannot dispatch inside A's round (nothing is written)
    def overlap():
        res["overlap"] = _outcome(lambda: _small_dispatch(b))[:2]
        assert b.phase == "idle" and a.phase == "dispatched"

    _verified_round(a, rank, job, 300, during=overlap)
    _verified_round(b, rank, job, 301)
    barrier.wait(60)
    a.close()
    res["after_a"] = _rank_info(runtime_dir, name, rank)["state"]
    res["a_dispatch"] = _outcome(lambda: _small_dispatch(a))[0]
    assert b.attachment.handles == 1
    for i in range(2):
        _verified_round(b, rank, job, 400 + i)
    barrier.wait(60)
    b.close()
    res["after_b"] = _rank_info(runtime_dir, name, rank)["state"]
    dc._OPEN.clear()
    return res


def test_two_moe_alltoall_on_one_rank_share_the_attachment(daemon):
    res = run_ranks(shared_rank, range(2), args=(str(daemon.runtime_dir), CTX.Barrier(2)), timeout=120, ctx=CTX)
    for rank, r in res.items():
        assert r["attaches"] == 1, (rank, r)
        assert r["overlap"][0] == "StateError" and "combine that one first" in r["overlap"][1], r["overlap"]
        assert r["after_a"] == "attached", (rank, r)
        assert r["a_dispatch"] == "StateError"
        assert r["after_b"] == "left", (rank, r)


def test_shared_attach_refuses_a_different_spec_locally(daemon):
    from a2ad.client import MoeAlltoAll, attach

    rt = daemon.runtime_dir
    a = attach("solo", 0, 1, runtime_dir=rt, timeout=10, **SOLO)
    try:
        joins = daemon.request("status")["counters"]["attaches"]
        with pytest.raises(errors.SpecMismatch) as ei:
            attach("solo", 0, 1, runtime_dir=rt, timeout=10, **{**SOLO, "max_num_tokens": 16})
        assert ei.value.details["field"] == "max_num_tokens" and "max_num_tokens" in str(ei.value)
        with pytest.raises(errors.SpecMismatch) as ei:
            attach("solo", 0, 2, runtime_dir=rt, timeout=10, **SOLO)
        assert ei.value.details["field"] == "ep_size"

        class M:
            moe_ep_rank, moe_ep_size = 0, 1

        with pytest.raises(errors.SpecMismatch) as ei:
            MoeAlltoAll(M(), SOLO["max_num_tokens"], 1, SOLO["num_experts"], SOLO["workspace_size_per_rank"],
                        job="solo", runtime_dir=rt, timeout=10)
        assert ei.value.details["field"] == "top_k"
        assert daemon.request("status")["counters"]["attaches"] == joins  # refused here, not by the daemon
        assert _rank_info(rt, "solo", 0)["state"] == "attached"

        b = attach("solo", 0, 1, runtime_dir=str(rt) + "/", timeout=10, **SOLO)  # same folder, spelled otherwise
        assert b.workspace.data_ptr() == a.workspace.data_ptr() and a.handles == 2
        a.close()
        assert a.workspace is None and b.workspace is not None and b.handles == 1
        b.workspace[0, -1] = 7  # still mapped
        assert _rank_info(rt, "solo", 0)["state"] == "attached"
        b.close()
        b.close()  # idempotent: the count does not go below zero
        assert _rank_info(rt, "solo", 0)["state"] == "left"
    finally:
        a.close()


def test_a_payload_whose_size_1_dimension_has_another_stride_is_sent_as_it_reads(daemon):
    """torch counts ``torch.rand(1, T).t()`` ([T, 1], strides (1, T)) as contiguous; its rows go
    out and come back as they read, on a one-rank job of a real daemon."""
    import torch

    from a2ad.client import MoeAlltoAll

    class M:
        moe_ep_rank, moe_ep_size = 0, 1

    moe = MoeAlltoAll(M(), SOLO["max_num_tokens"], SOLO["top_k"], SOLO["num_experts"], SOLO["workspace_size_per_rank"],
                      job="stride", runtime_dir=daemon.runtime_dir, timeout=10)
    try:
        t = 5
        odd = torch.rand(1, t).t()
        assert odd.shape == (t, 1) and odd.stride() == (1, t) and odd.is_contiguous()
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]], dtype=torch.int32)
        out = moe.dispatch(ids, [odd, ids], t)
        got, got_ids = out[0], out[1]
        assert torch.equal(got[0, :t], odd) and torch.equal(got_ids[0, :t], ids)
    finally:
        moe.close()


# --------------------------------------------------------------------------- fork / spawn
def spawned_attach(rank, runtime_dir):
    from a2ad.client import attach

    try:
        attach("solo", 0, 1, runtime_dir=runtime_dir, timeout=5, **SOLO).close()
    except errors.RankTaken as exc:
        return "RankTaken", str(exc)
    return "attached", ""


def test_spawned_child_does_not_share(daemon):
    from a2ad.client import attach

    with attach("solo", 0, 1, runtime_dir=daemon.runtime_dir, timeout=10, **SOLO):
        res = run_ranks(spawned_attach, [0], args=(str(daemon.runtime_dir),), timeout=60, ctx=CTX)
        assert res[0][0] == "RankTaken" and str(os.getpid()) in res[0][1], res


FORKER = r"""
import os, sys, json, time
from a2ad import errors
from a2ad.client import attach
rt, spec = sys.argv[1], json.loads(sys.argv[2])
a = attach("solo", 0, 1, runtime_dir=rt, timeout=10, **spec)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    out = {"forked": a.forked}
    try:
        b = attach("solo", 0, 1, runtime_dir=rt, timeout=5, **spec)
        out["attach"] = "shared" if b.workspace.data_ptr() == a.workspace.data_ptr() else "attached"
    except Exception as e:
        out["attach"] = type(e).__name__
        out["attach_msg"] = str(e)
    try:
        a.recover(timeout=1)
        out["recover"] = "ok"
    except Exception as e:
        out["recover"] = type(e).__name__
    a.close()  # the parent's attachment: must not leave the job
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print("CHILD", os.read(r, 65536).decode(), flush=True)
b = attach("solo", 0, 1, runtime_dir=rt, timeout=5, **spec)
print("PARENT", a.handles, b.workspace.data_ptr() == a.workspace.data_ptr(), a.lease_alive(), flush=True)
sleeper = os.fork()
if sleeper == 0:
    time.sleep(120)
    os._exit(0)
print("SLEEPER", sleeper, flush=True)
time.sleep(120)
"""


def test_forked_child_neither_shares_nor_holds_the_lease(daemon):
    import json

    rt = str(daemon.runtime_dir)
    p = subprocess.Popen([sys.executable, "-c", FORKER, rt, json.dumps(SOLO)], stdout=subprocess.PIPE, text=True)
    sleeper = None
    try:
        tag, child = p.stdout.readline().split(" ", 1)
        assert tag == "CHILD", (tag, child)
        child = json.loads(child)
        assert child["forked"] is True
        assert child["attach"] == "RankTaken" and str(p.pid) in child["attach_msg"], child
        assert child["recover"] == "StateError", child
        assert p.stdout.readline().split() == ["PARENT", "2", "True", "True"]  # the child's close left nothing
        tag, sleeper = p.stdout.readline().split()
        sleeper = int(sleeper)
        assert _rank_info(rt, "solo", 0)["state"] == "attached"
        # the forked sleeper does not keep the lease: the holder's death is seen at once
        p.kill()
        p.wait(10)
        wait_for(lambda: _rank_info(rt, "solo", 0)["state"] == "dead", 10, "rank 0 dead while its fork lives")
        assert os.path.exists(f"/proc/{sleeper}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if p.stdout:
            p.stdout.close()
        if sleeper:
            try:
                os.kill(sleeper, 9)
            except ProcessLookupError:
                pass
