"""Degraded mode with real processes on the host backend: a job created with
on_peer_loss="degrade" keeps serving when a rank is killed (its tokens lose that rank's
experts, and the client sees which), a replacement is let back in while the others
serve, the raise policy is refused as a mismatching join, and a2ad-ctl and the
metrics show the mask."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from a2ad import errors, layout as L
from helpers import REPO, DaemonProcess, RankReports, reap_keeper, wait_for

HIDDEN, TOP_K, EXPERTS, MAX_T = 32, 2, 8, 8


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _bits(ranks) -> int:
    return sum(1 << q for q in ranks)


# ----------------------------------------------------------------------- rank bodies
def check_round(rank, rnd, experts, hidden, out, degraded, counted, ep, num_experts) -> int:
    """One round of a rank whose expert multiplies what it received by (q + 1): token t must
    come back as hidden[t] times the sum of (q + 1) over the distinct ranks q of its experts in
    ``counted`` (the ranks the combine counted), and ``degraded`` must mark exactly the tokens
    with an expert elsewhere. CPU tensors. Returns how many tokens lost an expert."""
    import torch

    from a2ad.client import reference

    t, top_k = experts.shape
    owners = torch.tensor([L.expert_owner(int(e), num_experts, ep) for e in experts.flatten()]).reshape(t, top_k)
    present = torch.tensor([[bool(counted >> int(q) & 1) for q in row] for row in owners]).reshape(t, top_k)
    weight = torch.zeros(t)
    for q in range(ep):
        weight += ((owners == q) & present).any(dim=1).float() * (q + 1)
    expected = hidden * weight[:, None]
    lost = reference.lost_tokens(reference.route(experts, num_experts, ep), L.mask_ranks(counted))
    assert torch.equal(lost, (~present).any(dim=1))
    if not torch.equal(out, expected):
        raise AssertionError(f"rank {rank} round {rnd} (ranks {L.mask_ranks(counted)}): combine differs by "
                             f"{(out - expected).abs().max().item()}")
    if not torch.equal(degraded, lost):
        raise AssertionError(f"rank {rank} round {rnd}: indicator {degraded.tolist()} != {lost.tolist()} "
                             f"(ranks {L.mask_ranks(counted)})")
    return int(lost.sum())


def after_round(rank, n, rnd, done, counted, shared, results) -> bool:
    """A verified round's bookkeeping: the shared counters, the first round's report (which
    sets the stop round when asked, ``shared['stop_after']``); whether to stop now."""
    shared["done"][rank] += 1
    shared["mask"][rank] = counted
    if n == 0:
        if shared["stop_after"].value and not shared["stop"].value:
            shared["stop"].value = rnd + shared["stop_after"].value
        results.put((rank, "first", done, rnd))
    stop = shared["stop"].value
    return bool(stop and rnd + 1 >= stop)


def serve(rank, ep, runtime_dir, job, shared, results, seed, hang=None, pace=0.0, scribble=False):
    """Run verified rounds until the shared stop round, reporting each one.

    Rank q's expert multiplies what it received by (q + 1), so token t must come back as
    hidden[t] times the sum of (q + 1) over the distinct ranks q of its experts that the
    combine counted (``last_round_active_ranks``), and ``last_round_degraded`` must mark
    exactly the tokens with an expert elsewhere. ``hang=(n, "dispatch"|"combine")`` stops
    before the dispatch, or between dispatch and combine, of this rank's round n (until
    killed). A rank's first round sets the stop round when asked (``shared['stop_after']``).
    With ``scribble`` the rank behaves as a buggy client: each time ``shared['scribbles']`` is
    raised it writes ``shared['scribble']`` over the control block's active mask (only the
    daemon should), and reports it.
    """
    try:
        import torch

        from a2ad.client import MoeAlltoAll

        torch.set_num_threads(1)

        class M:
            moe_ep_rank, moe_ep_size = rank, ep

        size = L.workspace_size_per_rank(ep, MAX_T, HIDDEN * 4, HIDDEN * 4)
        a2a = MoeAlltoAll(M(), MAX_T, TOP_K, EXPERTS, size, job=job, runtime_dir=runtime_dir, timeout=20.0,
                          on_peer_loss="degrade")
        att = a2a.attachment
        flag = att.workspace[rank, att.aux.flag_val : att.aux.flag_val + 4].view(torch.int32)
        results.put((rank, "attached", _now(), (a2a.generation, a2a.active_ranks)))
        g = torch.Generator().manual_seed(seed)
        records = []
        n = 0
        scribbled = 0
        while True:
            if scribble and shared["scribbles"].value > scribbled:
                att.control.set_active_mask(shared["scribble"].value, ep, time.monotonic_ns())
                scribbled = shared["scribbles"].value
                results.put((rank, "scribbled", _now(), scribbled))
            t = int(torch.randint(1, MAX_T + 1, (1,), generator=g))
            experts = torch.rand(t, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
            hidden = torch.randint(-8, 9, (t, HIDDEN), generator=g).to(torch.float32)
            if hang is not None and n == hang[0] and hang[1] == "dispatch":
                results.put((rank, "hanging", _now(), int(flag)))
                time.sleep(3600)
            (recv,) = a2a.dispatch(experts, [hidden], MAX_T)
            if hang is not None and n == hang[0] and hang[1] == "combine":
                results.put((rank, "hanging", _now(), int(flag)))
                time.sleep(3600)
            out = a2a.combine(recv * float(rank + 1), MAX_T)
            done = _now()
            rnd = int(flag) - 1
            counted = _bits(a2a.last_round_active_ranks)
            assert L.mask_from_words(a2a.last_round_active_mask.tolist()) == counted
            sent_mask = a2a._plane.dispatch_mask
            # the reference: only the ranks the combine counted contribute
            lost = check_round(rank, rnd, experts, hidden, out, a2a.last_round_degraded, counted, ep, EXPERTS)
            records.append((rnd, done, counted, sent_mask, lost, t))
            stop = after_round(rank, n, rnd, done, counted, shared, results)
            n += 1
            if stop:
                break
            if pace:
                time.sleep(pace)
        results.put((rank, "records", _now(), records))
        a2a.close()
        results.put((rank, "done", _now(), None))
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback

        results.put((rank, "error", 0.0, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Group(RankReports):
    """Rank processes of one degrade job; every wait on them is bounded, and close() ends
    every process still running (also when the test failed)."""

    def __init__(self, ep, runtime_dir, job):
        self.ctx = mp.get_context("spawn")
        super().__init__(self.ctx)
        self.ep, self.runtime_dir, self.job = ep, str(runtime_dir), job
        self.shared = {
            "done": self.ctx.Array("l", ep, lock=False),
            "mask": self.ctx.Array("l", ep, lock=False),
            "stop": self.ctx.Value("l", 0, lock=False),
            "stop_after": self.ctx.Value("l", 0, lock=False),
            "scribble": self.ctx.Value("l", 0, lock=False),
            "scribbles": self.ctx.Value("l", 0, lock=False),
        }
        self.procs: list = []
        self.by_rank: dict = {}

    def start(self, rank, seed, target=None, **kw):
        """Start rank ``rank``'s process running ``target`` (default :func:`serve`)."""
        p = self.ctx.Process(target=target or serve, args=(rank, self.ep, self.runtime_dir, self.job, self.shared,
                                                           self.results, seed), kwargs=kw, daemon=True)
        p.start()
        self.procs.append(p)
        self.by_rank[rank] = p
        return p

    def start_serving(self, seed, rounds=20, scribbler=None):
        """Start every rank serving (seed ``seed + rank``, 1 ms between rounds; rank
        ``scribbler`` may scribble) and wait until each attached and did ``rounds`` rounds;
        returns the attach reports."""
        for r in range(self.ep):
            self.start(r, seed=seed + r, pace=0.001, scribble=r == scribbler)
        att = self.expect("attached", range(self.ep))
        self.wait_rounds(range(self.ep), rounds)
        return att

    def wait_dropped(self, victim, survivors):
        """Until every survivor's last combine counted no contribution from ``victim``."""
        wait_for(lambda: all(not self.shared["mask"][r] >> victim & 1 for r in survivors), 10,
                 f"survivors without rank {victim}")

    def kill(self, rank):
        """kill -9 the rank's process; what it reported before is forgotten (a replacement reports anew)."""
        p = self.by_rank[rank]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.forget(rank)

    def done(self, rank) -> int:
        return self.shared["done"][rank]

    def close(self):
        self.end_processes(self.procs)


