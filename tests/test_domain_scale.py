"""Domains of many nodes on one machine: many real daemons (host backend), ranks as threads
of one process per node, verified rounds, a node's loss and return, and the message volume
of the domain at idle and during a rendezvous (each daemon's counters by message type).

- N daemons x 4 ranks: rendezvous (timed daemon and client side), 50 verified rounds, kill -9
  of one node (daemon and ranks): the others degrade (degrade job) or raise PeerLost (raise
  job) within the loss bound, every daemon counts the node lost within it (printed); the
  node restarts, re-adopts the job, a replacement joins through it and all resume;
- ep 256 over 4 daemons: rendezvous, 10 verified rounds, one rank killed under degrade;
- the messages per second of every node at idle and during the rendezvous, checked against
  the bounds of docs/DOMAIN.md ("Scale"), and printed.

The node counts and ep sizes the issue asks for beyond ``layout.MAX_EP_SIZE`` are skipped
naming that limit. Every daemon and rank process ends even when a test fails.

Full tier only (``full``): tens of daemons on 2 CPUs; the fast tier's domain tests are those
of test_domain.py (two or three daemons).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from a2ad import layout as L
from _domain_scale import Group, ScaleCluster, _now, diff_counts, job_coordinated_by, lost_seen_at, placement, summarize
from helpers import wait_for
from test_domain import serving_alone

HB_INTERVAL, HB_MISSES = 0.5, 10  # lost after 5 s of silence: reliable with many daemons on 2 loaded CPUs
LOSS_BOUND = HB_INTERVAL * HB_MISSES
#: what the docs state a loss costs to be seen: the bound, one heartbeat (the check runs at
#: every heartbeat), a hop; plus the scheduling slack of 2 loaded CPUs
SEEN_BOUND = LOSS_BOUND + HB_INTERVAL + 1.0

pytestmark = pytest.mark.full


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(names, **kw) -> ScaleCluster:
        (tmp_path / f"c{len(made)}").mkdir()
        c = ScaleCluster(tmp_path / f"c{len(made)}", names, interval=HB_INTERVAL, misses=HB_MISSES, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _need_ep(ep: int, degrade: bool = False) -> None:
    if L.MAX_EP_SIZE < ep:
        pytest.skip(f"ep_size {ep} needs layout.MAX_EP_SIZE >= {ep} (it is {L.MAX_EP_SIZE} in this tree)")
    if degrade and ep > 64:
        why = _wide_mask_summary_problem(ep)
        if why:
            pytest.skip(f"a degrade job of {ep} ranks: the daemon's job summary cannot carry its active mask in this "
                        f"tree ({why}); msgpack ints are 64-bit, so a mask of more than 64 ranks must cross a socket as "
                        f"layout.mask_to_bytes")


def _wide_mask_summary_problem(ep: int) -> str | None:
    """Why the daemon's summary of a degrade job of ``ep`` ranks as its replies carry it (what
    ``jobs`` and ``job_info`` answer) does not encode, or None: a probe of the real Job and
    control block."""
    import msgpack

    from a2ad.control import ControlBlock
    from a2ad.daemon.core.jobs import Job, RankSlot

    spec = {"max_num_tokens": 4, "top_k": 1, "num_experts": ep, "workspace_size_per_rank": 4096, "on_peer_loss": "degrade"}
    job = Job(name="probe", ep_size=ep, spec=spec, size_per_rank=4096, row_stride=4096, aux=L.aux_layout(ep, 4),
              control_fd=-1, control=ControlBlock(bytearray(L.CONTROL_BLOCK_SIZE)),
              slots=[RankSlot(rank=r) for r in range(ep)])
    job.active_mask, job.rendezvous_count = L.full_mask(ep), 1
    try:
        msgpack.packb(job.mask_wire(0.0))
    except (OverflowError, TypeError) as exc:
        return f"Job.mask_wire: {type(exc).__name__}: {exc}"
    return None


def _rendezvous(c: ScaleCluster, grp: Group, names, place, job, started=(), timeout: float = 120) -> dict:
    """Start every node's ranks (but those in ``started``, whose process runs already), the
    last rank held back; once the job's coordinator sees the other ranks waiting, let it go.
    Returns the figures: times, and the messages by type of every daemon meanwhile."""
    ep = len(place)
    coord = job_coordinated_by_name(job, names)
    last = ep - 1
    before = c.counts(names)
    ev0 = c.link_events(names)
    t0 = _now()
    for n in names:
        grp.start(n, [r for r in range(ep) if place[r] == n and r not in started], c.dirs[n], seed=names.index(n) + 1,
                  hold=last)

    def waiting():
        info = c.daemons[coord].request("job_info", job=job) if job in _jobs(c, coord) else None
        return info is not None and sum(1 for q in info["ranks"] if q["state"] == "joining") == ep - 1

    wait_for(waiting, timeout, f"the coordinator {coord} to see {ep - 1} ranks waiting", interval=0.05)
    grp.shared["go"].value = 1
    att = grp.expect("attached", range(ep), timeout=timeout)
    start = grp.expect("start", [last], timeout=5)[last][0]
    client_ms = (max(t for t, _ in att.values()) - start) * 1e3
    time.sleep(2 * HB_INTERVAL)  # the reports after the release
    after = c.counts(names)
    span = _now() - t0
    d = diff_counts(before, after)
    coord_ms = c.domain(coord)["federation"]["coordinated_rendezvous_ms"]["last"]
    daemon_ms = c.daemons[place[last]].request("status")["rendezvous_latency_ms"]["last"]
    jobmsgs = {n: {k: {t: v for t, v in kv.items() if t != "hb"} for k, kv in x.items()} for n, x in d.items()}
    s = summarize(jobmsgs)
    ev1 = c.link_events(names)
    return {"client_ms": client_ms, "coord_ms": coord_ms, "daemon_ms": daemon_ms, "coord": coord, "span_s": span,
            "job_messages": s, "all_rate": summarize(d, span), "per_node": jobmsgs,
            "link_events": {k: ev1[k] - ev0[k] for k in ev1}}


def job_coordinated_by_name(job, names) -> str:
    from a2ad.daemon.core.federation import coordinator_order

    return coordinator_order(job, names)[0]


def _jobs(c, node) -> set:
    return {j["name"] for j in c.daemons[node].request("jobs")["jobs"]}


def _idle(c: ScaleCluster, names, seconds: float = 3.0) -> dict:
    time.sleep(3 * HB_INTERVAL)  # the resyncs of the peers coming up are over
    a = c.counts(names)
    t0 = _now()
    time.sleep(seconds)
    b = c.counts(names)
    return summarize(diff_counts(a, b), _now() - t0)


def rendezvous_bound(n_nodes: int, ep: int, coord_ranks: int) -> dict:
    """The most messages one rendezvous of a job on ``n_nodes`` nodes may take (docs/DOMAIN.md,
    "Scale"): a node of k ranks sends the coordinator at most 2k + 3 reports (a join and an
    attach each, confirmed, prepared, released) and one ``prepared``; the coordinator sends
    each node at most one ``decide`` per unconfirmed report, one ``prepare`` and one
    ``release``, and its own report to the holders it knows whenever its own ranks join."""
    peers = n_nodes - 1
    to_coord = 2 * (ep - coord_ranks) + 4 * peers
    from_coord = (ep - coord_ranks) + 2 * peers + coord_ranks * peers
    return {"total": to_coord + from_coord, "coordinator_sent": from_coord, "coordinator_received": to_coord}


def check_bounds(n_nodes: int, ep: int, idle: dict, rdv: dict, coord_ranks: int) -> None:
    """The bounds docs/DOMAIN.md states ("Scale")."""
    peers = n_nodes - 1
    # idle: heartbeats only, one per peer per interval (1.3x: the rate over a few seconds on loaded CPUs)
    assert set(idle["by_type"]) <= {"hb"}, idle
    assert idle["busiest_node_sent"] <= 1.3 * peers / HB_INTERVAL, idle
    assert idle["total_sent"] <= 1.3 * n_nodes * peers / HB_INTERVAL, idle
    # one rendezvous of a job on every node: linear in the nodes, in all and at the coordinator;
    # a link that connected again meanwhile (a loaded machine) costs a resync: a sync and the
    # reports of the two jobs the test ran, from each end
    b = rendezvous_bound(n_nodes, ep, coord_ranks)
    j = rdv["job_messages"]
    ev = rdv.get("link_events") or {}
    resyncs = ev.get("connects", 0) + ev.get("ups", 0)
    assert j["total_sent"] <= b["total"] + 3 * resyncs, (j, b, ev)
    assert j["busiest_node_sent"] <= b["coordinator_sent"] + 3 * resyncs, (j, b, ev)
    assert j["busiest_node_received"] <= b["coordinator_received"] + 3 * resyncs, (j, b, ev)


def _print_figures(label, n_nodes, ep, idle, rdv):
    print(f"\n[{label}] {ep} ranks over {n_nodes} daemons: rendezvous, last rank's attach call -> every rank "
          f"attached {rdv['client_ms']:.0f} ms (client side); the last rank's daemon, last join -> release "
          f"{rdv['daemon_ms']} ms; coordinator {rdv['coord']}, last join -> release sent {rdv['coord_ms']} ms")
    print(f"[{label}] idle: {idle['total_sent']} messages/s in all ({idle['busiest_node_sent']} sent and "
          f"{idle['busiest_node_received']} received by the busiest node; by type {idle['by_type']}; "
          f"heartbeat every {HB_INTERVAL} s)")
    j = rdv["job_messages"]
    b = rendezvous_bound(n_nodes, ep, ep // n_nodes)
    print(f"[{label}] the rendezvous: {j['total_sent']} job messages in all ({j['bytes_sent']} bytes; by type "
          f"{j['by_type']}; bound {b['total']}), {j['total_sent'] / n_nodes:.1f} per node; the busiest node (the "
          f"coordinator) sent {j['busiest_node_sent']} and received {j['busiest_node_received']}; over the "
          f"{rdv['span_s']:.1f} s from starting the rank processes to {2 * HB_INTERVAL:g} s after the release, heartbeats "
          f"and job messages: "
          f"{rdv['all_rate']['total_sent']} /s in all, busiest node {rdv['all_rate']['busiest_node_sent']} /s sent")


def _why_rearmed(c, names) -> str:
    """The lines of every node's log that say why a job re-armed, a node was counted lost or a
    rank left a degrade job's mask."""
    keys = ("re-arm", "is lost", "counted lost", "did not run its loop", "no active rank is left", "serves on")
    return "\n".join([ln for n in names for ln in c.log_lines([n], keys)[-8:]][-80:])


