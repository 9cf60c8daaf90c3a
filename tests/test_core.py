"""The daemon's core in-process: the real Registry driven by calls at given times, with the
simulator's stand-ins at its ports only (a process table, descriptor tables, the keeper), and
the simulator's daemon and domain worlds on fixed seeds. Milliseconds each: no process, no
socket, no clock."""

from __future__ import annotations

import random

import pytest

from a2ad import errors, layout as L, mutations, protocol
from a2ad.daemon import persist
from a2ad.daemon.auth import Auth, Peer
from a2ad.daemon.core.names import cb_name, ws_name
from a2ad.daemon.core.registry import Limits, Registry
from a2ad.sim import daemon as simd
from a2ad.sim.world import WORLDS

UID, OTHER = simd.UIDS
SPEC = dict(simd.SPEC)


class Node:
    """One daemon instance over the simulator's machine: what server.py does around the core
    (hand it an event at a time, carry out its replies), and a restart that keeps the fds."""

    def __init__(self, kernel=None, keeper=None, lines_tail: bool = False):
        self.kernel = kernel or simd.Kernel()
        self.keeper = keeper or simd.SimKeeper()
        self.problems: list = []
        self.host = simd.SimHost(self.kernel, random.Random(1), self.problems)
        self.backend = simd.SimBackend(self.host, lines_tail=lines_tail)
        self.reg = Registry(self.backend, self.keeper.view(self.host), Auth(allow_uids=(UID, OTHER)),
                            Limits(grace=5.0), self.host)
        self.reg.limits.max_fds_per_uid = None
        self.rid = 0

    def replies(self) -> dict[int, protocol.Reply]:
        out, self.reg.outbox = self.reg.outbox, []
        return {int.from_bytes(i, "little"): protocol.decode_reply(d) for i, d in out}

    def join(self, pid: int, uid: int, job: str = "j", rank: int = 0, ep: int = 1, now: float = 0.0, watch=None,
             lines: bool = True):
        """``pid`` joins: its reply, None while held (any other reply of the event is dropped)."""
        self._join(pid, uid, job, rank, ep, now, watch, lines)
        return self.replies().get(pid)

    def _join(self, pid: int, uid: int, job: str, rank: int, ep: int, now: float, watch, lines: bool = True) -> None:
        """(``lines``: the join says that its client combines through lines tails, as this
        release's client does; False: as a client of an earlier release, which sends no word)"""
        self.kernel.procs[pid] = True
        self.reg.now = now
        self.rid += 1
        f = {"job": job, "ep_rank": rank, "ep_size": ep, "spec": dict(SPEC), "pid": pid, "device": "host",
             "timeout": 10.0}
        if watch is not None:
            f["watch"] = watch
        if lines:
            f["lines"] = True
        self.reg.join(Peer(uid, uid, pid), pid.to_bytes(8, "little"), self.rid, f)

    def attach_all(self, pids: list[int], uid: int, watch=None) -> list[tuple[bytes, object]]:
        """Ranks 0..n-1 of job "j" join (pid i as rank i), each held until the last one came,
        then redeem their tickets: every rank's lease and connection. ``watch``: the thread ids
        each pid's join names (a function of the pid)."""
        for r, pid in enumerate(pids):
            self._join(pid, uid, "j", r, len(pids), 0.0, None if watch is None else watch(pid))
            assert r == len(pids) - 1 or not self.reg.outbox, f"rank {r}'s join answered before every rank came"
        replies = self.replies()
        return [self.redeem(pid, uid, replies[pid]) for pid in pids]

    def attach(self, pid: int, uid: int, **kw) -> tuple[bytes, object]:
        """Join, redeem the ticket and take the handles: the rank's lease and its connection."""
        reply = self.join(pid, uid, **kw)
        assert reply is not None and reply.ok, reply
        return self.redeem(pid, uid, reply)

    def redeem(self, pid: int, uid: int, reply) -> tuple[bytes, object]:
        r = self.reg.redeem(reply.payload["ticket"], Peer(uid, uid, pid))
        conn = simd.LeaseConn(pid=pid, daemon=("n0", 1))
        self.reg.delivered(r, conn)
        return reply.payload["lease"], conn

    def state(self) -> dict:
        """What the state file would hold now."""
        return {"backend": "host", "jobs": [persist.job_record(j) for j in self.reg.jobs.values()]}

    def restart(self, state: dict | None = None, lines_tail: bool = False) -> "Node":
        """The daemon stops (an upgrade hands over its state); a new one adopts the kept jobs
        (from ``state``: an older state file, say)."""
        state = self.state() if state is None else state
        new = Node(self.kernel, self.keeper, lines_tail=lines_tail)
        fds = {name: new.host._open(obj[0], obj) for name, obj in sorted(self.keeper.kept.items())}
        new.reg.adopt_state(state, fds)
        return new


