"""ep_size 256 on one host-backend daemon: rendezvous, verified rounds, degraded mode with a rank
above 64 killed and replaced, recover() of a raise job, a daemon restart re-adopting the job,
and masks above bit 63 in a2ad-ctl, the metrics, the state file and the protocol.

256 processes that each import torch do not fit a small machine, so the ranks are threads:
a few processes of 64 rank threads each (as tests/test_domain.py runs 64 ranks in one
process), plus one process that holds the victim rank alone, so that kill -9 of that process
loses exactly one rank. Each thread is a complete rank: its own MoeAlltoAll, attachment, lease
connection and mapping of all 256 rows; the threads of a process share only the interpreter.
Figures (rendezvous time on the client and daemon side, round times) print with ``-s``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from a2ad import errors, layout as L
from helpers import DaemonProcess, RankReports, reap_keeper, wait_for
from test_degraded import check_sequence, ctl

EP = 256
HIDDEN, TOP_K, MAX_T = 16, 2, 4
EXPERTS = 2 * EP
#: Ranks per process (the fd table of a process holds 257 fds per attaching rank for a moment).
PER_PROC = 64
#: Ranks a caller's active_rank_mask leaves out (raise test): words 1, 2 and 3 of the mask.
EXCLUDED = (70, 130, 255)


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# ----------------------------------------------------------------------- rank bodies
def verify(rank, rnd, experts, hidden, out, degraded, counted, policy) -> None:
    """Token t must come back as hidden[t] times the sum of (q + 1) over the distinct ranks q
    of its experts that the combine counted; a degrade job's indicator marks exactly the
    tokens with an expert on an uncounted rank. Vectorized over tokens (a loop over top_k)."""
    import torch

    base, rem = L.expert_partition(EXPERTS, EP)
    e = experts.long()
    split = rem * (base + 1)
    owner = torch.where(e < split, e // (base + 1), rem + (e - split) // base)
    present = torch.tensor([bool(counted >> q & 1) for q in range(EP)])
    weight = torch.zeros(experts.shape[0])
    lost = torch.zeros(experts.shape[0], dtype=torch.bool)
    for k in range(TOP_K):
        repeat = (owner[:, :k] == owner[:, k : k + 1]).any(1) if k else torch.zeros_like(lost)
        here = present[owner[:, k]]
        weight += (here & ~repeat).float() * (owner[:, k] + 1).float()
        lost |= ~here
    expected = hidden * weight[:, None]
    if not torch.equal(out, expected):
        raise AssertionError(f"rank {rank} round {rnd} (ranks {L.format_ranks(counted)}): combine differs by "
                             f"{(out - expected).abs().max().item()}")
    if policy == "degrade" and not torch.equal(degraded, lost):
        raise AssertionError(f"rank {rank} round {rnd}: indicator {degraded.tolist()} != {lost.tolist()}")


def rank_thread(rank, runtime_dir, job, policy, shared, results, seed):
    """One rank: attach, then run verified rounds while the next round is below
    ``shared['stop']``; once ``shared['final']`` is set, a rank at the stop round reports its
    records ``(round, time, ranks counted, caller mask used)`` and closes. A raise job's rank
    that gets PeerLost calls recover() and goes on. While ``shared['first_sets_stop']`` is set,
    a rank's first round is not held back by the stop round, and that rank then sets the stop
    round that many rounds after its first (a replacement). Every call passes an active_rank_mask of MASK_WORDS
    words: all ones, or from round ``shared['mask_from']`` on all ranks but EXCLUDED (which
    then run no more rounds)."""
    try:
        import torch

        from a2ad.client import MoeAlltoAll

        class M:
            moe_ep_rank, moe_ep_size = rank, EP

        size = L.workspace_size_per_rank(EP, MAX_T, HIDDEN * 4, HIDDEN * 4)
        t0 = _now()
        a2a = MoeAlltoAll(M(), MAX_T, TOP_K, EXPERTS, size, job=job, runtime_dir=runtime_dir, timeout=90.0,
                          on_peer_loss=policy, enable_rank_mask=True)
        t1 = _now()
        results.put((rank, "attached", t1, (t0, a2a.generation)))
        att = a2a.attachment
        flag = att.workspace[rank, att.aux.flag_val : att.aux.flag_val + 4].view(torch.int32)
        g = torch.Generator().manual_seed(seed)
        full = L.full_mask(EP)
        caller = torch.tensor([-1] * L.MASK_WORDS, dtype=torch.int64)  # every rank: the job's mask decides
        masked = torch.tensor([w - (1 << 64) if w >> 63 else w
                               for w in L.mask_words(full & ~sum(1 << q for q in EXCLUDED))], dtype=torch.int64)
        records, n, idle = [], 0, False
        while True:
            nxt = int(flag)  # the round about to run (rounds are numbered by FLAG_VAL, from 1)
            use_mask = 0 < shared["mask_from"].value <= nxt
            idle = idle or (use_mask and rank in EXCLUDED)  # the callers leave this rank out from now on
            if idle or (nxt >= shared["stop"].value and not (n == 0 and shared["first_sets_stop"].value)):
                if shared["final"].value:
                    break
                time.sleep(0.02)
                continue
            t = int(torch.randint(1, MAX_T + 1, (1,), generator=g))
            experts = torch.rand(t, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
            hidden = torch.randint(-8, 9, (t, HIDDEN), generator=g).to(torch.float32)
            try:
                mask = masked if use_mask else caller
                (recv,) = a2a.dispatch(experts, [hidden], MAX_T, active_rank_mask=mask)
                out = a2a.combine(recv * float(rank + 1), MAX_T, active_rank_mask=mask)
            except errors.PeerLost as exc:
                if policy != "raise":
                    raise
                results.put((rank, "lost", _now(), (exc.rank, exc.details.get("reason_name"))))
                results.put((rank, "lost_message", _now(), (int(flag), str(exc))))
                gen = a2a.recover(timeout=90.0)
                results.put((rank, "recovered", _now(), gen))
                continue
            rnd = int(flag) - 1
            counted = L.mask_from_words(a2a.last_round_active_mask.tolist())
            assert counted == sum(1 << q for q in a2a.last_round_active_ranks)
            verify(rank, rnd, experts, hidden, out, a2a.last_round_degraded, counted, policy)
            records.append((rnd, _now(), counted, use_mask))
            if n == 0:
                results.put((rank, "first", _now(), rnd))
                if shared["first_sets_stop"].value:
                    shared["stop"].value = rnd + shared["first_sets_stop"].value
                    shared["first_sets_stop"].value = 0
            n += 1
            shared["done"][rank] = n
            shared["partial"][rank] = int(counted != full)
        results.put((rank, "records", _now(), records))
        a2a.close()
        results.put((rank, "done", _now(), None))
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback

        results.put((rank, "error", 0.0, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def group_main(ranks, runtime_dir, job, policy, shared, results, seed, gate):
    """A process of rank threads (one per rank of ``ranks``); with ``gate`` (a key of
    ``shared``) its ranks attach once that flag is set (the process and its imports are ready
    before)."""
    import torch

    import a2ad.client  # noqa: F401  (imports stay out of the timed attach)

    torch.set_num_threads(1)
    if gate:
        end = time.monotonic() + 300
        while not shared[gate].value and time.monotonic() < end:
            time.sleep(0.002)
    threads = [threading.Thread(target=rank_thread, args=(r, runtime_dir, job, policy, shared, results, seed + r),
                                daemon=True) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


class Groups(RankReports):
    """The processes of one ep-256 job's ranks; close() ends every one still running."""

    def __init__(self, runtime_dir, job, policy):
        self.ctx = mp.get_context("spawn")
        super().__init__(self.ctx)
        self.runtime_dir, self.job, self.policy = str(runtime_dir), job, policy
        self.shared = {
            "stop": self.ctx.Value("q", 0, lock=False),
            "final": self.ctx.Value("b", 0, lock=False),
            "go": self.ctx.Value("b", 0, lock=False),
            "go_replacement": self.ctx.Value("b", 0, lock=False),
            "first_sets_stop": self.ctx.Value("q", 0, lock=False),
            "mask_from": self.ctx.Value("q", 0, lock=False),
            "done": self.ctx.Array("q", EP, lock=False),
            "partial": self.ctx.Array("b", EP, lock=False),
        }
        self.procs: list = []
        self.proc_of: dict = {}

    def start(self, ranks, seed, gate=None):
        p = self.ctx.Process(target=group_main, args=(list(ranks), self.runtime_dir, self.job, self.policy,
                                                      self.shared, self.results, seed, gate), daemon=True)
        p.start()
        self.procs.append(p)
        for r in ranks:
            self.proc_of[r] = p
        return p

    def start_all(self, victim, seed):
        """Every rank but ``victim`` in processes of PER_PROC threads, the victim alone in a
        process that attaches last (once every other rank waits in the rendezvous)."""
        others = [r for r in range(EP) if r != victim]
        for i in range(0, len(others), PER_PROC):
            self.start(others[i : i + PER_PROC], seed)
        self.start([victim], seed, gate="go")

    def start_replacement(self, rank, seed):
        """A process for a replacement of ``rank``, started now (imports done) and attaching
        once :meth:`replace` is called. Returns the process."""
        p = self.ctx.Process(target=group_main, args=([rank], self.runtime_dir, self.job, self.policy, self.shared,
                                                      self.results, seed, "go_replacement"), daemon=True)
        p.start()
        self.procs.append(p)
        self.spare = (rank, p)
        return p

    def replace(self):
        rank, p = self.spare
        self.proc_of[rank] = p
        self.shared["go_replacement"].value = 1

    def kill(self, rank):
        p = self.proc_of[rank]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.forget(rank)

    def wait_done(self, ranks, n, what, timeout=90.0):
        wait_for(lambda: all(self.shared["done"][r] >= n for r in ranks), timeout, what, interval=0.05)

    def close(self):
        self.shared["final"].value = 1
        self.shared["stop"].value = 0
        self.end_processes(self.procs)


