"""Failure handling with real processes on the host backend: a dead rank never hangs its
peers, a replacement re-attaches and the job resumes, a killed daemon loses nothing."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from a2ad import errors, layout as L
from helpers import DaemonProcess, RankReports, end_daemon, reap_keeper, wait_for

HIDDEN, TOP_K, EXPERTS, MAX_T, T = 64, 2, 8, 16, 6


BACKENDS = [pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _moe(rank, ep, runtime_dir, job, timeout=20.0):
    import torch

    from a2ad.client import MoeAlltoAll, ping

    class M:
        moe_ep_rank, moe_ep_size = rank, ep

    device = None
    if ping(runtime_dir)["backend"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    size = L.workspace_size_per_rank(ep, MAX_T, HIDDEN * 4, HIDDEN * 4)  # float32 payloads both ways
    return MoeAlltoAll(M(), MAX_T, TOP_K, EXPERTS, size, job=job, runtime_dir=runtime_dir, timeout=timeout, device=device)


def verified_round(a2a, rank: int, ep: int, seed: int) -> None:
    """One dispatch/expert/combine round, checked exactly: rank q's expert multiplies by
    (q + 1), so token t must come back as hidden[t] * sum of (q + 1) over its target ranks."""
    import torch

    g = torch.Generator().manual_seed(seed * 131 + rank)
    experts = torch.rand(T, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    hidden = torch.randint(-8, 9, (T, HIDDEN), generator=g).to(torch.float32)
    dev = a2a.attachment.device
    (recv,) = a2a.dispatch(experts.to(dev), [hidden.to(dev)], MAX_T)
    out = a2a.combine(recv * float(rank + 1), MAX_T)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        a2a.check()  # a wait that failed inside a kernel is reported here, once the stream ran
    out = out.cpu()
    owners = torch.tensor([[L.expert_owner(int(e), EXPERTS, ep) for e in row] for row in experts])
    weight = torch.zeros(T)
    for q in range(ep):
        weight += (owners == q).any(dim=1).float() * (q + 1)
    expected = hidden * weight[:, None]
    if not torch.equal(out, expected):
        raise AssertionError(f"rank {rank} seed {seed}: combine differs by {(out - expected).abs().max().item()}")


def marker_offset(a2a) -> int:
    """A byte of this job's dispatch area that traffic never writes (slot MAX_T-1 of the last
    source; every round sends fewer than MAX_T tokens to a rank)."""
    att = a2a.attachment
    return att.aux.payload_data + (att.ep_size * MAX_T - 1) * (HIDDEN * 4)


# ----------------------------------------------------------------------- rank bodies
def rank_body(rank, ep, runtime_dir, job, script, cmds, results):
    """Run a list of steps; report (rank, step, value) for each; errors are reported too."""
    try:
        import torch

        import a2ad.client  # noqa: F401  (imports stay out of the timed steps)

        torch.set_num_threads(1)  # several ranks share this machine's cores
        a2a = None
        for step in script:
            op = step[0]
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            if op == "attach":
                a2a = _moe(rank, ep, runtime_dir, job, *step[1:])
                results.put((rank, "attached", t0, a2a.generation))
            elif op == "rounds":
                first, count = step[1], step[2]
                for i in range(count):
                    verified_round(a2a, rank, ep, first + i)
                    if i == 9:
                        results.put((rank, "rounds10", time.clock_gettime(time.CLOCK_MONOTONIC), first))
                results.put((rank, "rounds", time.clock_gettime(time.CLOCK_MONOTONIC), count))
            elif op == "expect_lost":  # a round that must end in PeerLost
                try:
                    verified_round(a2a, rank, ep, step[1])
                except errors.PeerLost as exc:
                    results.put((rank, "lost", time.clock_gettime(time.CLOCK_MONOTONIC), (exc.rank, exc.details.get("reason"), exc.details.get("reason_name"))))
                else:
                    results.put((rank, "error", t0, "no PeerLost"))
                    return
            elif op == "expect_timeout":
                try:
                    verified_round(a2a, rank, ep, step[1])
                except errors.PeerTimeout as exc:
                    results.put((rank, "timeout", time.clock_gettime(time.CLOCK_MONOTONIC) - t0, exc.peer))
                else:
                    results.put((rank, "error", t0, "no PeerTimeout"))
                    return
            elif op == "hang":  # stand in the middle of a round forever (until killed)
                results.put((rank, "hanging", t0, None))
                time.sleep(3600)
            elif op == "wait":  # wait for the parent's go
                cmds.get(timeout=120)
            elif op == "stamp":  # when the previous step returned
                results.put((rank, "stamp", t0, None))
            elif op == "recover":
                gen = a2a.recover(timeout=step[1] if len(step) > 1 else 60)
                results.put((rank, "recovered", time.clock_gettime(time.CLOCK_MONOTONIC), gen))
            elif op == "mark":
                a2a.attachment.workspace[rank, marker_offset(a2a)] = 0xA0 + rank
                results.put((rank, "marked", t0, None))
            elif op == "read_marks":
                ws = a2a.attachment.workspace
                results.put((rank, "marks", t0, [int(ws[q, marker_offset(a2a)]) for q in range(ep)]))
            elif op == "close":
                a2a.close()
                results.put((rank, "closed", t0, None))
        if a2a is not None:
            a2a.close()
        results.put((rank, "done", time.clock_gettime(time.CLOCK_MONOTONIC), None))
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback

        results.put((rank, "error", 0.0, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Ranks(RankReports):
    """Rank processes driven by scripts; every wait for them is bounded."""

    def __init__(self, ep, runtime_dir, job):
        self.ctx = mp.get_context("spawn")
        super().__init__(self.ctx)
        self.ep, self.runtime_dir, self.job = ep, str(runtime_dir), job
        self.procs: dict = {}
        self.cmds: dict = {}

    def start(self, rank, script):
        cmds = self.ctx.Queue()
        p = self.ctx.Process(target=rank_body, args=(rank, self.ep, self.runtime_dir, self.job, script, cmds, self.results), daemon=True)
        p.start()
        self.procs[rank], self.cmds[rank] = p, cmds
        return p

    def go(self, rank):
        self.cmds[rank].put("go")

    def kill(self, rank):
        self.procs[rank].kill()
        self.procs[rank].join(10)

    def close(self):
        self.end_processes(self.procs.values(), grace=10)


@pytest.fixture
def ranks_for():
    made = []

    def make(ep, job, runtime_dir):
        r = Ranks(ep, runtime_dir, job)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.full
def test_kill9_mid_dispatch_peerlost_fast_then_replacement_resumes(backend, daemon_factory, ranks_for):
    daemon = daemon_factory("--grace", "5", backend=backend)
    ep, victim = 4, 3
    rk = ranks_for(ep, "kill9", daemon.runtime_dir)
    survivors = [r for r in range(ep) if r != victim]
    for r in survivors:
        rk.start(r, [("attach",), ("rounds", 0, 5), ("expect_lost", 5), ("recover",), ("rounds", 1000, 100)])
    rk.start(victim, [("attach",), ("rounds", 0, 5), ("hang",)])
    rk.expect("attached", range(ep))
    rk.expect("rounds", range(ep))
    rk.expect("hanging", [victim])
    time.sleep(0.5)  # the survivors are now inside dispatch 5, waiting for the victim's flag
    t_kill = time.clock_gettime(time.CLOCK_MONOTONIC)
    os.kill(rk.procs[victim].pid, signal.SIGKILL)
    lost = rk.expect("lost", survivors, timeout=10)
    delays = {r: (t - t_kill) * 1e3 for r, (t, _) in lost.items()}
    print(f"\n{backend}: PeerLost after kill -9 of rank {victim} mid-dispatch: "
          + ", ".join(f"rank {r} {d:.1f} ms" for r, d in sorted(delays.items())))
    assert all(v == (victim, L.ABORT_PEER_LOST, "peer lost") for _, v in lost.values())
    assert max(delays.values()) < 100.0
    rk.procs[victim].join(10)
    info = daemon.request("job_info", job="kill9")
    assert info["ranks"][victim]["state"] == "dead" and info["state"] in ("needs-rearm", "rendezvous")
    # a replacement process takes the dead rank; the survivors were not restarted
    wait_for(lambda: all(r["recovering"] for r in daemon.request("job_info", job="kill9")["ranks"] if r["rank"] != victim),
             30, "survivors recovering")
    rk.start(victim, [("attach",), ("rounds", 1000, 100)])
    (t_join, gen), = rk.expect("attached", [victim]).values()
    recovered = rk.expect("recovered", survivors)
    assert gen == 1 and all(g == 1 for _, g in recovered.values())
    (first10, _), = rk.expect("rounds10", [victim], timeout=120).values()
    got = rk.expect("rounds", range(ep), timeout=120)
    assert all(v == 100 for _, v in got.values())
    resumed = max(t for t, _ in recovered.values())
    print(f"{backend}: replacement join -> all ranks released {1e3 * (resumed - t_join):.1f} ms; "
          f"-> 10 verified rounds done {1e3 * (first10 - t_join):.1f} ms; 100 verified rounds after recovery passed")
    rk.expect("done", range(ep))
    info = daemon.request("job_info", job="kill9")
    assert info["generation"] == 1 and info["rearms"] == 1


@pytest.mark.full
def test_silent_peer_times_out_and_the_job_rearms(daemon):
    from a2ad.client import MoeAlltoAll  # noqa: F401  (import cost outside the timed part)

    rk = Ranks(2, daemon.runtime_dir, "silent")
    try:
        # rank 1 never calls dispatch in round 3; rank 0's dispatch times out after the
        # job's timeout (8 s here; also the rendezvous bound, so not shorter on a busy CI box)
        rk.start(0, [("attach", 8.0), ("rounds", 0, 3), ("expect_timeout", 3), ("recover",), ("rounds", 50, 20)])
        rk.start(1, [("attach", 8.0), ("rounds", 0, 3), ("wait",), ("recover",), ("rounds", 50, 20)])
        rk.expect("attached", [0, 1])
        rk.expect("rounds", [0, 1])
        (waited, peer), = rk.expect("timeout", [0], timeout=60).values()
        print(f"\nhost: dispatch with a silent peer raised PeerTimeout(peer={peer}) after {waited:.2f} s")
        assert peer == 1 and 7.5 < waited < 15.0
        # rank 0 now asks for a re-arm; the daemon tells rank 1 through the abort word
        wait_for(lambda: (lambda i: i["state"] == "rendezvous" and i["abort"] == "re-arm requested")(
            daemon.request("job_info", job="silent")), 10, "rank 0's re-arm request")
        rk.go(1)
        rec = rk.expect("recovered", [0, 1])
        assert {g for _, g in rec.values()} == {1}
        rk.expect("rounds", [0, 1])
        rk.expect("done", [0, 1])
    finally:
        rk.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_daemon_kill9_during_traffic_then_restart_readopts(backend, runtime_dir):
    d1 = DaemonProcess(runtime_dir, "--backend", backend, "--grace", "5").start()
    rk = Ranks(2, runtime_dir, "survive")
    try:
        for r in range(2):
            rk.start(r, [("attach",), ("mark",), ("rounds", 0, 1000), ("wait",), ("read_marks",), ("wait",), ("close",)])
        rk.expect("attached", [0, 1])
        rk.expect("marked", [0, 1])
        # kill the daemon while the ranks are in their 1000 rounds (after round 10)
        rk.expect("rounds10", [0, 1])
        d1.kill9()
        t_killed = time.monotonic()
        done = rk.expect("rounds", [0, 1], timeout=300)
        print(f"\n{backend}: 1000 verified rounds completed on every rank with the daemon dead "
              f"({time.monotonic() - t_killed:.1f} s after kill -9)")
        assert all(v == 1000 for _, v in done.values())
        # restart: the new daemon re-adopts the job from the state file and the fd keeper
        d2 = DaemonProcess(runtime_dir, "--backend", backend, "--grace", "60").start()
        info = d2.request("job_info", job="survive")
        assert [r["state"] for r in info["ranks"]] == ["attached", "attached"]
        assert "re-adopted 1 job(s): survive" in d2.log()
        # a new attach works, on a new job
        from a2ad.client import attach

        with attach("fresh", 0, 1, runtime_dir=runtime_dir, timeout=10, max_num_tokens=4, top_k=1, num_experts=2,
                    workspace_size_per_rank=1 << 16) as att:
            assert att.generation == 0
        # both ranks check the marks they wrote before the daemon died, then leave
        rk.go(0)
        rk.go(1)
        marks = rk.expect("marks", [0, 1])
        assert all(v == [0xA0, 0xA1] for _, v in marks.values())
        rk.go(0)
        rk.go(1)
        rk.expect("closed", [0, 1])
        rk.expect("done", [0, 1])
        # new processes joining the job after the restart get the same memory: the marks
        rk2 = Ranks(2, runtime_dir, "survive")
        try:
            for r in range(2):
                rk2.start(r, [("attach",), ("read_marks",), ("rounds", 7000, 10)])
            marks = rk2.expect("marks", [0, 1], timeout=60)
            assert all(v == [0xA0, 0xA1] for _, v in marks.values()), marks
            rk2.expect("rounds", [0, 1])
            rk2.expect("done", [0, 1])
        finally:
            rk2.close()
        assert d2.stop() == 0
    finally:
        rk.close()
        d1.kill9()
        reap_keeper(runtime_dir)


def test_daemon_restart_while_a_rank_waits_in_recover(runtime_dir):
    """The daemon holds a survivor's recover (the dead rank is missing) and is killed and
    started again: the held request died with it, so the survivor renews its lease with the
    new daemon and asks again; once the replacement joined, it returns well within its
    timeout and both ranks run verified rounds."""
    job = "rrestart"
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
    d2 = None
    rk = Ranks(2, runtime_dir, job)
    try:
        rk.start(0, [("attach",), ("rounds", 0, 3), ("expect_lost", 3), ("recover", 30.0), ("rounds", 100, 10)])
        rk.start(1, [("attach",), ("rounds", 0, 3), ("hang",)])
        rk.expect("attached", [0, 1])
        rk.expect("rounds", [0, 1])
        rk.expect("hanging", [1])
        # a process killed while its queue feeder thread still holds the shared queue's
        # write lock would keep every other rank's reports from arriving
        time.sleep(0.5)
        rk.kill(1)
        (t_lost, lost), = rk.expect("lost", [0], timeout=10).values()
        assert lost[0] == 1
        wait_for(lambda: d1.request("job_info", job=job)["ranks"][0]["recovering"], 10, "rank 0 held in recover")
        # the replacement starts now (its imports overlap the restart) and attaches on the go
        rk.start(1, [("wait",), ("attach",), ("rounds", 100, 10)])
        d1.kill9()
        t_killed = time.clock_gettime(time.CLOCK_MONOTONIC)
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
        t_up = time.clock_gettime(time.CLOCK_MONOTONIC)
        info = d2.request("job_info", job=job)
        assert [r["state"] for r in info["ranks"]] == ["attached", "dead"], info
        # the survivor's recover reaches the new daemon before any replacement is there
        wait_for(lambda: d2.request("job_info", job=job)["ranks"][0]["recovering"], 10,
                 "rank 0's recover asked again of the new daemon", interval=0.05)
        t_resent = time.clock_gettime(time.CLOCK_MONOTONIC)
        rk.go(1)
        (t_recovered, gen0), = rk.expect("recovered", [0], timeout=15).values()
        (t_joined, gen1), = rk.expect("attached", [1]).values()
        print(f"\nhost: a recover held across a daemon kill -9 and restart: held again by the new daemon "
              f"{t_resent - t_up:.2f} s after it was up; returned {t_recovered - t_resent:.2f} s after the replacement "
              f"was let go ({t_recovered - t_killed:.2f} s after the kill, {t_recovered - t_lost:.2f} s after the call; "
              f"timeout 30 s)")
        assert gen0 == gen1 == 1
        assert t_recovered - t_lost < 10.0
        got = rk.expect("rounds", [0, 1])
        assert all(v == 10 for _, v in got.values())
        rk.expect("done", [0, 1])
        info = d2.request("job_info", job=job)
        assert info["generation"] == 1 and info["rearms"] == 1
    finally:
        rk.close()
        d1.kill9()
        if d2 is not None:
            end_daemon(d2, runtime_dir)
        reap_keeper(runtime_dir)


def test_recover_bounded_when_its_daemon_does_not_come_back(runtime_dir):
    """A recover held by a daemon that is killed and not started again waits for a new one
    only for the time it was given, then says what it waited for (DaemonUnavailable)."""
    from concurrent.futures import ThreadPoolExecutor

    from a2ad.client import attach

    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
    spec = dict(runtime_dir=runtime_dir, timeout=10, max_num_tokens=4, top_k=1, num_experts=2,
                workspace_size_per_rank=1 << 16)
    pool = ThreadPoolExecutor(2)
    joins = [pool.submit(attach, "gone", r, 2, **spec) for r in range(2)]
    try:
        atts = [f.result(30) for f in joins]
        atts[1].close()  # rank 1 leaves: rank 0's recover waits for a replacement
        wait_for(lambda: d1.request("job_info", job="gone")["ranks"][1]["state"] == "left", 10, "rank 1 left")
        t0 = time.monotonic()
        held = pool.submit(atts[0].recover, 3.0)
        wait_for(lambda: d1.request("job_info", job="gone")["ranks"][0]["recovering"], 10, "rank 0 held in recover")
        d1.kill9()
        with pytest.raises(errors.DaemonUnavailable, match="recover waited 3 s for a daemon to listen"):
            held.result(20)
        took = time.monotonic() - t0
        assert 2.5 < took < 6.0, took
    finally:
        for f in joins:
            if f.done() and f.exception() is None:
                f.result().close()
        pool.shutdown(wait=True)
        d1.kill9()
        reap_keeper(runtime_dir)


def _job_info(d, job):
    try:
        return d.request("job_info", job=job)
    except errors.NoSuchJob:
        return None


def _rank_joining(d, job, rank):
    info = _job_info(d, job)
    return info is not None and info["ranks"][rank]["state"] == "joining"


@pytest.mark.parametrize("store,stop", [("keeper", "kill9"), ("none", "kill9"), ("keeper", "sigterm")])
def test_daemon_restart_while_a_rank_waits_in_join(runtime_dir, store, stop):
    """The daemon holds rank 0's join (rank 1 has not joined) and is killed and started
    again: the held join died with it, so rank 0 sees its daemon's process gone and joins
    the new daemon anew; once rank 1 joined there, both return well within their timeout
    and run verified rounds. After a kill -9, with the fd keeper the new daemon re-adopts the
    job (rank 0's slot empty again); with no fd store it has no such job and the resent join
    makes it. A SIGTERM (what systemctl restart sends) frees the job, which has no rank
    attached, without answering the held join: the same as no fd store."""
    job = "jrestart"
    args = ("--backend", "host", "--grace", "5", "--fd-store", store)
    d1 = DaemonProcess(runtime_dir, *args).start()
    d2 = None
    rk = Ranks(2, runtime_dir, job)
    try:
        t_call = time.clock_gettime(time.CLOCK_MONOTONIC)
        rk.start(0, [("attach", 30.0), ("stamp",), ("rounds", 0, 5)])
        # rank 1 starts now (its imports overlap the restart) and attaches on the go
        rk.start(1, [("wait",), ("attach", 30.0), ("stamp",), ("rounds", 0, 5)])
        wait_for(lambda: _rank_joining(d1, job, 0), 20, "rank 0 held in the join", interval=0.05)
        if stop == "kill9":
            d1.kill9()
        else:
            d1.proc.send_signal(signal.SIGTERM)
            assert d1.proc.wait(15) == 0
            assert f"job {job} freed (daemon shutdown; no rank attached)" in d1.log()
            assert f"job {job}: 1 held request(s) left unanswered" in d1.log()
        t_killed = time.clock_gettime(time.CLOCK_MONOTONIC)
        d2 = DaemonProcess(runtime_dir, *args).start()
        t_up = time.clock_gettime(time.CLOCK_MONOTONIC)
        info = _job_info(d2, job)
        # rank 0 may have sent its join again between the new daemon's readiness and this
        # query: its slot is then "joining" in a job that is either the adopted one or new
        states = None if info is None else [r["state"] for r in info["ranks"]]
        if store == "keeper" and stop == "kill9":  # re-adopted: the join in progress died with the old daemon
            assert f"re-adopted 1 job(s): {job}" in d2.log()
            assert states in (["empty", "empty"], ["joining", "empty"]), info
        else:  # nothing to adopt: the job exists only if rank 0's resent join made it anew
            assert "re-adopted" not in d2.log()
            assert states in (None, ["joining", "empty"]), info
            if states is not None:
                assert f"job {job} created by uid" in d2.log()
        # rank 0's join reaches the new daemon before rank 1 is let go
        wait_for(lambda: _rank_joining(d2, job, 0), 10, "rank 0's join sent again to the new daemon", interval=0.05)
        t_resent = time.clock_gettime(time.CLOCK_MONOTONIC)
        rk.go(1)
        t_go = time.clock_gettime(time.CLOCK_MONOTONIC)
        stamps = rk.expect("stamp", [0, 1], timeout=20)
        t_joined = stamps[0][0]
        print(f"\nhost (--fd-store {store}, {stop}): a join held across a daemon stop and restart: held again by the new "
              f"daemon {t_resent - t_up:.2f} s after it was up; returned {t_joined - t_go:.2f} s after rank 1 was let go "
              f"({t_joined - t_killed:.2f} s after the kill, {t_joined - t_call:.2f} s after the process started; "
              f"timeout 30 s)")
        assert t_joined - t_go < 10.0
        got = rk.expect("rounds", [0, 1])
        assert all(v == 5 for _, v in got.values())
        rk.expect("done", [0, 1])
    finally:
        rk.close()
        d1.kill9()
        if d2 is not None:
            end_daemon(d2, runtime_dir)
        reap_keeper(runtime_dir)


def test_a_daemon_killed_as_a_rank_takes_its_handles_comes_back_holding_the_rank(runtime_dir):
    """kill -9 of the daemon the moment a rank's handles reach it: the state file already
    holds the rank attached (the daemon writes it before the handles go out), so the next
    daemon, which the keeper gives the job's fds, holds the rank for that process; the
    process renews its lease there and leaves. (Had the write come after the handles, the
    next daemon would hold the rank as free and refuse the renew of a process running on it.)"""
    from a2ad.client.attach import redeem_ticket
    from a2ad.connection import DaemonClient
    from a2ad import fdpass

    spec = dict(max_num_tokens=16, top_k=2, num_experts=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64)
    args = ("--backend", "host", "--grace", "5", "--fd-store", "keeper")
    d1 = DaemonProcess(runtime_dir, *args).start()
    d2 = None
    held: list = []
    try:
        for round_ in range(3):
            job = f"jtaken{round_}"
            with DaemonClient(runtime_dir, timeout=10) as c:
                rep = c.request("join", job=job, ep_rank=0, ep_size=1, spec=spec, pid=os.getpid(), device="host",
                                timeout=10)
                sock, fds = redeem_ticket(c, rep["ticket"], 2, 10.0)
            d1.kill9()  # at once: no state write after the answer can have happened
            held += [sock, fds]
            d2 = DaemonProcess(runtime_dir, *args).start()
            info = d2.request("job_info", job=job)
            assert info["ranks"][0]["state"] == "attached" and info["ranks"][0]["pid"] == os.getpid(), info
            with DaemonClient(runtime_dir, timeout=10) as c:
                out = c.request("renew", job=job, ep_rank=0, lease=rep["lease"], pid=os.getpid())
                lease_sock, none = redeem_ticket(c, out["ticket"], 0, 10.0)
                assert none == []
                held.append(lease_sock)
                c.request("leave", job=job, ep_rank=0, lease=rep["lease"])
            wait_for(lambda: _job_info(d2, job) is None or _job_info(d2, job)["ranks"][0]["state"] == "left", 10,
                     "the rank left")
            d1, d2 = d2, None
    finally:
        for h in held:
            if isinstance(h, list):
                fdpass.close_all(h)
            else:
                h.close()
        d1.kill9()
        if d2 is not None:
            end_daemon(d2, runtime_dir)
        reap_keeper(runtime_dir)


@pytest.mark.parametrize("when", ["before-connect", "unanswered", "restarted"])
def test_a_rank_whose_daemon_goes_before_answering_its_ticket_joins_the_next_one(runtime_dir, monkeypatch, caplog,
                                                                                 when):
    """The daemon goes after it answered the join and before it answered the ticket: killed
    before the client connects to fd.sock, (stopped, then killed) with the ticket sent and
    unanswered, or killed and already replaced by a new daemon that does not know the ticket.
    attach() does not fail: it waits for the next daemon (the keeper gave it the job) and
    joins again within its timeout, and holds the rank there."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from a2ad.client import attach

    module = sys.modules["a2ad.client.attach"]
    real = module.redeem_ticket
    calls: list = []

    def daemon_goes_first(client, ticket, nfds, timeout):
        calls.append(ticket)
        if len(calls) == 1:  # the join's ticket: the fault, then the real redeem
            if when == "before-connect":
                d1.kill9()
            elif when == "restarted":
                d1.kill9()
                started.append(DaemonProcess(runtime_dir, *args).start())
            else:
                os.kill(d1.pid, signal.SIGSTOP)  # it cannot read the ticket; killed 0.3 s later
                threading.Timer(0.3, d1.kill9).start()
        return real(client, ticket, nfds, timeout)

    started: list = []
    monkeypatch.setattr(module, "redeem_ticket", daemon_goes_first)
    caplog.set_level(logging.INFO, logger=module.log.name)
    args = ("--backend", "host", "--grace", "5", "--fd-store", "keeper")
    d1 = DaemonProcess(runtime_dir, *args).start()
    d2 = None
    spec = dict(runtime_dir=runtime_dir, timeout=20.0, max_num_tokens=4, top_k=1, num_experts=2,
                workspace_size_per_rank=1 << 16)
    pool = ThreadPoolExecutor(1)
    att = None
    try:
        fut = pool.submit(attach, "jticket", 0, 1, **spec)
        wait_for(lambda: d1.proc.poll() is not None, 10, "the daemon killed")
        if when == "restarted":
            wait_for(lambda: started or fut.done(), 20, "the next daemon started")
            d2 = started[0] if started else None
        else:
            time.sleep(0.3)  # the client sees its connect fail or its connection end
            assert not fut.done(), fut.exception() if fut.done() else None
            d2 = DaemonProcess(runtime_dir, *args).start()
        att = fut.result(20)
        assert len(calls) == 2, calls  # the first ticket, then the new join's
        info = d2.request("job_info", job="jticket")
        assert info["ranks"][0]["state"] == "attached" and info["ranks"][0]["pid"] == os.getpid(), info
        assert any("the daemon went before it answered the ticket" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        if att is not None:
            att.close()
        pool.shutdown(wait=True)
        d1.kill9()
        for d in {id(d): d for d in [d2, *started] if d is not None}.values():
            end_daemon(d, runtime_dir)
        reap_keeper(runtime_dir)


def test_a_ticket_left_unanswered_by_a_daemon_still_there_is_not_its_daemon_gone(runtime_dir):
    """What decides that a rank joins again after its ticket went unanswered: the daemon that
    issued it no longer listens (nothing does, or another pid). A daemon still listening
    (one that shed the connection, say) is not gone: the error is raised, no join is sent
    again."""
    import importlib

    from a2ad.connection import DaemonClient

    module = importlib.import_module("a2ad.client.attach")
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
    d2 = None
    try:
        client = DaemonClient(runtime_dir)
        try:
            pid = client.check_daemon()[0]
            assert pid == d1.pid
            assert module._daemon_gone(client, pid) is False
            d1.kill9()
            assert module._daemon_gone(client, pid) is True  # nothing listens
            d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
            assert module._daemon_gone(client, pid) is True  # another pid listens
            assert module._daemon_gone(client, d2.pid) is False
        finally:
            client.close()
    finally:
        d1.kill9()
        if d2 is not None:
            end_daemon(d2, runtime_dir)
        reap_keeper(runtime_dir)


@pytest.mark.parametrize("watch", ["pidfd", "probe"])
def test_join_bounded_when_its_daemon_does_not_come_back(runtime_dir, monkeypatch, watch):
    """A join held by a daemon that is killed and not started again waits for a new one only
    for the time it was given, then says what it waited for (DaemonUnavailable). Where no
    pidfd can be opened on the daemon, its socket is probed instead."""
    from concurrent.futures import ThreadPoolExecutor

    from a2ad.client import attach

    if watch == "probe":
        def no_pidfd(pid, flags=0):
            raise OSError(38, "pidfd_open disabled by the test")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
    spec = dict(runtime_dir=runtime_dir, timeout=3.0, max_num_tokens=4, top_k=1, num_experts=2,
                workspace_size_per_rank=1 << 16)
    pool = ThreadPoolExecutor(1)
    try:
        t0 = time.monotonic()
        held = pool.submit(attach, "jgone", 0, 2, **spec)  # rank 1 never joins
        wait_for(lambda: _rank_joining(d1, "jgone", 0), 10, "rank 0 held in the join")
        d1.kill9()
        with pytest.raises(errors.DaemonUnavailable,
                           match=r"job 'jgone' rank 0: join waited 3 s for a daemon to listen at .* again"):
            held.result(20)
        took = time.monotonic() - t0
        assert 2.5 < took < 6.0, took
    finally:
        pool.shutdown(wait=True)
        d1.kill9()
        reap_keeper(runtime_dir)


def test_join_across_a_daemon_restart_without_a_pidfd(runtime_dir, monkeypatch):
    """Where no pidfd can be opened on the daemon, a held join sees its daemon gone by
    probing its socket (nothing listens, then another pid does) and joins the new one."""
    from concurrent.futures import ThreadPoolExecutor

    from a2ad.client import attach

    def no_pidfd(pid, flags=0):
        raise OSError(38, "pidfd_open disabled by the test")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    job = "jprobe"
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
    d2 = None
    spec = dict(runtime_dir=runtime_dir, timeout=30.0, max_num_tokens=4, top_k=1, num_experts=2,
                workspace_size_per_rank=1 << 16)
    pool = ThreadPoolExecutor(2)
    joins = []
    try:
        joins.append(pool.submit(attach, job, 0, 2, **spec))
        wait_for(lambda: _rank_joining(d1, job, 0), 10, "rank 0 held in the join")
        d1.kill9()
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "5").start()
        wait_for(lambda: _rank_joining(d2, job, 0), 10, "rank 0's join sent again to the new daemon", interval=0.05)
        t_go = time.monotonic()
        joins.append(pool.submit(attach, job, 1, 2, **spec))
        atts = [f.result(20) for f in joins]
        took = time.monotonic() - t_go
        assert took < 10.0, took
        assert [a.generation for a in atts] == [0, 0]
        info = d2.request("job_info", job=job)
        assert [r["state"] for r in info["ranks"]] == ["attached", "attached"], info
    finally:
        for f in joins:
            try:
                f.result(40).close()
            except Exception:
                pass
        pool.shutdown(wait=True)
        d1.kill9()
        if d2 is not None:
            end_daemon(d2, runtime_dir)
        reap_keeper(runtime_dir)


@pytest.mark.full
def test_operator_abort_interrupts_a_wait(daemon):
    rk = Ranks(2, daemon.runtime_dir, "opabort")
    try:
        rk.start(0, [("attach",), ("rounds", 0, 2), ("expect_lost", 2), ("recover",), ("rounds", 10, 5)])
        rk.start(1, [("attach",), ("rounds", 0, 2), ("wait",), ("recover",), ("rounds", 10, 5)])
        rk.expect("attached", [0, 1])
        rk.expect("rounds", [0, 1])
        time.sleep(0.3)  # rank 0 waits in dispatch 2 for rank 1
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "abort", "opabort"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        (_, (rank, reason, reason_name)), = rk.expect("lost", [0], timeout=10).values()
        assert reason_name == "aborted by operator"
        assert reason == L.ABORT_OPERATOR and rank == -1  # no rank was lost: the abort names none
        rk.go(1)
        rk.expect("recovered", [0, 1])
        rk.expect("rounds", [0, 1])
        rk.expect("done", [0, 1])
    finally:
        rk.close()


def test_ctl_upgrade_during_traffic_keeps_every_job(runtime_dir):
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
    rk = Ranks(2, runtime_dir, "upg")
    new_pid = None
    try:
        for r in range(2):
            rk.start(r, [("attach",), ("rounds", 0, 2000), ("wait",), ("close",)])
        rk.expect("attached", [0, 1])
        rk.expect("rounds10", [0, 1])
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), "upgrade"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        print("\n" + out.stdout.strip())
        d1.proc.wait(20)
        assert d1.proc.returncode == 0  # the old daemon handed over and exited cleanly
        from a2ad.connection import DaemonClient

        with DaemonClient(runtime_dir) as c:
            hello = c.request("hello")
            new_pid = hello["pid"]
            assert new_pid != d1.pid and f"pid {new_pid}" in out.stdout
            info = c.request("job_info", job="upg")
            assert [r["state"] for r in info["ranks"]] == ["attached", "attached"]
            done = rk.expect("rounds", [0, 1], timeout=300)  # traffic went on, every round verified
            assert all(v == 2000 for _, v in done.values())
            rk.go(0)
            rk.go(1)
            rk.expect("closed", [0, 1])
            rk.expect("done", [0, 1])
            wait_for(lambda: [r["state"] for r in c.request("job_info", job="upg")["ranks"]] == ["left", "left"],
                     10, "both ranks left through the new daemon")
    finally:
        rk.close()
        if new_pid is not None:
            os.kill(new_pid, signal.SIGTERM)
            wait_for(lambda: not _running(new_pid), 20, "the successor daemon to stop")
        d1.kill9()
        reap_keeper(runtime_dir)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