def test_a_process_whose_handles_never_reached_it_joins_again_in_place_of_its_attachment():
    """An upgrade resets a redeem in flight: the successor holds the rank attached for the
    process, which never got its handles, has no lease and joins again. Its own join is no
    rank_taken: it replaces what it had (and the old bug does refuse it)."""
    a = Node()
    a.attach(100, UID)
    b = a.restart()
    slot = b.reg.jobs["j"].slots[0]
    assert slot.state == L.RANK_ATTACHED and slot.pid == 100 and slot.lease_conn is None
    with mutations.enabled("own_rank_refused"):
        with pytest.raises(errors.RankTaken, match="held by live pid 100"):
            b.join(100, UID, now=1.0)
    reply = b.join(100, UID, now=1.0)
    assert reply is not None and reply.ok, reply
    assert slot.pid == 100 and slot.state == L.RANK_JOINING and slot.deaths == 1
    # a process that does hold its lease connection is still refused a second join of its rank
    c = Node()
    c.attach(200, UID)
    with pytest.raises(errors.RankTaken, match="held by live pid 200"):
        c.join(200, UID, now=1.0)


def _renew(node: Node, pid: int, lease: bytes) -> dict:
    return node.reg.renew(Peer(UID, UID, pid), {"job": "j", "ep_rank": 0, "lease": lease, "pid": pid})


def test_a_redeemed_join_is_recorded_attached_before_its_handles_go_out():
    """The state file the server writes between the redeem and its answer holds the rank
    attached: a daemon killed after sending the handles (before its next write) comes back
    holding the rank for the process, whose renew is taken. Under the old order
    (``handles_before_record``) that file says joining: the next daemon frees the rank and
    refuses the renew of the process that runs on its handles."""
    for mutation, held in ((None, True), ("handles_before_record", False)):
        with mutations.enabled(mutation):
            a = Node()
            reply = a.join(100, UID)
            r = a.reg.redeem(reply.payload["ticket"], Peer(UID, UID, 100))
            assert a.reg.dirty
            written = a.state()  # the server's write before the answer
            assert a.reg.undeliverable(r) is None
            a.reg.delivered(r, simd.LeaseConn(pid=100, daemon=("n0", 1)))
            b = a.restart(written)  # killed before the write that follows the answer
            slot = b.reg.jobs["j"].slots[0]
            if held:
                assert slot.state == L.RANK_ATTACHED and slot.pid == 100 and slot.attaches == 1
                assert "ticket" in _renew(b, 100, reply.payload["lease"])
            else:
                assert slot.state == L.RANK_EMPTY
                with pytest.raises(errors.PermissionDenied):
                    _renew(b, 100, reply.payload["lease"])


def test_a_redeem_made_stale_before_its_answer_is_refused_and_a_lost_answer_is_a_death():
    """Between a redeem and its answer (the end of the server's turn) the rank's process may
    die or join again, or the job be freed: the answer is refused then, with the reason. An
    answer that cannot be sent (the client went) is a death of the attached rank."""
    a = Node()
    reply = a.join(100, UID)
    r = a.reg.redeem(reply.payload["ticket"], Peer(UID, UID, 100))
    slot = a.reg.jobs["j"].slots[0]
    a.kernel.procs[100] = False
    a.reg.pid_exited(slot.pidfd)  # its pidfd still watches it until the handles went out
    assert slot.state == L.RANK_DEAD and slot.deaths == 1
    exc = a.reg.undeliverable(r)
    assert isinstance(exc, errors.BadTicket) and "dead" in exc.message
    a.reg.undelivered(r, "client gone")  # (refused already: not a second death)
    assert slot.deaths == 1
    # the same process joins again before the answer: the older redeem is stale
    b = Node()
    first = b.reg.redeem(b.join(200, UID).payload["ticket"], Peer(UID, UID, 200))
    again = b.join(200, UID, now=1.0)
    assert again is not None and again.ok, again
    assert isinstance(b.reg.undeliverable(first), errors.BadTicket)
    second = b.reg.redeem(again.payload["ticket"], Peer(UID, UID, 200))
    assert b.reg.undeliverable(second) is None
    b.reg.undelivered(second, "client gone")
    assert b.reg.jobs["j"].slots[0].state == L.RANK_DEAD
    # the job freed in between
    c = Node()
    late = c.reg.redeem(c.join(300, UID).payload["ticket"], Peer(UID, UID, 300))
    c.reg.destroy(Peer(UID, UID, 300), "j")
    assert isinstance(c.reg.undeliverable(late), errors.JobDestroyed)