@pytest.fixture
def groups():
    made = []

    def make(runtime_dir, job, policy):
        g = Groups(runtime_dir, job, policy)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def rendezvous(daemon, grp, victim, seed):
    """Start every rank, the victim last; returns (client ms, daemon ms, the attach reports):
    from the last rank's attach call to the release of every rank, and the daemon's own
    figure (last join -> every rank released)."""
    grp.start_all(victim, seed)
    job = grp.job
    wait_for(lambda: sum(1 for q in _info(daemon, job)["ranks"] if q["state"] == "joining") == EP - 1, 120,
             f"{EP - 1} ranks waiting in the rendezvous", interval=0.1)
    grp.shared["go"].value = 1
    att = grp.expect("attached", range(EP), timeout=120)
    t_call = att[victim][1][0]
    client_ms = (max(t for t, _ in att.values()) - t_call) * 1e3
    daemon_ms = daemon.request("status")["rendezvous_latency_ms"]["last"]
    return client_ms, daemon_ms, att


def _info(daemon, job):
    try:
        return daemon.request("job_info", job=job)
    except errors.NoSuchJob:
        return {"ranks": []}


def round_ms(recs: dict, lo: int, hi: int) -> float:
    """Mean ms per round over rounds (lo, hi]: from the last rank's end of round lo to the last
    rank's end of round hi (each rank's first run of a round number)."""
    ends: dict = {}
    for records in recs.values():
        seen = set()
        for rnd, t, *_ in records:
            if rnd in seen:
                break  # numbering restarted (a re-arm)
            seen.add(rnd)
            ends[rnd] = max(ends.get(rnd, 0.0), t)
    return (ends[hi] - ends[lo]) * 1e3 / (hi - lo)