def _live_losses(c, others, before: int) -> int:
    """The peer losses the daemons of ``others`` counted since their total was ``before``,
    less the killed node's (each counts it once): losses of live nodes."""
    return c.link_events(others)["losses"] - before - len(others)


def _scale_run(cluster, n_nodes: int, per_node: int, policy: str, rounds: int = 50):
    ep = n_nodes * per_node
    names = [f"n{i:03d}" for i in range(n_nodes)]
    c = cluster(names)
    t_all = time.monotonic()
    c.start_all(names)
    c.wait_all_up(names)
    idle = _idle(c, names)
    _small_job_is_heard_by_its_nodes_only(c, names)
    place = placement(ep, names)
    job = job_coordinated_by(names[0], f"scale-{policy}", names)
    grp = Group(ep, job, policy, c.shm)
    try:
        rdv = _rendezvous(c, grp, names, place, job)
        _print_figures(f"{policy}", n_nodes, ep, idle, rdv)
        check_bounds(n_nodes, ep, idle, rdv, per_node)
        ev = c.link_events(names)
        grp.wait_rounds(range(ep), rounds, timeout=180)
        lost_meanwhile = c.link_events(names)["losses"] - ev["losses"]
        assert not lost_meanwhile, (f"{lost_meanwhile} peer loss(es) counted while every daemon ran: this machine's "
                                    f"CPUs were starved past the {LOSS_BOUND} s loss bound")
        # kill -9 of one node, daemon and ranks (not the coordinator: a raise job's recover
        # then also runs with the same one)
        victim = names[n_nodes // 2]
        lost = [r for r in range(ep) if place[r] == victim]
        survivors = [r for r in range(ep) if place[r] != victim]
        others = [n for n in names if n != victim]
        losses_before = c.link_events(others)["losses"]
        t_kill = _now()
        c.daemons[victim].kill9()
        grp.kill(victim)
        try:
            seen = grp.expect("lost" if policy == "raise" else "degraded", survivors, timeout=30)
        except AssertionError:
            print(_after_the_kill(c, grp, others, job))
            false = _live_losses(c, others, losses_before)
            assert false <= 0, (f"{false} loss(es) of live nodes counted after the kill: this machine's CPUs were "
                                f"starved past the {LOSS_BOUND} s loss bound (the job re-armed, as it must then)")
            raise
        if policy == "degrade":
            seen = serving_alone(grp, survivors, seen)
        ranks_ms = {r: (t - t_kill) * 1e3 for r, (t, _) in seen.items()}
        daemons = lost_seen_at(c, others, victim, SEEN_BOUND + 5)
        daemons_ms = {n: (t - t_kill) * 1e3 for n, t in daemons.items()}
        what = "raised PeerLost" if policy == "raise" else f"served on without ranks {lost}"
        print(f"[{policy}] kill -9 of node {victim} (daemon and ranks {lost}): every other daemon counted it lost "
              f"{min(daemons_ms.values()):.0f}-{max(daemons_ms.values()):.0f} ms after, every survivor {what} "
              f"{min(ranks_ms.values()):.0f}-{max(ranks_ms.values()):.0f} ms after (lost after {LOSS_BOUND} s of "
              f"silence, heartbeat every {HB_INTERVAL} s; bound stated {SEEN_BOUND - 1.0} s + a hop)")
        assert max(daemons_ms.values()) < SEEN_BOUND * 1e3, daemons_ms
        assert max(ranks_ms.values()) < SEEN_BOUND * 1e3, ranks_ms
        if policy == "degrade":
            grp.wait_rounds(survivors, 5, timeout=60)
        # the node comes back, re-adopts the job; a replacement of its ranks joins through it
        t_restart = _now()
        c.start(victim)
        t_started = _now()
        c.wait_all_up(names)
        t_up = _now()
        # the restarted daemon hears the others' reports of the job again (the survivors
        # attached): until then it knows no admitted rank that could let a replacement in
        wait_for(lambda: all(c.daemons[victim].request("job_info", job=job)["ranks"][r]["state"] == "attached"
                             for r in survivors), 60, f"node {victim} to hear the survivors' nodes again")
        gen_before = c.daemons[victim].request("job_info", job=job)["generation"]
        grp.start(victim + "-r", lost, c.dirs[victim], seed=77)
        att = grp.expect("attached", lost, timeout=120)
        starts = [t for (r, kind, t, _) in grp.backlog if kind == "start" and r in lost]
        if policy == "degrade":
            # let in at a round boundary while the survivors served on: no re-arm, nobody
            # raises or recovers, every survivor's view whole again
            try:
                back = grp.expect("full", survivors, timeout=120)
            except AssertionError:
                for n in (victim, names[0]):
                    print(f"--- the log of node {n}, its end:\n{c.daemons[n].log_tail(60)}")
                print(_after_the_kill(c, grp, others, job))
                print(f"losses of live nodes counted since the kill: {_live_losses(c, others, losses_before)}")
                raise
            rearmed = [i for i in grp.drain() + grp.backlog if i[1] in ("lost", "recovered")]
            assert not rearmed, f"a survivor recovered: {rearmed[:4]}\n{_why_rearmed(c, names)}"
            assert {v for _, v in att.values()} == {gen_before}, (att, gen_before)  # no re-arm since the rendezvous
            t_back = max(t for t, _ in list(att.values()) + list(back.values()))
            false = _live_losses(c, others, losses_before)
            print(f"[{policy}] after the restart: daemon answering {t_started - t_restart:.1f} s, every daemon seeing "
                  f"it up {t_up - t_restart:.1f} s, the replacement ranks attaching from "
                  f"{min(starts or [t_up]) - t_restart:.1f} s, every survivor's view whole again (no re-arm) "
                  f"{t_back - t_restart:.1f} s; losses of live nodes counted since the kill: {false}")
        else:
            rec = grp.expect("recovered", survivors, timeout=120)
            print(f"[{policy}] after the restart: daemon answering {t_started - t_restart:.1f} s, every daemon seeing "
                  f"it up {t_up - t_restart:.1f} s, the replacement ranks attaching from "
                  f"{min(starts or [t_up]) - t_restart:.1f} s, all attached or recovered "
                  f"{max(t for t, _ in list(att.values()) + list(rec.values())) - t_restart:.1f} s")
            gens = {v for _, v in att.values()} | {v for _, v in rec.values()}
            assert len(gens) == 1 and gens.pop() >= 1, (att, rec)
            t_back = max(t for t, _ in list(att.values()) + list(rec.values()))
        grp.wait_rounds(range(ep), 10, timeout=120)
        total = grp.stop_after(5)
        print(f"[{policy}] node {victim} restarted, re-adopted the job, the replacement of ranks {lost} attached and "
              f"all {ep} ranks resumed {t_back - t_restart:.1f} s after the restart; {total} verified rounds in all; "
              f"the test took {time.monotonic() - t_all:.0f} s")
    finally:
        grp.close()
    return idle, rdv


def _after_the_kill(c, grp, names, job) -> str:
    """What the survivors' daemons and ranks said after a kill that not every survivor saw in
    time: each daemon's view of the job, every report other than start and attached, and the
    log lines about losses and masks (``_why_rearmed``)."""
    out = []
    for n in names:
        try:
            info = c.daemons[n].request("job_info", job=job)
            dead = [r for r, s in enumerate(info["ranks"]) if s["state"] != "attached"]
            out.append(f"{n}: state {info.get('state')} abort {info.get('abort')} generation "
                       f"{info.get('generation')} active {info.get('active_ranks')}"
                       f" not attached {dead}")
        except Exception as exc:  # noqa: BLE001 - a diagnosis only
            out.append(f"{n}: job_info failed: {exc!r}")
    grp.drain()
    said = [(r, k, round(t, 3), str(v)[:160]) for r, k, t, v in grp.backlog if k not in ("start", "attached")]
    out.append(f"reports other than start/attached: {said[:40]}")
    out.append(f"rounds done per rank: {list(grp.shared['done'])}")
    out.append(_why_rearmed(c, names))
    return "\n".join(out)


def _small_job_is_heard_by_its_nodes_only(c: ScaleCluster, names) -> None:
    """A job of 2 ranks on 2 of the nodes (one its coordinator): the other nodes take no
    message about it."""
    from test_domain import _attach_in_thread

    a, b = names[1], names[2]
    job = job_coordinated_by(a, "small", names)
    before = c.counts(names)
    got: dict = {}
    old = os.environ.get("A2AD_SHM_DIR")
    os.environ["A2AD_SHM_DIR"] = str(c.shm)
    try:
        ths = [_attach_in_thread(job, 0, 2, c.dirs[a], got), _attach_in_thread(job, 1, 2, c.dirs[b], got)]
        for th in ths:
            th.join(60)
        assert all(not isinstance(got.get(r), (Exception, type(None))) for r in (0, 1)), got
        time.sleep(2 * HB_INTERVAL)
        d = diff_counts(before, c.counts(names))
    finally:
        for v in got.values():
            if hasattr(v, "close"):
                v.close()
        if old is None:
            os.environ.pop("A2AD_SHM_DIR", None)
        else:
            os.environ["A2AD_SHM_DIR"] = old
    others = {n: {t: v for t, v in d[n]["received"].items() if v and t != "hb"} for n in names if n not in (a, b)}
    mine = {n: sum(v for t, v in d[n]["received"].items() if t != "hb") for n in (a, b)}
    print(f"[small job] 2 ranks on nodes {a} (its coordinator) and {b}: they took {mine} job messages; the other "
          f"{len(others)} nodes took none")
    assert not any(others.values()), others
    assert all(mine.values()), mine


@pytest.mark.parametrize("policy", ["degrade", "raise"])
def test_ep64_over_16_daemons(cluster, policy):
    """16 daemons x 4 ranks (ep 64, the largest ep of this tree that 4 ranks a node fill)."""
    _need_ep(64)
    _scale_run(cluster, 16, 4, policy)


@pytest.mark.parametrize("policy", ["degrade", "raise"])
def test_ep72_over_18_daemons(cluster, policy):
    """18 daemons x 4 ranks (ep 72: a GB200 NVL72's 18 nodes of 4 GPUs)."""
    _need_ep(72, degrade=policy == "degrade")
    _scale_run(cluster, 18, 4, policy)


@pytest.mark.parametrize("policy", ["raise", "degrade"])
def test_ep256_over_4_daemons(cluster, policy):
    """4 daemons x 64 ranks: rendezvous, 10 verified rounds; under degrade, kill -9 of one
    rank (a process of its own): the others serve on without it; then its replacement joins
    through its node and is let in while the others serve (no re-arm)."""
    _need_ep(256, degrade=policy == "degrade")
    n_nodes, ep = 4, 256
    names = [f"n{i}" for i in range(n_nodes)]
    c = cluster(names)
    c.start_all(names)
    c.wait_all_up(names)
    idle = _idle(c, names)
    place = placement(ep, names)
    job = job_coordinated_by(names[0], "scale256", names)
    grp = Group(ep, job, policy, c.shm)
    victim = 100  # on node n1, in a process of its own
    try:
        # the victim's process first; _rendezvous starts the rest (the victim's node without it)
        grp.start("victim", [victim], c.dirs[place[victim]], seed=5)
        rdv = _rendezvous(c, grp, names, place, job, started=(victim,), timeout=180)
        _print_figures(f"ep256 {policy}", n_nodes, ep, idle, rdv)
        check_bounds(n_nodes, ep, idle, rdv, ep // n_nodes)
        grp.wait_rounds(range(ep), 10, timeout=300)
        if policy == "raise":
            total = grp.stop_after(2, timeout=300)
            print(f"[ep256] {total} verified rounds in all over the {ep} ranks")
            assert total >= 10 * ep
            return
        t_kill = _now()
        grp.kill("victim")
        survivors = [r for r in range(ep) if r != victim]
        seen = grp.expect("degraded", survivors, timeout=60)
        assert all(v == survivors for _, v in seen.values()), {r: v for r, (_, v) in seen.items() if v != survivors}
        worst = max(t for t, _ in seen.values()) - t_kill
        print(f"[ep256] kill -9 of rank {victim}: every other rank served on without it within {worst * 1e3:.0f} ms")
        grp.wait_rounds(survivors, 5, timeout=120)
        # its replacement joins through the victim's node; the others (on all 4 nodes) let it in
        # at a round boundary while serving: no re-arm, nobody raises or recovers
        gen_before = c.daemons[place[victim]].request("job_info", job=job)["generation"]
        t_join = _now()
        grp.start("replacement", [victim], c.dirs[place[victim]], seed=6)
        (t_att, gen), = grp.expect("attached", [victim], timeout=120).values()
        back = grp.expect("full", survivors, timeout=120)
        rearmed = [i for i in grp.drain() + grp.backlog if i[1] in ("lost", "recovered")]
        assert not rearmed, f"a survivor raised PeerLost or recovered: {rearmed[:4]}\n{_why_rearmed(c, names)}"
        assert gen == gen_before == c.daemons[place[victim]].request("job_info", job=job)["generation"], \
            (gen, gen_before)  # the generation of the rendezvous: no re-arm since
        print(f"[ep256] rank {victim}'s replacement on node {place[victim]}: attached {t_att - t_join:.1f} s after its "
              f"process started, every other rank's view whole again {max(t for t, _ in back.values()) - t_join:.1f} s "
              "after (no re-arm)")
        grp.wait_rounds(range(ep), 5, timeout=120)
        total = grp.stop_after(3, timeout=120)
        assert total >= 20 * len(survivors), total
    finally:
        grp.close()


# ====================================== 144 nodes: one real daemon, 143 simulated ones
def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("n_nodes", [36, 144])
def test_nodes_one_real_coordinator_and_simulated_peers(cluster, monkeypatch, n_nodes):
    """A domain of 36 or 144 nodes: node n000 is a real daemon and the job's coordinator,
    the others are simulated (tests/_domain_sim.py) over the real CURVE links. Printed and
    checked: n000's messages per second at idle (heartbeats, one per peer per interval each
    way), a rendezvous of 4 real ranks on n000 with ranks on the simulated nodes (messages by
    type at the coordinator, its CPU time, the time from the simulated joins to every real
    rank attached), and n000 counting a silent node lost within the bound."""
    from a2ad.client import attach
    from a2ad.daemon import domain as D
    from _domain_sim import SimNodes

    names = [f"n{i:03d}" for i in range(n_nodes)]
    ep = min(L.MAX_EP_SIZE, 256)
    c = cluster(names)
    monkeypatch.setenv("A2AD_SHM_DIR", str(c.shm))
    sim = SimNodes(D.load_config(c.config), names[1:], ["n000"], c.shm)
    got: dict = {}
    try:
        c.start("n000")
        wait_for(lambda: all(s in ("up", "self") for s in c.states("n000").values()), 60, "n000 to see every peer up",
                 interval=0.2)
        time.sleep(3 * HB_INTERVAL)
        pid, gate = c.daemons["n000"].pid, c.domain("n000")["gate"]["pid"]
        a, cpu_a, gate_a, t_a = c.counts(["n000"]), _cpu_s(pid), _cpu_s(gate), _now()
        time.sleep(4.0)
        b, cpu_b, gate_b, t_b = c.counts(["n000"]), _cpu_s(pid), _cpu_s(gate), _now()
        idle = diff_counts(a, b)["n000"]
        secs = t_b - t_a
        idle_cpu = (cpu_b - cpu_a) / secs
        gate_cpu = (gate_b - gate_a) / secs
        rate = {k: {t: round(v / secs, 1) for t, v in kv.items() if v} for k, kv in idle.items() if k != "bytes_sent"}
        print(f"\n[{n_nodes} nodes] idle, the real node n000: {rate} per second; CPU {idle_cpu * 100:.1f}% of one core "
              f"(its domain gate, which runs CURVE: {gate_cpu * 100:.1f}%) "
              f"(heartbeat every {HB_INTERVAL} s); the domain in all: {n_nodes} x {n_nodes - 1} / {HB_INTERVAL} = "
              f"{n_nodes * (n_nodes - 1) / HB_INTERVAL:.0f} heartbeats per second, nothing else")
        hb_bytes = idle["bytes_sent"]["hb"] / max(1, idle["sent"]["hb"])
        print(f"[{n_nodes} nodes] a heartbeat: {hb_bytes:.0f} bytes of msgpack (the envelope only; CURVE adds 33)")
        assert hb_bytes <= 100, hb_bytes
        assert set(rate["sent"]) == {"hb"} and set(rate["received"]) == {"hb"}, rate
        assert rate["sent"]["hb"] <= 1.3 * (n_nodes - 1) / HB_INTERVAL, rate
        # the rendezvous: n000's 4 ranks wait, then the simulated nodes' joins arrive
        job = job_coordinated_by("n000", "sim144", names)
        real = [0, 1, 2, 3]
        fakes = names[1:]
        ranks = {}
        for r in range(len(real), ep):
            ranks.setdefault(fakes[(r - len(real)) % len(fakes)], []).append(r)
        kw = dict(max_num_tokens=8, top_k=2, num_experts=ep, workspace_size_per_rank=1 << 16,
                  runtime_dir=c.dirs["n000"], timeout=60)

        def one(r):
            try:
                got[r] = attach(job, r, ep, **kw)
            except Exception as exc:  # noqa: BLE001 - looked at below
                got[r] = exc
            got[(r, "t")] = _now()

        ths = [threading.Thread(target=one, args=(r,), daemon=True) for r in real]
        for th in ths:
            th.start()
        wait_for(lambda: sum(1 for q in c.daemons["n000"].request("job_info", job=job)["ranks"]
                             if q["state"] == "joining") == len(real) if job in _jobs(c, "n000") else False, 30,
                 "n000's ranks waiting")
        info = c.daemons["n000"].request("job_info", job=job)
        a, cpu_a = c.counts(["n000"]), _cpu_s(pid)
        t0 = _now()
        sim.join(job, info, ranks)
        for th in ths:
            th.join(90)
        assert all(not isinstance(got[r], Exception) for r in real), got
        client_ms = (max(got[(r, "t")] for r in real) - t0) * 1e3
        time.sleep(2 * HB_INTERVAL)
        b, cpu_b, t1 = c.counts(["n000"]), _cpu_s(pid), _now()
        d = diff_counts(a, b)["n000"]
        job_sent = {t: v for t, v in d["sent"].items() if v and t != "hb"}
        job_recv = {t: v for t, v in d["received"].items() if v and t != "hb"}
        cpu_ms = (cpu_b - cpu_a - idle_cpu * (t1 - t0)) * 1e3
        fed = c.domain("n000")["federation"]
        coord_ms = fed["coordinated_rendezvous_ms"]["last"]
        holders = len(ranks)
        print(f"[{n_nodes} nodes] rendezvous of {ep} ranks on {holders + 1} of the {n_nodes} nodes (4 real ranks on n000, the "
              f"job's coordinator): the simulated joins -> every real rank attached {client_ms:.0f} ms; coordinator's "
              f"last join -> release sent {coord_ms} ms; coordinator CPU for the job {cpu_ms:.0f} ms; its job messages: "
              f"sent {job_sent}, received {job_recv} (all of the job's messages in the domain: the other nodes send "
              f"only to the coordinator); all messages over the {t1 - t0:.1f} s: "
              f"{sum(d['sent'].values()) / (t1 - t0):.0f} sent and {sum(d['received'].values()) / (t1 - t0):.0f} "
              f"received per second by the coordinator")
        # linear in the nodes holding rows; none to a node without them
        b = rendezvous_bound(holders + 1, ep, len(real))
        assert sum(job_sent.values()) <= b["coordinator_sent"] and sum(job_recv.values()) <= b["coordinator_received"], b
        # every real rank maps a simulated node's row: a byte written shows up in its file
        r_fake = ranks[fakes[0]][0]
        got[0].workspace[r_fake, 4096] = 0x5A
        row = c.shm / ("a2ad-" + sim.jobs[job]["handles"][r_fake].hex())
        with open(row, "rb") as f:
            f.seek(4096)
            assert f.read(1) == b"\x5a"
        # a silent node: n000 counts it lost within the bound
        victim = names[n_nodes // 2]
        t_kill = _now()
        sim.silent.add(victim)
        seen = lost_seen_at(c, ["n000"], victim, SEEN_BOUND + 5)["n000"]
        print(f"[{n_nodes} nodes] simulated node {victim} went silent: n000 counted it lost {(seen - t_kill) * 1e3:.0f} ms later "
              f"(lost after {LOSS_BOUND} s of silence)")
        assert seen - t_kill < SEEN_BOUND, seen - t_kill
    finally:
        for v in got.values():
            if hasattr(v, "close"):
                v.close()
        sim.close()