def test_another_uids_lease_token_is_refused_for_leave_and_recover():
    n = Node()
    lease, _ = n.attach(100, UID)
    f = {"job": "j", "ep_rank": 0, "lease": lease}
    with pytest.raises(errors.PermissionDenied, match=f"uid {OTHER} may not leave"):
        n.reg.leave(Peer(OTHER, OTHER, 300), f)
    with pytest.raises(errors.PermissionDenied, match=f"uid {OTHER} may not recover"):
        n.reg.recover(Peer(OTHER, OTHER, 300), b"x", 9, dict(f, timeout=5.0))
    assert n.reg.jobs["j"].slots[0].state == L.RANK_ATTACHED
    with mutations.enabled("leave_any_uid"):  # the old bug: obeyed
        n.reg.leave(Peer(OTHER, OTHER, 300), f)
    assert n.reg.jobs["j"].slots[0].state == L.RANK_LEFT
    m = Node()
    lease, _ = m.attach(100, UID)
    m.reg.leave(Peer(0, 0, 1), {"job": "j", "ep_rank": 0, "lease": lease})  # root may
    assert m.reg.jobs["j"].slots[0].state == L.RANK_LEFT


def test_the_per_uid_fd_cap_counts_every_descriptor_the_daemon_holds():
    """An attached ep-1 job holds its control block's memfd and the descriptor its mapping
    keeps, the row and the lease connection: 4, all counted against the uid's cap."""
    n = Node()
    n.attach(100, UID)
    held = len(n.host.fds) + 1  # and the lease connection, an fd of the fd socket
    assert held == 4
    assert n.reg.uid_usage(UID)["fds"] == held
    n.reg.limits.max_fds_per_uid = 7
    with pytest.raises(errors.LimitExceeded, match="hold 4 file descriptors .* needs 4 more"):
        n.join(101, UID, job="k")
    with mutations.enabled("uid_fds_undercount"):  # the old count let it through
        assert n.reg.uid_usage(UID)["fds"] == 3


def test_a_watch_thread_ending_is_the_ranks_death_once_and_its_handles_are_given_back():
    """A join names its watch threads; once attached each is watched (and counted against the
    uid's fds). One ending is the rank's death: marked once, its lease connection closed by
    the daemon; the other thread's end and the connection's EOF that follow change nothing."""
    n = Node()
    (_, conn), _ = n.attach_all([100, 101], UID, watch=simd.watch_tids)
    job = n.reg.jobs["j"]
    slot = job.slots[0]
    assert len(slot.watchfds) == 2 and all(fd in n.reg.pidfds for fd in slot.watchfds)
    assert n.reg.uid_usage(UID)["fds"] == 2 + 2 * (1 + 1 + 2)  # block; per rank: row, lease, 2 threads
    first, second = slot.watchfds
    n.kernel.procs[100] = False
    n.reg.now = 1.0
    n.reg.pid_exited(first)
    assert slot.state == L.RANK_DEAD and slot.deaths == 1 and job.control.abort_word
    assert slot.watchfds == [] and first not in n.reg.pidfds and second not in n.reg.pidfds
    assert conn in n.reg.closing and slot.lease_conn is None and conn not in n.reg.leasing.conns
    n.reg.pid_exited(second)
    n.reg.lease_closed(conn)
    assert slot.deaths == 1 and n.reg.counters["deaths"] == 1
    # the survivor's threads are still watched; the dead rank's descriptors are all closed
    assert {kind_obj[1] for kind_obj in n.host.fds.values() if kind_obj[0] == "pidfd"} == \
        {("tid", t) for t in simd.watch_tids(101)}