def metric_line(text: str, name: str, job: str) -> str:
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and f'job="{job}"' in line:
            return line
    raise AssertionError(f"no {name} for job {job} in the metrics:\n{text[:3000]}")


def check_mask_views(daemon, job, mask, survivors):
    """What the protocol, a2ad-ctl (text and --json), the metrics and the state file show of
    a degrade job whose active mask is ``mask`` (bits above 63 included)."""
    from a2ad.daemon import persist

    info = daemon.request("job_info", job=job)
    assert isinstance(info["active_mask"], bytes) and len(info["active_mask"]) == L.MASK_BYTES, info["active_mask"]
    assert L.mask_from_bytes(info["active_mask"]) == mask, (L.format_ranks(L.mask_from_bytes(info["active_mask"])),
                                                            L.format_ranks(mask))
    assert info["active_ranks"] == survivors and info["admitting_ranks"] == [], info["admitting_ranks"]
    assert info["state"] == "degraded" and info["abort"] == "none", info["state"]
    ranks = L.format_ranks(mask)
    out = ctl(daemon.runtime_dir, "job", job)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("active  "))
    assert line.startswith(f"active  ranks {ranks} of {EP} (mask {mask:#x}, generation "), line
    js = json.loads(ctl(daemon.runtime_dir, "--json", "job", job).stdout)
    assert js["active_mask"] == mask and js["active_mask_hex"] == f"{mask:#x}" and js["active_ranks"] == survivors
    text = daemon.request("metrics")["text"]
    info_line = metric_line(text, "a2ad_job_active_mask_info", job)
    assert f'mask="{mask:#x}"' in info_line and f'ranks="{ranks}"' in info_line and info_line.endswith(" 1.0")
    assert metric_line(text, "a2ad_job_active_ranks", job).endswith(f" {float(len(survivors))}")
    state = wait_for(lambda: next((r for r in (persist.load(daemon.runtime_dir) or {}).get("jobs", [])
                                   if r["name"] == job and r["active_mask"] is not None
                                   and L.mask_from_bytes(r["active_mask"]) == mask), None), 10,
                     "the state file recording the mask")
    assert state["ep_size"] == EP and len(state["slots"]) == EP
    return line