@pytest.fixture
def groups():
    made = []

    def make(ep, runtime_dir, job):
        g = Group(ep, runtime_dir, job)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def rank_state(daemon, job: str, rank: int) -> str | None:
    try:
        return daemon.request("job_info", job=job)["ranks"][rank]["state"]
    except errors.NoSuchJob:
        return None


def ctl(runtime_dir, *args):
    return subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), *args],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))


def metric(text: str, name: str, job: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{job="{job}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for job {job} in the metrics:\n{text}")


def check_sequence(records, rank, victim, expect_join: int | None, stop: int):
    """A survivor's rounds: consecutive, full mask until the switch, then without the victim
    until the replacement's first round, then full again up to the stop round."""
    rounds = [r[0] for r in records]
    assert rounds == list(range(rounds[0], rounds[0] + len(rounds))), f"rank {rank}: rounds not consecutive"
    assert rounds[-1] == stop - 1, f"rank {rank} stopped after round {rounds[-1]}, expected {stop - 1}"
    masks = [r[2] for r in records]
    ep_full = masks[0]
    switch = next(i for i, m in enumerate(masks) if not m >> victim & 1)
    assert all(m == ep_full for m in masks[:switch])
    rejoin = len(masks) if expect_join is None else rounds.index(expect_join)
    assert all(m == ep_full & ~(1 << victim) for m in masks[switch:rejoin]), \
        f"rank {rank}: rounds {rounds[switch]}-{rounds[rejoin - 1]} used masks {sorted(set(masks[switch:rejoin]))}"
    bad = [(r[0], r[2], r[3]) for r in records[rejoin:] if r[2] != ep_full]
    assert not bad, f"rank {rank}: rounds after the rejoin at {expect_join} without every rank: {bad[:10]}"
    return switch, rejoin


# ----------------------------------------------------------------------------- tests
def test_kill9_degrades_then_replacement_rejoins_while_serving(daemon_factory, groups):
    daemon = daemon_factory("--grace", "5")
    ep, victim, job = 4, 2, "degrade4"
    grp = groups(ep, daemon.runtime_dir, job)
    t0 = time.monotonic()
    att = grp.start_serving(seed=100, rounds=40)
    assert all(v == (0, [0, 1, 2, 3]) for _, v in att.values())
    info = daemon.request("job_info", job=job)
    assert info["on_peer_loss"] == "degrade" and info["active_ranks"] == [0, 1, 2, 3] and info["degraded_s"] is None
    survivors = [r for r in range(ep) if r != victim]
    # kill -9 rank 2 in the middle of its rounds
    t_kill = _now()
    grp.kill(victim)
    victim_rounds = grp.done(victim)
    grp.wait_dropped(victim, survivors)
    grp.wait_rounds(survivors, 100, what="degraded rounds")
    # what the daemon and a2ad-ctl show now
    info = daemon.request("job_info", job=job)
    assert info["state"] == "degraded" and info["abort"] == "none", info
    assert info["active_ranks"] == [0, 1, 3] and info["degraded_s"] > 0, info
    assert info["ranks"][victim]["state"] == "dead"
    out = ctl(daemon.runtime_dir, "job", job)
    assert out.returncode == 0, out.stderr
    print("\n" + out.stdout.strip())
    assert "policy  degrade" in out.stdout and "active  ranks 0-1,3 of 4 (mask 0xb," in out.stdout and "degraded for" in out.stdout
    js = json.loads(ctl(daemon.runtime_dir, "--json", "job", job).stdout)
    assert js["active_ranks"] == [0, 1, 3] and js["active_mask"] == 0b1011 and js["mask_generation"] == 1
    assert js["active_mask_hex"] == "0xb" and L.mask_from_bytes(info["active_mask"]) == 0b1011
    text = daemon.request("metrics")["text"]
    assert metric(text, "a2ad_job_active_ranks", job) == 3
    assert metric(text, "a2ad_job_active_mask", job) == 0b1011
    assert metric(text, "a2ad_job_degraded_seconds", job) > 0
    # a replacement joins as rank 2 while the others serve; 150 rounds after its first one, all stop
    grp.shared["stop_after"].value = 150
    t_join = _now()
    grp.start(victim, seed=900, pace=0.001)
    (t_att, (gen, active)), = grp.expect("attached", [victim]).values()
    assert gen == 0 and active == [0, 1, 3]  # no job-wide re-arm; not in the rounds before its first dispatch
    (t_first, first), = grp.expect("first", [victim]).values()
    stop = grp.shared["stop"].value
    assert stop == first + 150
    recs = {r: v for r, (_, v) in grp.expect("records", range(ep), timeout=60).items()}
    grp.expect("done", range(ep))
    # every survivor: full rounds, then rounds without rank 2 from the switch on, full again from
    # the replacement's first round; the replacement's rounds are all full
    total = victim_rounds
    worst_death, worst_join, straddles = 0.0, 0.0, 0
    for r in survivors:
        switch, rejoin = check_sequence(recs[r], r, victim, first, stop)
        times = [x[1] for x in recs[r]]
        gaps = [(b - a, a, b) for a, b in zip(times, times[1:])]
        death_gap = max(g for g, a, b in gaps if b >= t_kill and a <= t_kill + 1.0)  # the death and the second after
        join_gap = max(g for g, a, b in gaps if a >= t_join and b <= t_first + 0.5)
        worst_death, worst_join = max(worst_death, death_gap), max(worst_join, join_gap)
        straddles += sum(1 for x in recs[r][switch:switch + 3] if x[3] >> victim & 1)
        # rounds without rank 2 lost exactly the tokens with an expert there (checked in the rank)
        assert sum(x[4] for x in recs[r][switch:rejoin]) > 0
        total += len(recs[r])
    assert [x[0] for x in recs[victim]] == list(range(first, stop))
    assert all(x[2] == 0b1111 and x[3] == 0b1111 and x[4] == 0 for x in recs[victim])
    total += len(recs[victim])
    degraded_rounds = rejoin - switch
    print(f"host, 4 ranks, kill -9 of rank {victim} while rounds ran: longest gap between two completed rounds "
          f"across the death {worst_death * 1e3:.1f} ms, during the replacement's join {worst_join * 1e3:.1f} ms; "
          f"{degraded_rounds} rounds without rank {victim} (on rank 3), {straddles} straddling round(s) whose dispatch "
          f"still sent to it; "
          f"replacement attached {1e3 * (t_att - t_join):.0f} ms after its start, first round {first} "
          f"{1e3 * (t_first - t_att):.1f} ms after attaching; {total} verified rounds in all; "
          f"{time.monotonic() - t0:.1f} s")
    assert worst_death < 2.0, f"the survivors stalled {worst_death:.3f} s across the death"
    assert worst_join < 2.0, f"the survivors stalled {worst_join:.3f} s during the join"
    assert total >= 200
    info = daemon.request("job_info", job=job)
    assert info["readmits"] == 1 and info["generation"] == 0 and info["rearms"] == 0
    assert info["active_ranks"] == []  # every rank has left by now
    text = daemon.request("metrics")["text"]
    assert "a2ad_readmits_total 1.0" in text


def test_the_daemon_keeps_its_own_active_mask(daemon_factory, groups):
    """The control block's active mask is the daemon's published copy, in memory the job's
    clients can write. After rank 2 died, rank 0, a buggy client, writes it back to "every
    rank active": the daemon puts its own mask back within about a second and the survivors
    serve on (their waits let rank 2 go again). Rank 0 writes it once more and rank 1 is
    killed at once: the daemon's decision on rank 1 starts from its own mask (ranks 0 and 1),
    not from what the client wrote, and rank 0 serves on alone, every round verified."""
    daemon = daemon_factory("--grace", "5")
    ep, job = 3, "scribble3"
    grp = groups(ep, daemon.runtime_dir, job)
    grp.start_serving(seed=300, scribbler=0)
    grp.kill(2)
    grp.wait_dropped(2, (0, 1))
    grp.wait_rounds([0, 1], 20, what="rounds without rank 2")
    info = daemon.request("job_info", job=job)
    assert L.mask_from_bytes(info["active_mask"]) == 0b011 and info["mask_generation"] == 1, info
    assert info["mask_restores"] == 0, info
    grp.shared["scribble"].value = 0b111
    grp.shared["scribbles"].value = 1
    grp.expect("scribbled", [0])
    wait_for(lambda: daemon.request("job_info", job=job)["mask_restores"] == 1, 10, "the copy put back")
    grp.wait_rounds([0, 1], 20, what="rounds after the copy was put back")
    info = daemon.request("job_info", job=job)
    assert L.mask_from_bytes(info["active_mask"]) == 0b011 and info["active_ranks"] == [0, 1], info
    grp.shared["scribbles"].value = 2
    grp.expect("scribbled", [0])
    grp.kill(1)
    wait_for(lambda: L.mask_from_bytes(daemon.request("job_info", job=job)["active_mask"]) == 0b001, 10,
             "the daemon dropping rank 1")
    wait_for(lambda: grp.shared["mask"][0] == 0b001, 30, "rank 0 counting itself alone")
    grp.wait_rounds([0], 20, what="rounds of rank 0 alone")
    info = daemon.request("job_info", job=job)
    assert L.mask_from_bytes(info["active_mask"]) == 0b001 and info["active_ranks"] == [0], info
    assert info["ranks"][1]["state"] == "dead" and info["ranks"][2]["state"] == "dead"
    out = ctl(daemon.runtime_dir, "job", job)
    assert out.returncode == 0 and "put back" in out.stdout, out.stdout + out.stderr
    text = daemon.request("metrics")["text"]
    assert metric(text, "a2ad_job_active_mask", job) == 0b001
    assert "a2ad_mask_restores_total" in text
    grp.shared["stop"].value = 1  # rank 0 stops after its next round
    recs = grp.expect("records", [0], timeout=60)[0][1]
    grp.expect("done", [0])
    rounds = [x[0] for x in recs]
    assert rounds == list(range(rounds[0], rounds[0] + len(rounds)))  # every round verified in the rank
    assert recs[-1][2] == 0b001


@pytest.mark.full
def test_straddling_rounds_decided_by_the_combine_view(daemon_factory, groups):
    """Deterministic straddles: rank 1 stops before its dispatch (the others sent to it and
    wait in dispatch), is killed; a replacement stops between its dispatch and combine (the
    others wait in combine), is killed; a second replacement runs to the end."""
    daemon = daemon_factory("--grace", "5")
    ep, victim, job = 3, 1, "straddle3"
    grp = groups(ep, daemon.runtime_dir, job)
    survivors = [0, 2]
    grp.start(0, seed=10)
    grp.start(2, seed=12)
    grp.start(victim, seed=11, hang=(20, "dispatch"))
    grp.expect("attached", range(ep))
    (_, hang_round), = grp.expect("hanging", [victim]).values()
    time.sleep(0.3)  # the others are in the dispatch of hang_round, waiting for rank 1
    before = [grp.done(r) for r in survivors]
    assert before == [20, 20]
    grp.kill(victim)
    grp.wait_rounds(survivors, 20)
    # a replacement that stops between dispatch and combine of its 11th round
    grp.start(victim, seed=21, hang=(10, "combine"))
    grp.expect("attached", [victim])
    (_, first1), = grp.expect("first", [victim]).values()
    (_, hang_round2), = grp.expect("hanging", [victim]).values()
    time.sleep(0.3)  # the others wait in the combine of hang_round2 for rank 1's combine flag
    grp.kill(victim)
    grp.wait_rounds(survivors, 20)
    grp.shared["stop_after"].value = 30
    grp.start(victim, seed=31)
    (_, first2), = grp.expect("first", [victim]).values()
    stop = grp.shared["stop"].value
    recs = {r: v for r, (_, v) in grp.expect("records", [0, 2, victim], timeout=60).items()}
    grp.expect("done", [0, 2, victim])
    for r in survivors:
        by_round = {x[0]: x for x in recs[r]}
        # 1: sent to rank 1 (its bit was set at dispatch), counted without it
        x = by_round[hang_round]
        assert x[3] == 0b111 and x[2] == 0b101, (r, x)
        # 2: rank 1 had dispatched (the others received its tokens and sent it theirs), never combined
        x = by_round[hang_round2]
        assert x[3] == 0b111 and x[2] == 0b101, (r, x)
        assert all(by_round[i][2] == 0b111 for i in range(first1, hang_round2))
        assert all(by_round[i][2] == 0b101 for i in range(hang_round, first1))
        assert all(by_round[i][2] == 0b101 for i in range(hang_round2, first2))
        assert all(by_round[i][2] == 0b111 for i in range(first2, stop))
    print(f"\nstraddles: round {hang_round} (rank 1 never dispatched) and round {hang_round2} (rank 1 dispatched, "
          f"never combined) counted without rank 1 on both survivors; replacements let in at rounds {first1} "
          f"and {first2}")


def test_degraded_job_survives_a_daemon_restart(runtime_dir, groups):
    """The policy (in the spec, in the state file) and the mask (the daemon's record in the
    state file, its published copy in the control block kept with the workspaces) outlive a
    kill -9 of the daemon: the survivors serve on while no
    daemon runs, the next daemon shows the same mask, and a replacement joins through it."""
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
    d2 = None
    ep, victim, job = 3, 2, "restart3"
    grp = groups(ep, runtime_dir, job)
    try:
        grp.start_serving(seed=40)
        grp.kill(victim)
        grp.wait_dropped(victim, (0, 1))
        since = d1.request("job_info", job=job)["degraded_s"]
        d1.kill9()
        grp.wait_rounds([0, 1], 50, what="rounds with no daemon")
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
        info = d2.request("job_info", job=job)
        assert info["on_peer_loss"] == "degrade" and info["spec"]["on_peer_loss"] == "degrade"
        assert info["active_ranks"] == [0, 1] and info["abort"] == "none" and info["state"] == "degraded", info
        assert info["ranks"][victim]["state"] == "dead" and info["degraded_s"] >= since
        grp.wait_rounds([0, 1], 20, what="rounds after the restart")
        grp.shared["stop_after"].value = 40
        grp.start(victim, seed=50, pace=0.001)
        (_, first), = grp.expect("first", [victim]).values()
        stop = grp.shared["stop"].value
        recs = {r: v for r, (_, v) in grp.expect("records", range(ep), timeout=60).items()}
        grp.expect("done", range(ep))
        for r in (0, 1):
            check_sequence(recs[r], r, victim, first, stop)
        assert [x[0] for x in recs[victim]] == list(range(first, stop))
        text = d2.request("metrics")["text"]
        assert "a2ad_readmits_total 1.0" in text
        print(f"\ndaemon kill -9 and restart while degraded: mask kept (ranks [0, 1]), replacement let in at "
              f"round {first} through the new daemon")
        assert d2.stop() == 0
    finally:
        grp.close()
        d1.kill9()
        if d2 is not None:
            d2.kill9()
        reap_keeper(runtime_dir)


@pytest.mark.full
def test_a_rank_that_died_while_no_daemon_ran_is_dropped_not_aborted(runtime_dir, groups):
    """A degrade job whose rank dies while no daemon runs: the next daemon, adopting the job,
    finds the rank gone and clears its bit as a live daemon would (no abort word), so the
    survivors, waiting for it meanwhile, serve on."""
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
    d2 = None
    ep, victim, job = 3, 1, "away3"
    grp = groups(ep, runtime_dir, job)
    try:
        grp.start_serving(seed=60)
        d1.kill9()
        grp.kill(victim)
        t0 = time.monotonic()
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
        info = d2.request("job_info", job=job)
        assert info["abort"] == "none" and info["active_ranks"] == [0, 2], info
        assert info["ranks"][victim]["state"] == "dead" and info["state"] == "degraded", info
        grp.wait_rounds([0, 2], 30, what="rounds after the adopting daemon dropped the rank")
        print(f"\nrank {victim} died while no daemon ran: the next daemon dropped it from the mask and the "
              f"survivors served on {time.monotonic() - t0:.2f} s after the death")
        grp.shared["stop"].value = max(grp.done(0), grp.done(2)) + 10  # rounds are numbered from 1, as done counts
        grp.expect("done", [0, 2], timeout=60)
        assert d2.stop() == 0
    finally:
        grp.close()
        d1.kill9()
        if d2 is not None:
            d2.kill9()
        reap_keeper(runtime_dir)


def test_a_join_with_another_policy_is_refused(daemon):
    """on_peer_loss is part of the spec: a join with the other value is refused naming the field
    and both values, and the rank already waiting in the rendezvous hears it too."""
    from a2ad.client import attach

    rd = daemon.runtime_dir
    kw = dict(runtime_dir=rd, max_num_tokens=4, top_k=1, num_experts=2, workspace_size_per_rank=1 << 16, timeout=20)

    def first_rank(job, policy, into):
        try:
            attach(job, 0, 2, on_peer_loss=policy, **kw).close()
            into[job] = "attached"
        except errors.A2ADError as exc:
            into[job] = exc

    for job, held, joining in (("policy", "degrade", "raise"), ("policy2", "raise", "degrade")):
        waiting: dict = {}
        th = threading.Thread(target=first_rank, args=(job, held, waiting))
        th.start()
        try:
            wait_for(lambda: rank_state(daemon, job, 0) == "joining", 10, "rank 0 waiting")
            with pytest.raises(errors.SpecMismatch) as ei:
                attach(job, 1, 2, on_peer_loss=joining, **kw)
            assert ei.value.details["field"] == "on_peer_loss"
            assert ei.value.details["job_value"] == held and ei.value.details["requested"] == joining
            assert f"on_peer_loss differs (job has {held}, join asked for {joining})" in str(ei.value)
        finally:
            th.join(30)
        # the rank already waiting in the rendezvous hears it too
        assert isinstance(waiting[job], errors.SpecMismatch) and waiting[job].details["field"] == "on_peer_loss"
    with pytest.raises(errors.InvalidField, match="on_peer_loss"):
        attach("policy3", 0, 1, on_peer_loss="ignore", **kw)


def test_effective_mask_and_admission_fields():
    """The control-block fields a replacement goes through (no daemon: a private block)."""
    from a2ad.control import ControlBlock

    cb = ControlBlock(bytearray(L.CONTROL_BLOCK_SIZE))
    cb.initialize(4, L.POLICY_DEGRADE)
    assert cb.degrade and cb.active_mask == 0b1111 and cb.mask_generation == 0 and cb.degraded_since_ns == 0
    assert cb.effective_mask(4, 1) == 0b1111
    assert cb.set_active_mask(0b1011, 4, 123) and cb.mask_generation == 1 and cb.degraded_since_ns == 123
    assert not cb.set_active_mask(0b1011, 4, 456) and cb.mask_generation == 1
    assert cb.set_active_mask(0b1001, 4, 789) and cb.degraded_since_ns == 123  # degraded since the first loss
    cb.set_admit_round(2, L.ADMIT_JOINED)
    assert cb.set_active_mask(0b1101, 4, 999)
    assert cb.effective_mask(4, 50) == 0b1001 and cb.admitted_mask(4) == 0b1001  # joined, not let in yet
    cb.set_admit_round(2, 51)
    assert cb.effective_mask(4, 50) == 0b1001 and cb.effective_mask(4, 51) == 0b1101
    assert cb.admitted_mask(4) == 0b1101
    assert cb.set_active_mask(0b1111, 4, 1000) and cb.degraded_since_ns == 0


def test_on_peer_loss_in_the_spec():
    """The join schema takes on_peer_loss; a spec without it asks for the default, so a join
    without it is compared as "raise"."""
    from a2ad import protocol

    spec = {"max_num_tokens": 4, "top_k": 1, "num_experts": 2, "workspace_size_per_rank": 1 << 16}
    req = protocol.parse_request(protocol.encode_request(
        "join", 1, job="j", ep_rank=0, ep_size=2, spec={**spec, "on_peer_loss": "degrade"}, pid=1, device="host"))
    assert req.fields["spec"]["on_peer_loss"] == "degrade"
    assert protocol.normalize_spec(spec, 2)["on_peer_loss"] == "raise"
    assert protocol.normalize_spec({**spec, "on_peer_loss": "degrade"}, 2)["on_peer_loss"] == "degrade"
    with pytest.raises(errors.InvalidField) as ei:
        protocol.parse_request(protocol.encode_request(
            "join", 1, job="j", ep_rank=0, ep_size=2, spec={**spec, "on_peer_loss": "retry"}, pid=1, device="host"))
    assert ei.value.details["field"] == "spec.on_peer_loss"


def _in_threads(ranks, step) -> dict:
    """``{r: step(r)}``, each rank's step in its own thread, all at once; fails the test if a
    step raised or did not end within 30 s."""
    out: dict = {}

    def run(r):
        try:
            out[r] = step(r)
        except BaseException as exc:  # noqa: BLE001 - the thread's outcome goes to the test
            out[r] = exc

    ths = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not any(th.is_alive() for th in ths), "a rank's step did not end within 30 s"
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    return out


def test_a_degraded_wait_counts_exactly_the_flags_it_saw():
    """The host plane's wait in a degraded view (rank 1 already gone): rank 2 leaves the mask
    while rank 3, still in it, has not published; the wait goes on for rank 3 (and times out
    naming it) instead of counting it unseen. And a rank that publishes its flag, finishes and
    leaves between the wait's read of the flags and its read of the mask is counted: what it
    published is complete."""
    import torch

    from a2ad.client import local
    from a2ad.client.host_plane import HostPlane

    ep, rnd = 4, 5
    ws = torch.zeros(ep, L.workspace_size_per_rank(ep, 4, 64, 64), dtype=torch.uint8)
    shared = local._Shared(ws, ep)
    cb = shared.control
    cb.initialize(ep, L.POLICY_DEGRADE)
    att = local.LocalAttachment(ws, 0, ep, 4, L.aux_layout(ep, 4), shared, 0).spec_for(2, 8)
    att.spec["on_peer_loss"] = "degrade"
    plane = HostPlane(att, timeout=0.3)
    flags = plane._combine_flags[0]  # row 0: one flag per source
    flags.fill_(rnd - 1)
    flags[0] = rnd
    view = 0b1101  # ranks 0, 2, 3: rank 1 left before this round
    cb.set_active_mask(0b1001, ep, time.monotonic_ns())  # rank 2 left too; rank 3 is still in the mask
    with pytest.raises(errors.PeerTimeout) as exc:
        plane._wait(flags, rnd, L.PHASE_COMBINE, view)
    assert exc.value.details["peer"] == 3
    cb.clear_status(0)
    real = cb.first_effective

    def publish_and_leave(mask, round, rows=None):  # rank 3 publishes, finishes its round and leaves, right now
        flags[3] = rnd
        cb.set_active_mask(0b0001, ep, time.monotonic_ns())
        return real(mask, round, rows)

    cb.first_effective = publish_and_leave
    assert plane._wait(flags, rnd, L.PHASE_COMBINE, view) == 0b1001  # rank 3 counted, rank 2 not


@pytest.mark.parametrize("in_row", [False, True], ids=["control-block", "row"])
def test_two_replacements_let_in_at_the_same_round_do_not_wait_for_each_other(in_row):
    """Host planes of 4 ranks as threads on one workspace, degrade policy: ranks 2 and 3 leave
    the mask, ranks 0 and 1 serve on; replacements of both join at once (rows re-initialized,
    admit rounds ADMIT_JOINED, bits set; with ``in_row`` the admit rounds kept in their rows,
    as across nodes) and ask to be let in together. The lowest rank lets both in at the same
    round; neither waits for the other's round before it (neither took part in it), and
    every rank then runs full rounds whose combine equals the float64 reference."""
    import torch

    from a2ad.client import local
    from a2ad.client.host_plane import HostPlane

    ep, T, top_k, experts_n, hidden = 4, 6, 2, 8, 16
    size = L.workspace_size_per_rank(ep, T, 4 * hidden, 4 * hidden)
    ws = torch.zeros(ep, size, dtype=torch.uint8)
    aux = L.aux_layout(ep, T)
    shared = local._Shared(ws, ep)
    cb = shared.control
    cb.initialize(ep, L.POLICY_DEGRADE)
    for r in range(ep):
        ws[r, aux.flag_val: aux.flag_val + 4].view(torch.int32).fill_(L.INITIAL_ROUND)

    def plane(r):
        att = local.LocalAttachment(ws, r, ep, T, aux, shared, 0).spec_for(top_k, experts_n)
        att.spec["on_peer_loss"] = "degrade"
        return HostPlane(att, timeout=20.0)

    planes = {r: plane(r) for r in range(ep)}
    pl = L.payload_layout(aux, size, T, [4 * hidden], 4 * hidden)
    owner = [L.expert_owner(e, experts_n, ep) for e in range(experts_n)]
    gen = torch.Generator().manual_seed(3)

    def one_round(r):
        experts = torch.rand(T, experts_n, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32).contiguous()
        x = torch.randint(-8, 9, (T, hidden), generator=gen).to(torch.float32)
        p = planes[r]
        p.dispatch(experts, [x], T, pl, experts_n)
        recv = ws[r, pl.dispatch_offsets[0]: pl.dispatch_offsets[0] + ep * T * 4 * hidden]
        y = recv.view(torch.float32).view(ep, T, hidden) * float(r + 1)
        got = p.combine(y, T, T, pl, False)
        counted = p.combine_mask
        w = torch.tensor([sum(q + 1 for q in {owner[int(e)] for e in row} if counted >> q & 1)
                          for row in experts], dtype=torch.float64)
        return counted, torch.equal(got.double(), x.double() * w[:, None])

    def rounds(ranks, n=1):
        for _ in range(n):
            yield _in_threads(ranks, one_round)

    for out in rounds(range(ep), 2):
        assert all(v == (0b1111, True) for v in out.values()), out
    cb.set_active_mask(0b0011, ep, time.monotonic_ns())  # ranks 2 and 3 are gone
    for out in rounds([0, 1], 3):
        assert all(v == (0b0011, True) for v in out.values()), out
    # replacements of 2 and 3 join together: rows re-initialized, admit rounds, then the bits
    word = aux.block_counters + 4 * L.SLOT_ADMIT_ROUND
    for q in (2, 3):
        ws[q, : aux.aux_bytes].zero_()
        ws[q, aux.flag_val: aux.flag_val + 4].view(torch.int32).fill_(L.INITIAL_ROUND)
        if in_row:
            ws[q, word: word + 4].view(torch.int32).fill_(L.ADMIT_JOINED)
        cb.set_admit_round(q, L.ADMIT_ROW if in_row else L.ADMIT_JOINED)
        planes[q] = plane(q)
    cb.set_active_mask(0b1111, ep, time.monotonic_ns())
    # both replacements' first dispatches ask to be let in (and wait) before the survivors'
    # next round, so the lowest rank lets both in at the same round; every rank then runs
    # rounds until the shared stop round
    rows = ws[:, word: word + 4].view(torch.int32)[:, 0]
    done: dict[int, list] = {r: [] for r in range(ep)}
    stop = [None]

    def serve(r):
        while True:
            try:
                done[r].append(one_round(r))
            except BaseException as exc:  # noqa: BLE001 - the thread's outcome goes to the test
                done[r].append(exc)
                return
            rnd = int(ws[r, aux.flag_val: aux.flag_val + 4].view(torch.int32)) - 1
            while stop[0] is None and rnd >= 40:  # (a bound: the test sets stop long before)
                time.sleep(0.001)
            if stop[0] is not None and rnd + 1 >= stop[0]:
                return

    ths = {q: threading.Thread(target=serve, args=(q,)) for q in (2, 3)}
    for th in ths.values():
        th.start()
    wait_for(lambda: all(cb.admit_of(q, rows) == L.ADMIT_READY for q in (2, 3)), 10, "both replacements to ask")
    for r in (0, 1):
        ths[r] = threading.Thread(target=serve, args=(r,))
        ths[r].start()
    wait_for(lambda: all(done[q] for q in (2, 3)) or any(isinstance(v, BaseException) for d in done.values() for v in d),
             30, "both replacements' first rounds")
    stop[0] = max(int(ws[r, aux.flag_val: aux.flag_val + 4].view(torch.int32)) for r in range(ep)) + 3
    for th in ths.values():
        th.join(30)
    assert not any(th.is_alive() for th in ths.values()), "a rank did not reach the stop round within 30 s"
    results = [v for d in done.values() for v in d]
    assert not any(isinstance(v, BaseException) for v in results), done
    assert all(ok for _, ok in results), done  # every round's combine equals the reference
    assert all(done[q][0][0] == 0b1111 for q in (2, 3)), done  # their first round is a full one
    assert all(done[r][-1][0] == 0b1111 for r in range(ep)), done
    admits = [cb.admit_of(q, rows) for q in (2, 3)]
    assert admits[0] == admits[1] >= 0, admits  # both let in at the same round
    if in_row:
        assert cb.admit_round(2) == cb.admit_round(3) == L.ADMIT_ROW
    for out in rounds(range(ep), 2):
        assert all(v == (0b1111, True) for v in out.values()), out


class _TwoNodes:
    """Host planes of 3 ranks as threads on one workspace, degrade policy, two control blocks
    (two nodes: ranks 0 and 1 on one, rank 2 on the other); rank 2's wait times out in 1 s."""

    ep, T, top_k, experts_n, hidden = 3, 4, 2, 6, 8

    def __init__(self, seed: int = 5):
        import torch

        from a2ad.client import local
        from a2ad.client.host_plane import HostPlane

        ep, T = self.ep, self.T
        size = L.workspace_size_per_rank(ep, T, 4 * self.hidden, 4 * self.hidden)
        aux = L.aux_layout(ep, T)
        self.pl = L.payload_layout(aux, size, T, [4 * self.hidden], 4 * self.hidden)
        self.gen = torch.Generator().manual_seed(seed)
        ws = self.ws = torch.zeros(ep, size, dtype=torch.uint8)
        for r in range(ep):
            ws[r, aux.flag_val: aux.flag_val + 4].view(torch.int32).fill_(L.INITIAL_ROUND)
        nodes = [local._Shared(ws, ep), local._Shared(ws, ep)]
        for n in nodes:
            n.control.initialize(ep, L.POLICY_DEGRADE)
        self.cb_a = nodes[0].control

        def plane(r, timeout):
            att = local.LocalAttachment(ws, r, ep, T, aux, nodes[r // 2], 0).spec_for(self.top_k, self.experts_n)
            att.spec["on_peer_loss"] = "degrade"
            return HostPlane(att, timeout=timeout)

        self.planes = {0: plane(0, 20.0), 1: plane(1, 20.0), 2: plane(2, 1.0)}

    def inputs(self):
        import torch

        experts = torch.rand(self.T, self.experts_n, generator=self.gen).argsort(dim=1)[:, :self.top_k]
        x = torch.randint(-8, 9, (self.T, self.hidden), generator=self.gen).to(torch.float32)
        return experts.to(torch.int32).contiguous(), x

    def expert_out(self, r):
        import torch

        pl, ep, T = self.pl, self.ep, self.T
        recv = self.ws[r, pl.dispatch_offsets[0]: pl.dispatch_offsets[0] + ep * T * 4 * self.hidden]
        return recv.view(torch.float32).view(ep, T, self.hidden) * float(r + 1)

    def send(self, r, inputs=None):
        experts, x = inputs or self.inputs()
        self.planes[r].dispatch(experts, [x], self.T, self.pl, self.experts_n)

    def combine(self, r):
        return self.planes[r].combine(self.expert_out(r), self.T, self.T, self.pl, False)

    def full_round(self):
        def step(r):
            self.send(r)
            return self.combine(r)

        _in_threads(range(self.ep), step)

    def drop_2_in_node_a(self, after: float):
        """Clear rank 2's bit in the first node's block ``after`` seconds from now (its node
        counted lost there while rank 2 runs on)."""
        t = threading.Timer(after, lambda: self.cb_a.set_active_mask(0b011, self.ep, time.monotonic_ns()))
        t.start()
        return t

    def owners(self, experts):
        import torch

        return torch.tensor([[L.expert_owner(int(e), self.experts_n, self.ep) for e in row] for row in experts])


def test_a_rank_dropped_while_alive_never_completes_a_round_with_outputs_not_meant_for_it():
    """Rank 2's node is counted lost by the first node (bit 2 cleared there) while rank 2 runs
    on with a whole view, as when its daemon stalls (_TwoNodes). (1) Ranks 0 and 1 let rank 2
    go in their dispatch before its tokens came: their combine publishes its flag to rank 2
    with the void descriptor, so rank 2's combine completes at once counting only its own rows
    (every token with an expert on rank 0 or 1 marked degraded) instead of pulling rows
    computed from slots it never filled, or waiting until its timeout for a flag that would
    never come; and they leave rank 2 out of the view they publish before they restage. (2)
    Ranks 0 and 1 finish a round with rank 2 (its tokens came), then run the next round
    without it, restaging their regions, before rank 2 pulls: rank 2's combine raises PeerLost
    "left behind" naming rank 0 instead of returning what it pulled."""
    import torch

    # (1) let go of in the dispatch, before its tokens came
    w = _TwoNodes()
    w.full_round()
    t0 = w.drop_2_in_node_a(0.3)
    _in_threads([0, 1], w.send)
    t0.join()
    assert w.planes[0]._dispatch_got == 0b011
    # the view they publish no longer holds rank 2 (the left-behind check of a rank let go of
    # while it still pulls the round before reads it)
    assert all(L.mask_from_words(w.planes[r]._views[r].tolist()) == 0b011 for r in (0, 1))
    _in_threads([0, 1], w.combine)  # rank 2 left their mask
    experts, x = w.inputs()
    w.send(2, (experts, x))  # ranks 0 and 1 flagged their sends to it
    t = time.monotonic()
    out = w.combine(2)
    assert time.monotonic() - t < 0.5  # (its wait's timeout is 1 s)
    assert w.planes[2].combine_mask == 0b100
    owners = w.owners(experts)
    own = (owners == 2).any(1)
    assert torch.equal(out, x * 3.0 * own.unsqueeze(1).float())
    assert torch.equal(w.planes[2].degraded_tokens(), (owners != 2).any(1))
    assert (owners != 2).any(), "the inputs sent nothing to ranks 0 and 1: the case shows nothing"

    # (2) a round with it, then the next without it, before it pulled
    w = _TwoNodes()
    w.full_round()
    _in_threads(range(w.ep), w.send)
    t0 = w.drop_2_in_node_a(0.3)
    _in_threads([0, 1], w.combine)  # let go of rank 2
    t0.join()
    _in_threads([0, 1], w.send)
    _in_threads([0, 1], w.combine)  # regions restaged
    with pytest.raises(errors.PeerLost) as lost:
        w.combine(2)
    assert lost.value.details["reason_name"] == "left behind" and lost.value.rank == 0, lost.value
    assert "went on to round" in str(lost.value)


def test_the_host_plane_takes_these_decisions_from_planerules():
    """With the historical bug re-introduced in a2ad.planerules (a2ad.mutations), the host plane
    behaves as before its fix: the rules are the code that runs, not a copy of it."""
    from a2ad import mutations

    w = _TwoNodes()
    w.full_round()
    _in_threads(range(w.ep), w.send)
    rnd = int(w.planes[2]._flag_val.item())
    for q in (0, 1):
        w.planes[2]._combine_ready[2, q] = L.COMBINE_SPEC_VOID << 32 | (rnd + 1)
        w.planes[2]._combine_flags[2, q] = rnd + 1
    with mutations.enabled("void_flag_overruns_wait"), pytest.raises(errors.PeerTimeout):
        w.combine(2)

    w = _TwoNodes()
    w.full_round()
    t0 = w.drop_2_in_node_a(0.3)
    with mutations.enabled("view_not_narrowed"):
        _in_threads([0, 1], w.send)
    t0.join()
    assert w.planes[0]._dispatch_got == 0b011
    assert L.mask_from_words(w.planes[0]._views[0].tolist()) == 0b111


def test_a_void_flag_of_the_next_round_over_the_one_not_yet_read_ends_the_combine():
    """Ranks 0 and 1 finished round R with rank 2 (it was stalled in its combine wait of R
    before their flags of R reached it), then let it go in their dispatch of R + 1 (its bit
    cleared in their block) and sent it their void flag of R + 1, over their flags of R that it
    had not read yet. Rank 2's combine of R ends at once counting nothing from them (their
    regions hold R + 1's outputs), marking its tokens that went there, instead of waiting
    until its timeout for flags that are gone."""
    import torch

    w = _TwoNodes()
    w.full_round()
    experts, x = w.inputs()
    _in_threads(range(w.ep), lambda r: w.send(r, (experts, x) if r == 2 else None))
    rnd = int(w.planes[2]._flag_val.item())
    # what ranks 0 and 1 leave in rank 2's row once round R + 1's combine let it go
    p2 = w.planes[2]
    for q in (0, 1):
        p2._combine_ready[2, q] = L.COMBINE_SPEC_VOID << 32 | (rnd + 1)
        p2._combine_flags[2, q] = rnd + 1
    t = time.monotonic()
    out = w.combine(2)
    assert time.monotonic() - t < 0.5  # (its wait's timeout is 1 s)
    assert p2.combine_mask == 0b100
    owners = w.owners(experts)
    assert torch.equal(out, x * 3.0 * (owners == 2).any(1).unsqueeze(1).float())
    assert torch.equal(p2.degraded_tokens(), (owners != 2).any(1))
    assert int(p2._flag_val.item()) == rnd + 1