def test_a_watch_thread_of_a_rank_that_left_or_of_another_process_kills_nothing():
    n = Node()
    lease, conn = n.attach(100, UID, watch=simd.watch_tids(100))
    slot = n.reg.jobs["j"].slots[0]
    fd = slot.watchfds[0]
    n.reg.leave(Peer(UID, UID, 100), {"job": "j", "ep_rank": 0, "lease": lease})
    assert slot.state == L.RANK_LEFT and slot.watchfds == [] and fd not in n.reg.pidfds
    n.reg.pid_exited(fd)
    assert slot.state == L.RANK_LEFT and slot.deaths == 0
    # threads that are not the joining process's are not watched (its lease still is)
    m = Node()
    m.attach(200, UID, watch=simd.watch_tids(300))
    assert m.reg.jobs["j"].slots[0].watchfds == []
    with pytest.raises(errors.InvalidField, match="at most 4 thread ids"):
        protocol.parse_request(protocol.encode_request("join", 1, job="j", ep_rank=0, ep_size=1, spec=dict(SPEC),
                                                       pid=1, device="host", watch=[1, 2, 3, 4, 5]))


def test_a_held_join_of_a_stopped_daemon_is_answered_at_its_timeout_with_the_ranks_it_waited_for():
    """Every rank present, yet a replacement's join times out: it names the running ranks that
    did not quiesce instead of 'waiting for rank(s) []'."""
    n = Node()
    n.attach_all([100, 101], UID)
    n.reg.now = 1.0
    n.reg.lease_closed(n.reg.jobs["j"].slots[1].lease_conn)  # rank 1 dies; a replacement joins
    assert n.join(102, UID, rank=1, ep=2, now=2.0) is None  # held: rank 0 runs on
    n.reg.now = 20.0
    n.reg.expire(20.0)
    reply = n.replies()[102]
    assert reply.code == "rendezvous_timeout" and "rank(s) [0] to quiesce" in reply.message, reply.message


# ------------------------------------------------------------------------- the simulator
#: the first seed each mutation of these worlds is caught at (``python -m a2ad.sim -x
#: --mutation NAME``); a change to a world's schedules moves them, and the test then looks
#: through the first 2,000 seeds as the simulator does
CAUGHT = {
    "own_rank_refused": 14, "leave_any_uid": 17, "uid_fds_undercount": 0, "loss_count_ignored": 115,
    "held_failed_on_stop": 12, "domain_job_freed_on_stop": 331, "generation_from_record": 1045,
    "rearm_lost_to_joining_report": 1715, "lost_mark_not_kept": 143, "decide_from_anyone": 29,
    "readmit_unseen_by_rankless_node": 32, "rejoin_after_undelivered_unseen": 494, "handles_before_record": 16,
    "gate_deafness_counted": 2, "lines_word_unchecked": 14,
}


@pytest.mark.parametrize("world,seeds", [("daemon", range(30)), ("domain", range(10)), ("wide", range(2))])
def test_the_worlds_run_clean(world, seeds):
    for seed in seeds:
        out = WORLDS[world](seed, None)
        assert out.steps > 100 and not out.violations, (seed, out.violations, out.trace[-30:])


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_every_daemon_mutation_is_caught(name):
    m = mutations.REGISTRY[name]
    known = CAUGHT[name]
    for seed in ([known] if known is not None else []) + list(range(2000)):
        if WORLDS[m.world](seed, name).violations:
            break
    else:
        pytest.fail(f"mutation {name} not caught in 2,000 seeds of the {m.world} world")
    assert seed == known, f"mutation {name} is first caught at seed {seed} now: update CAUGHT"
    assert not WORLDS[m.world](seed, None).violations  # the same schedule with the fix is clean


@pytest.mark.parametrize("world", ["daemon", "domain"])
def test_a_seed_replays_exactly(world):
    a, b = WORLDS[world](7, None), WORLDS[world](7, None)
    assert a.trace == b.trace and a.steps == b.steps and a.faults == b.faults
    assert WORLDS[world](8, None).trace != a.trace