@pytest.mark.full
def test_ep256_degrade_kill_above_64_and_replacement(daemon_factory, groups):
    """256 ranks of a degrade job: the rendezvous, 10 verified rounds, rank 200 killed while the
    others serve (they go on without it, every round verified), the mask above bit 63 in the
    protocol, a2ad-ctl, the metrics and the state file, then a replacement let back in."""
    daemon = daemon_factory("--grace", "5")
    job, victim = "ep256degrade", 200
    grp = groups(daemon.runtime_dir, job, "degrade")
    grp.shared["stop"].value = 11  # rounds 1..10
    t0 = time.monotonic()
    client_ms, daemon_ms, _ = rendezvous(daemon, grp, victim, seed=1000)
    grp.start_replacement(victim, seed=5000)
    grp.wait_done(range(EP), 10, "10 verified rounds of every rank")
    t_rounds = time.monotonic()
    survivors = [r for r in range(EP) if r != victim]
    # the victim dies while every rank serves
    grp.shared["stop"].value = 1 << 40
    grp.wait_done([victim], 11, "the victim's round 11")
    grp.kill(victim)
    t_kill = time.monotonic()
    base = {r: grp.shared["done"][r] for r in survivors}
    wait_for(lambda: all(grp.shared["partial"][r] and grp.shared["done"][r] >= base[r] + 2 for r in survivors), 90,
             "2 verified rounds of every survivor without rank 200", interval=0.05)
    t_degraded = time.monotonic()
    full = L.full_mask(EP)
    line = check_mask_views(daemon, job, full & ~(1 << victim), survivors)
    # a replacement joins as rank 200 while the others serve; 5 rounds after its first, all stop
    grp.shared["first_sets_stop"].value = 5
    grp.replace()
    (_, first), = grp.expect("first", [victim], timeout=90).values()
    grp.shared["final"].value = 1
    recs = {r: v for r, (_, v) in grp.expect("records", range(EP), timeout=120).items()}
    stop = grp.shared["stop"].value
    for r in survivors:
        check_sequence(recs[r], r, victim, first, stop)
        assert recs[r][0][0] == 1 and all(x[2] == full for x in recs[r][:10]), r
    assert [x[0] for x in recs[victim]] == list(range(first, stop)) and all(x[2] == full for x in recs[victim])
    grp.expect("done", range(EP), timeout=60)
    assert "a2ad_readmits_total 1.0" in daemon.request("metrics")["text"]
    print(f"\nep {EP} (threads of {EP // PER_PROC + 1} processes, one daemon): rendezvous: last rank's attach call "
          f"-> all {EP} released and mapped {client_ms:.0f} ms (client side), last join -> release {daemon_ms} ms "
          f"(daemon side); 10 verified rounds {t_rounds - t0 - client_ms / 1e3:.1f} s after the start "
          f"({round_ms(recs, 2, 10):.0f} ms per round, every rank's round verified); rank {victim} killed: 2 verified "
          f"rounds of all survivors without it {t_degraded - t_kill:.1f} s later; replacement let in at round {first}, "
          f"{stop - first} full rounds after it\n{line}")