def test_a_stop_frees_a_rendezvous_without_answering_its_held_joins_and_keeps_attached_jobs():
    """Registry.stop (SIGTERM): a job whose only rank is held in its join is freed, the join
    left unanswered (it asks the next daemon); a job with an attached rank is kept with its
    rows and control block in the keeper; a job of a domain with no rank attached is kept
    too. ``free_jobs`` frees everything and ends held joins with JobDestroyed."""
    a = Node()
    a.attach(100, UID, job="served")
    assert a.join(101, UID, job="pending", rank=0, ep=2) is None  # held: rank 1 never came
    a.join(102, UID, job="dom", rank=0, ep=2)
    a.reg.jobs["dom"].domain = True  # (as the federation marks a job of the domain)
    kept = a.reg.stop(free_jobs=False)
    assert sorted(j.name for j in kept) == ["dom", "served"]
    assert a.replies() == {}  # the held joins: no answer
    assert cb_name("pending") not in a.keeper.kept and ws_name("pending", 0) not in a.keeper.kept
    for name in ("dom", "served"):
        assert cb_name(name) in a.keeper.kept and ws_name(name, 0) in a.keeper.kept
    b = a.restart()  # (the test's restart has no federation: the local job only)
    assert b.reg.jobs["served"].slots[0].state == L.RANK_ATTACHED

    c = Node()
    c.attach(200, UID, job="served")
    assert c.join(201, UID, job="pending", rank=0, ep=2) is None
    assert c.reg.stop(free_jobs=True) == []
    reply = c.replies()[201]
    assert not reply.ok and reply.code == "job_destroyed", reply
    assert c.keeper.kept == {}


def _rearm_both(n: Node, leases: list, now: float) -> dict:
    """Both ranks of job "j" recover; the replies (the re-arm's generation)."""
    n.reg.now = now
    for r, lease in enumerate(leases):
        n.reg.recover(Peer(UID, UID, 100 + r), (100 + r).to_bytes(8, "little"), 50 + r,
                      {"job": "j", "ep_rank": r, "lease": lease, "timeout": 10.0})
    return n.replies()


def test_a_rearm_the_state_file_missed_is_taken_from_the_control_block():
    """The state file does not hold a re-arm (it could not be written, then a kill -9): the
    next daemon adopts the job at the control block's generation, which its ranks ran, not
    the record's; the next re-arm goes past it instead of reusing it (the old bug does)."""
    def run():
        a = Node()
        leases = [lease for lease, _ in a.attach_all([100, 101], UID)]
        stale = a.state()  # the last state file written: generation 0
        got = _rearm_both(a, leases, 1.0)
        assert {p: rep.payload["generation"] for p, rep in got.items()} == {100: 1, 101: 1}
        b = a.restart(stale)
        job = b.reg.jobs["j"]
        return job.generation, job.needs_rearm, _rearm_both(b, leases, 2.0)

    generation, needs, got = run()
    assert (generation, needs) == (1, False)
    assert {p: rep.payload["generation"] for p, rep in got.items()} == {100: 2, 101: 2}
    with mutations.enabled("generation_from_record"):
        generation, _, got = run()
    assert generation == 0 and {rep.payload["generation"] for rep in got.values()} == {1}  # a generation reused


def test_a_generation_no_rearm_writes_is_not_adopted():
    """The ranks map the control block writable: a client that wrote a generation past any a
    re-arm writes (the u64's last value) does not get it adopted, and the next re-arm is the
    record's next generation, not a u64 overflow."""
    a = Node()
    leases = [lease for lease, _ in a.attach_all([100, 101], UID)]
    a.reg.jobs["j"].control.generation = 2**64 - 1
    b = a.restart()
    assert b.reg.jobs["j"].generation == 0
    got = _rearm_both(b, leases, 1.0)
    assert {p: rep.payload["generation"] for p, rep in got.items()} == {100: 1, 101: 1}
    assert b.reg.jobs["j"].control.generation == 1


class _NodeReplaced(simd.World):
    """The domain world on one schedule: a degrade job of 6 ranks, 2 on each of 3 nodes; at
    8 s both ranks of node n2 are killed (``lose_node``: with n2's daemon, which comes back
    4-5 s later) and both replacements join together, let back in across nodes while the
    others serve."""

    def __init__(self, seed: int, lose_node: bool):
        super().__init__("domain", seed, None, nodes=3, domain=True)
        self.lose_node = lose_node

    def schedule(self) -> None:
        self.jobs["j0"] = (6, "degrade", UID, [f"n{r // 2}" for r in range(6)])
        for r in range(6):
            self.spawn("j0", r)
        self.active, self.horizon = 0.0, 40.0  # attached ranks serve on
        for node in self.nodes.values():
            self.at(0.25, f"timers {node.name}", self.timers, node)
        self.at(8.0, "replace n2's ranks", self.replace_pair)

    def replace_pair(self) -> None:
        ps = [p for p in self.procs.values() if p.alive and p.node == "n2"]
        self.fault("kill -9 of both ranks of n2" + (" and its daemon" if self.lose_node else ""))
        for p in ps:
            self.exit(p, "kill -9")
        if self.lose_node:
            self.restart(self.nodes["n2"], self.rng.uniform(4.0, 5.0))
        for p in ps:
            self.at(self.now + (6.0 if self.lose_node else 0.5), "replace", self.spawn, p.job, p.rank)


@pytest.mark.parametrize("lose_node", [False, True], ids=["ranks-killed", "node-killed"])
def test_a_pair_let_back_in_across_nodes_is_counted_active_on_every_node(lose_node):
    """Both replacements of a node are let back in, each answered by its node once the others
    took it back in (the other holders count it attached then: its attach is no news for
    them). A report of that node sent for the second one's news while the first had not
    taken its handles yet still says the first is joining: it stays attached on every node
    (it went back to joining on the nodes that are not the coordinator, for good, since the
    report that says attached reaches only the coordinator)."""
    for seed in range(40):
        w = _NodeReplaced(seed, lose_node)
        out = w.run()
        assert not out.violations, (seed, out.violations)
        assert sorted((p.rank, p.state) for p in w.procs.values() if p.alive) == [(r, "attached") for r in range(6)]
        views = {n: node.reg.jobs["j0"].mask_summary(w.now)["active_ranks"] for n, node in w.nodes.items()}
        assert views == {n: list(range(6)) for n in w.nodes}, (seed, views)


def _restarted_links(period: float | None = 0.5):
    """A daemon that just started listening (at 100.0), heartbeat 0.25 s, lost after 1 s, with
    two peers not heard yet; its losses as (peer, why)."""
    from a2ad.daemon.core.links import Link, Links

    lost: list = []

    class H:
        def on_peer_lost(self, node, why):
            lost.append((node, why))

        def on_peer_up(self, node, restarted):
            pass

    peers = {n: Link(n) for n in "ab"}
    links = Links("d", peers, 0.25, 1.0, 100.0, H(), receiver_period=period)
    links.listening(100.0)
    return links, peers, lost


def _tick(links, now):
    links.discount_own_stall(now)
    links.beat(now, lambda *a, **k: True)


def test_a_restarted_daemon_whose_new_gate_did_not_run_counts_no_unheard_peer_lost():
    """tests/test_domain.py's kill -9 case, degrade, on a loaded machine: c's new gate said
    READY, then did not run for 2 s (its loop starved of CPU), so the others' connections
    waited for their handshakes; c's own loop ran on. That time is not a's and b's silence:
    c counts neither lost, and hears them once its gate runs. The gate's reports (every 0.5 s
    while it runs) tell the daemon when it did not run."""
    links, peers, lost = _restarted_links()
    t = 100.0
    while t < 102.25:  # the gate does not run until 102.2: no report
        t += 0.25
        _tick(links, t)
    assert not lost, lost
    links.receiver_ran(102.2)  # its loop runs: the handshakes are answered, a's heartbeat follows
    _tick(links, 102.5)
    links.heard(peers["a"], b"A", "hb", 102.55)
    links.heard(peers["b"], b"B", "job", 102.6)
    _tick(links, 102.75)
    assert not lost and {p.state for p in peers.values()} == {"up"}
    assert links.deaf_s == pytest.approx(2.2 - 0.5)
    # the same with the mutation: counted lost at the first check past 1 s
    with mutations.enabled("gate_deafness_counted"):
        links, peers, lost = _restarted_links()
        for t in (100.25, 100.5, 100.75, 101.0, 101.25):
            _tick(links, t)
    assert [n for n, _ in lost] == ["a", "b"]


def test_a_peer_never_heard_while_the_gate_runs_is_lost_after_the_loss_bound():
    """A peer that is really gone (or cut off) is still counted lost one loss bound after the
    daemon started listening, when its gate runs and reports; after a time in which the gate
    did not run, that much later (and no later: once it runs again the bound is counted on)."""
    links, peers, lost = _restarted_links()
    t = 100.0
    while not lost:
        t += 0.25
        links.receiver_ran(t - 0.1)
        _tick(links, t)
    assert t == 101.25 and [n for n, _ in lost] == ["a", "b"] and "1.2 s ago" in lost[0][1], (t, lost)
    links, peers, lost = _restarted_links()
    t = 100.0
    while not lost:
        t += 0.25
        if not 100.4 < t - 0.1 < 103.0:  # the gate did not run from 100.4 to 103.0
            links.receiver_ran(t - 0.1)
        _tick(links, t)
    # the report of 103.15 says it did not run for 2.25 s of the 2.75 s since the one of 100.4:
    # 1 s counted by 103.25, lost at the next check
    assert t == 103.5, (t, lost)