@pytest.mark.full
def test_ep256_daemon_restart_readopts_the_degraded_job(runtime_dir, groups):
    """A degraded ep-256 job (rank 130 lost: a bit of mask word 2 cleared) outlives a kill -9 of
    its daemon: the survivors serve on while no daemon runs, and the next daemon, re-adopting
    the job from the state file (its mask as bytes) and the kept fds, shows the same mask."""
    from a2ad.daemon import persist

    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
    d2 = None
    job, victim = "ep256restart", 130
    grp = groups(runtime_dir, job, "degrade")
    try:
        grp.shared["stop"].value = 1 << 40
        rendezvous(d1, grp, victim, seed=2000)
        survivors = [r for r in range(EP) if r != victim]
        grp.wait_done([victim], 3, "the victim's first 3 rounds")
        grp.kill(victim)
        base = {r: grp.shared["done"][r] for r in survivors}
        wait_for(lambda: all(grp.shared["partial"][r] and grp.shared["done"][r] >= base[r] + 2 for r in survivors),
                 90, "2 rounds of every survivor without rank 130", interval=0.05)
        mask = L.full_mask(EP) & ~(1 << victim)
        check_mask_views(d1, job, mask, survivors)
        d1.kill9()
        t_kill = time.monotonic()
        base = {r: grp.shared["done"][r] for r in survivors}
        grp.wait_done(survivors, max(base.values()) + 2, "2 rounds with no daemon")
        rec = next(r for r in persist.load(runtime_dir)["jobs"] if r["name"] == job)
        assert L.mask_from_bytes(rec["active_mask"]) == mask and rec["slots"][victim]["state"] == L.RANK_DEAD
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
        t_up = time.monotonic()
        info = d2.request("job_info", job=job)
        assert info["ranks"][victim]["state"] == "dead" and info["spec"]["on_peer_loss"] == "degrade"
        check_mask_views(d2, job, mask, survivors)
        assert "re-adopted 1 job(s): ep256restart" in d2.log()
        base = {r: grp.shared["done"][r] for r in survivors}
        grp.wait_done(survivors, max(base.values()) + 2, "2 rounds after the restart")
        grp.shared["stop"].value = max(grp.shared["done"][r] for r in survivors) + 3
        grp.shared["final"].value = 1
        recs = {r: v for r, (_, v) in grp.expect("records", survivors, timeout=120).items()}
        stop = grp.shared["stop"].value
        for r in survivors:
            rounds = [x[0] for x in recs[r]]
            assert rounds == list(range(1, stop)), (r, rounds[:3], rounds[-3:])
            switch = next(i for i, x in enumerate(recs[r]) if x[2] != L.full_mask(EP))
            assert all(x[2] == mask for x in recs[r][switch:]), r
        grp.expect("done", survivors, timeout=60)
        print(f"\nep {EP} degrade job, rank {victim} lost, daemon kill -9: survivors served on with no daemon; the "
              f"next daemon was up {t_up - t_kill:.1f} s after the kill and showed the same mask "
              f"({L.format_ranks(mask)})")
        assert d2.stop() == 0
    finally:
        grp.close()
        d1.kill9()
        if d2 is not None:
            d2.kill9()
        reap_keeper(runtime_dir)