@pytest.mark.parametrize("lines_tail", [True, False], ids=["tail", "no-tail"])
def test_rows_get_a_lines_tail_where_the_backend_asks_zeroed_at_every_initialization_and_kept(lines_tail):
    """A backend whose rows the CUDA kernels use (Backend.lines_tail) gets every row of a job
    of at most MAX_LINES_EP_SIZE ranks ROW_TAIL_BYTES larger; each initialization (the rows'
    first, a re-arm) zeroes that tail with the aux region, the join reply names it, and a
    daemon restarted from the state file keeps it, whatever its own backend would give a new
    job (a replacement's row then has the job's stride). Without one: no tail, the stride of
    size_per_rank alone, lines_tail 0."""
    a = Node(lines_tail=lines_tail)
    for r, pid in enumerate((100, 101)):
        a._join(pid, UID, "j", r, 2, 0.0, None)
    replies = a.replies()
    job = a.reg.jobs["j"]
    size = job.size_per_rank
    if lines_tail:
        assert job.row_stride == a.backend.row_stride(L.row_bytes_with_tail(size), "host") > size + L.ROW_TAIL_BYTES - 1
        assert job.lines_tail == L.lines_tail_offset(size, job.row_stride)
    else:
        assert (job.row_stride, job.lines_tail) == (a.backend.row_stride(size, "host"), 0)
    assert [replies[p].payload["lines_tail"] for p in (100, 101)] == [job.lines_tail] * 2
    want = L.ROW_TAIL_BYTES if lines_tail else 0
    assert [a.backend.tails[s.alloc.fd] for s in job.slots] == [want, want]
    leases = [a.redeem(p, UID, replies[p])[0] for p in (100, 101)]
    for s in job.slots:
        a.backend.tails[s.alloc.fd] = None
    got = _rearm_both(a, leases, 1.0)
    assert {p: rep.payload["generation"] for p, rep in got.items()} == {100: 1, 101: 1}
    assert [a.backend.tails[s.alloc.fd] for s in job.slots] == [want, want]
    b = a.restart(lines_tail=not lines_tail)
    kept = b.reg.jobs["j"]
    assert (kept.row_stride, kept.lines_tail, kept.row_bytes) == (job.row_stride, job.lines_tail, job.row_bytes)
    # a re-arm of the adopted job zeroes the tail of its adopted rows too
    got = _rearm_both(b, leases, 2.0)
    assert {p: rep.payload["generation"] for p, rep in got.items()} == {100: 2, 101: 2}
    assert [b.backend.tails[s.alloc.fd] for s in kept.slots] == [want, want]


def test_a_job_made_by_a_client_without_the_lines_word_gets_no_tail_and_lets_any_client_in():
    """The first join of a job creates its rows: one whose client does not say that it
    combines through lines tails (a client of a release before them sends no such word) makes
    a job without a tail on a backend that would give one, and a client that does say it is
    then let in with lines_tail 0 (it takes the other combine, like its peers)."""
    a = Node(lines_tail=True)
    a._join(100, UID, "j", 0, 2, 0.0, None, lines=False)
    a._join(101, UID, "j", 1, 2, 0.0, None, lines=True)
    replies = a.replies()
    job = a.reg.jobs["j"]
    assert job.lines_tail == 0 and job.row_stride == a.backend.row_stride(job.size_per_rank, "host")
    assert all(replies[p].ok for p in (100, 101)), replies
    assert [replies[p].payload["lines_tail"] for p in (100, 101)] == [0, 0]
    assert [a.backend.tails[s.alloc.fd] for s in job.slots] == [0, 0]