@pytest.mark.full
def test_ep256_raise_recover_and_caller_mask_above_64(daemon_factory, groups):
    """A raise job of 256 ranks: rank 100 killed, every survivor gets PeerLost naming it and
    calls recover(); a replacement joins, the job is re-armed and every rank serves on; then
    the callers' active_rank_mask leaves out ranks 70, 130 and 255 (words 1-3 of the mask):
    those rounds send them nothing and count only the others."""
    daemon = daemon_factory("--grace", "10")
    job, victim = "ep256raise", 100
    grp = groups(daemon.runtime_dir, job, "raise")
    grp.shared["stop"].value = 1 << 40
    client_ms, daemon_ms, _ = rendezvous(daemon, grp, victim, seed=3000)
    grp.start_replacement(victim, seed=6000)
    survivors = [r for r in range(EP) if r != victim]
    grp.wait_done(range(EP), 3, "3 verified rounds of every rank")
    grp.kill(victim)
    t_kill = _now()
    lost = grp.expect("lost", survivors, timeout=60)
    assert all(v == (victim, "peer lost") for _, v in lost.values()), {r: v for r, (_, v) in lost.items() if v != (victim, "peer lost")}
    lost_ms = (max(t for t, _ in lost.values()) - t_kill) * 1e3
    base = {r: grp.shared["done"][r] for r in survivors}
    base[victim] = 0  # its replacement counts from 0
    # after the re-arm: rounds 1-5, the last two with the callers' mask
    grp.shared["stop"].value = 6
    grp.shared["mask_from"].value = 4
    wait_for(lambda: sum(1 for q in daemon.request("job_info", job=job)["ranks"] if q["recovering"]) == EP - 1, 60,
             "every survivor recovering", interval=0.1)
    t_join = _now()
    grp.replace()
    recovered = grp.expect("recovered", survivors, timeout=90)
    assert all(g == 1 for _, g in recovered.values())
    (_, (_, gen)), = grp.expect("attached", [victim], timeout=30).values()
    assert gen == 1
    rearm_ms = (max(t for t, _ in recovered.values()) - t_join) * 1e3
    # every rank's rounds done before any closes (a rank that leaves a running raise job aborts it)
    wait_for(lambda: all(grp.shared["done"][r] >= base[r] + (3 if r in EXCLUDED else 5) for r in range(EP)), 90,
             "rounds 1-5 after the re-arm (1-3 for the ranks the mask leaves out)", interval=0.05)
    grp.shared["final"].value = 1
    recs = {r: v for r, (_, v) in grp.expect("records", range(EP), timeout=120).items()}
    full = L.full_mask(EP)
    masked = full & ~sum(1 << q for q in EXCLUDED)
    for r in range(EP):
        rs = recs[r]
        if r != victim:  # the rounds before the loss, then the numbering starts again after the re-arm
            cut = next(i for i in range(1, len(rs)) if rs[i][0] < rs[i - 1][0])
            assert [x[0] for x in rs[:cut]] == list(range(1, cut + 1)) and all(x[2] == full for x in rs[:cut]), r
            rs = rs[cut:]
        want = [1, 2, 3] if r in EXCLUDED else [1, 2, 3, 4, 5]
        assert [x[0] for x in rs] == want, (r, [x[0] for x in rs])
        assert all(x[2] == (masked if x[3] else full) and x[3] == (x[0] >= 4) for x in rs), (r, rs)
    grp.expect("done", range(EP), timeout=60)
    print(f"\nep {EP} raise job: rendezvous {client_ms:.0f} ms client side, {daemon_ms} ms daemon side; rank {victim} "
          f"killed: PeerLost on all {EP - 1} survivors within {lost_ms:.0f} ms; replacement join -> every rank "
          f"re-armed {rearm_ms:.0f} ms; 2 rounds with the callers' mask {L.format_ranks(masked)} verified")


def test_engine_hooks_read_mask_words_above_64():
    """The serving engines' views of the mask (vLLM's query_active_mask, SGLang's active_ranks:
    a2ad.integrations._status.RankStatus) read every mask word of the control block: ranks 70,
    130 and 255 cleared show as masked, the others (0-63 included) as serving, and the abort
    word's rank is masked too."""
    import mmap

    import torch

    from a2ad.control import ControlBlock
    from a2ad.integrations._status import RankStatus

    mm = mmap.mmap(-1, L.CONTROL_BLOCK_SIZE)
    cb = ControlBlock(mm)
    cb.initialize(EP, L.POLICY_DEGRADE)

    class Att:  # what RankStatus reads of an attachment: its rank, the job, its control block
        ep_rank, ep_size = 3, EP
        workspace = torch.zeros(1, dtype=torch.uint8)
        spec = {"on_peer_loss": "degrade"}
        control = cb

    class A2A:
        attachment = Att()

    st = RankStatus(A2A())
    try:
        assert st.masked().tolist() == [0] * EP and not bool(st.fault())
        st.rebaseline()
        lost = sum(1 << q for q in EXCLUDED)
        cb.set_active_mask(L.full_mask(EP) & ~lost, EP, time.monotonic_ns())
        masked = st.masked()
        assert masked.shape == (EP,) and masked.dtype == torch.int32
        assert [q for q in range(EP) if masked[q]] == list(EXCLUDED)
        assert st.active().sum().item() == EP - len(EXCLUDED) and bool(st.fault())
        cb.set_abort(L.ABORT_PEER_LOST, 200)
        assert [q for q in range(EP) if st.masked()[q]] == [70, 130, 200, 255]
    finally:
        st.close()
        cb.close()


def test_a_client_refuses_a_daemon_of_the_previous_layout():
    """A daemon of control-block layout version 1 hands out a 4096-byte block: this client
    refuses its join reply before mapping anything (16 KiB of a 4 KiB file would fault),
    naming both sizes and its own layout version."""
    from a2ad.client.attach import _check_control_handle

    with pytest.raises(errors.ProtocolError, match=r"4096 bytes; this client's layout \(version 2, ep_size up to 256\) "
                                                   r"needs 16384.*version skew"):
        _check_control_handle({"handles": [{"kind": "workspace", "rank": 0}, {"kind": "control", "size": 4096}]})
    _check_control_handle({"handles": [{"kind": "control", "size": L.CONTROL_BLOCK_SIZE}]})