def test_a_client_without_the_lines_word_is_refused_a_job_whose_rows_have_a_tail():
    """A join that does not say it combines through lines tails, of a job whose rows have one
    (its ranks combine through them), is refused at once with SpecMismatch naming the field
    "lines": in the job's rounds it would wait for lines its peers never write and read rows
    they never staged. The rank waiting in the rendezvous keeps waiting (the group is not
    misconfigured, one client is old), and a client that says it is let into the same rank;
    so is a replacement later, while an old one is refused again."""
    a = Node(lines_tail=True)
    assert a.join(100, UID, ep=2, rank=0) is None  # held: rank 1 has not come
    job = a.reg.jobs["j"]
    assert job.lines_tail
    with pytest.raises(errors.SpecMismatch, match="combine through the rows' lines tails") as exc:
        a.join(101, UID, ep=2, rank=1, lines=False, now=0.5)
    assert (exc.value.details["field"], exc.value.details["rank"]) == ("lines", 1)
    assert job.slots[0].pending is not None and job.slots[0].state == L.RANK_JOINING
    assert job.slots[1].state == L.RANK_EMPTY and job.slots[1].alloc is None
    assert not a.replies()  # nothing answered rank 0
    a._join(102, UID, "j", 1, 2, 1.0, None)
    replies = a.replies()
    assert replies[100].ok and replies[102].ok
    assert [replies[p].payload["lines_tail"] for p in (100, 102)] == [job.lines_tail] * 2
    a.redeem(100, UID, replies[100])
    a.redeem(102, UID, replies[102])
    a.reg.now = 2.0
    a.reg.lease_closed(job.slots[1].lease_conn)  # rank 1 dies
    with pytest.raises(errors.SpecMismatch, match="does not say it does"):
        a.join(103, UID, ep=2, rank=1, lines=False, now=3.0)
    assert a.join(104, UID, ep=2, rank=1, now=3.0) is None  # held until rank 0 quiesces, as any replacement
    assert job.slots[1].pid == 104 and job.slots[1].state == L.RANK_JOINING


def test_the_lines_word_is_asked_of_a_kept_job_only_if_its_record_says_so():
    """A daemon restarted (or upgraded) from the state file keeps asking a job's joins for the
    lines word (the record's lines_checked); a job kept from a daemon before the word (its
    record has none) lets a client without it in, as that daemon did, since the job's
    running ranks may be of a release that combines through the lines without saying so."""
    a = Node(lines_tail=True)
    a.attach_all([100, 101], UID)
    job = a.reg.jobs["j"]
    assert job.lines_tail and job.lines_checked
    rec = persist.job_record(job)
    assert rec["lines_checked"] is True and persist.check_job_record(rec) is None
    assert persist.check_job_record({**rec, "lines_checked": 1}) == "bad lines_checked 1"
    older = {k: v for k, v in rec.items() if k != "lines_checked"}
    for record, checked in ((rec, True), (older, False)):
        b = a.restart({"backend": "host", "jobs": [record]}, lines_tail=True)
        kept = b.reg.jobs["j"]
        assert (kept.lines_tail, kept.lines_checked) == (job.lines_tail, checked)
        b.reg.now = 1.0
        b.kernel.procs[101] = False  # rank 1's process dies (the adopted rank is watched through its pid)
        b.reg.pid_exited(kept.slots[1].pidfd)
        assert kept.slots[1].state == L.RANK_DEAD
        b.kernel.procs[101] = True  # (for the next pass, which starts again from a's processes)
        if checked:
            with pytest.raises(errors.SpecMismatch, match="does not say it does"):
                b.join(102, UID, ep=2, rank=1, lines=False, now=2.0)
        else:
            b.join(102, UID, ep=2, rank=1, lines=False, now=2.0)
            assert kept.slots[1].pid == 102 and kept.slots[1].state == L.RANK_JOINING


def test_a_state_file_lines_tail_that_is_not_its_rows_last_bytes_is_refused():
    """persist.check_job_record: a record's lines_tail is 0 or the last ROW_TAIL_BYTES of its
    rows, past size_per_rank; anything else (a hand-edited or foreign file) is refused."""
    a = Node(lines_tail=True)
    a.attach_all([100, 101], UID)
    rec = a.state()["jobs"][0]
    assert rec["lines_tail"] and persist.check_job_record(rec) is None
    for bad in (rec["lines_tail"] + 4096, 4096, -1, "x", rec["row_stride"]):
        err = persist.check_job_record({**rec, "lines_tail": bad})
        assert err is not None and "lines_tail" in err, (bad, err)
    assert persist.check_job_record({**rec, "lines_tail": 0}) is None
    old = {k: v for k, v in rec.items() if k != "lines_tail"}  # a state file of a daemon before tails
    assert persist.check_job_record(old) is None
