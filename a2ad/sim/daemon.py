"""The daemon world: one node's daemon core (the real ``Registry``) serving rank processes
that join, redeem their tickets, attach, leave, die, stall and come back, while the daemon is
killed and restarted, upgraded under churn, and its disk fills.

What stands in for the machine, and only that (the core's ports, core/ports.py):

- ``SimHost``: a process table (pids alive or dead), a descriptor table per daemon
  instance (each fd names a kernel object: a control block's memory, a row, a pidfd), tokens
  from the seed;
- ``SimBackend``: rows as kernel objects of the same table (the memory backend seam);
- the keeper (``SimKeeper``): the fd store across restarts, holding kernel objects by name;
- the state file: the last records written (a full disk keeps the previous ones).

Everything else is the daemon's own code: the registry decides, ``persist.job_record`` and
``persist.check_job_record`` write and read its records, ``adopt_state`` re-adopts them. The
server's part (turning a request into a call, carrying out ``outbox``/``closing``/``dirty``,
timers at ``next_deadline``) is done here the way server.py and fdsock.py do it.

Invariants checked after every step (``check``):

- ``own-rank-refused``: a process's join is never refused because the daemon holds the rank
  for that same process while the process does not hold it;
- ``stranded-rank``: a rank the daemon holds attached for a live process that does not hold
  it is given back within ``STRANDED_BOUND`` seconds;
- ``reply-bound``: every request a live process waits in is answered within its timeout (plus
  one timer tick);
- ``job-lost``: a job a live, attached process holds is never missing from a running daemon;
- ``uid-fds``: what the per-uid cap counts (``uid_usage``) is what the daemon really holds for
  that uid's jobs (rows, control-block descriptions, lease sockets, pidfds);
- ``fd-leak``: a descriptor the daemon holds belongs to a job it knows or a lease it keeps;
  closing one it does not hold is a violation too;
- ``foreign-leave``: a lease token used by another uid is refused;
- ``loss-signal``: a live attached rank whose peer died sees the abort word (raise) or the
  peer's bit cleared (degrade) once the daemon has seen the death;
- ``row-tail``: on a backend that gives rows a lines tail (the even seeds; as the CUDA
  backend's), a job of at most 64 ranks outside a domain has one, at the top of its row stride,
  and every initialization of its rows (creation, a replacement's row, a re-arm) zeroes it; a
  job without one has none zeroed.
"""

from __future__ import annotations

import heapq
import logging
import random

import msgpack
from dataclasses import dataclass

from a2ad import errors, layout as L, mutations, protocol
from a2ad.control import ControlBlock
from a2ad.daemon import persist
from a2ad.daemon.auth import Auth, Peer
from a2ad.daemon.backends.base import Allocation, Backend
from a2ad.daemon.core.federation import Federation, coordinator_order
from a2ad.daemon.core.links import PEER_CONNECTING, PEER_DOWN, PEER_UP, Link, Links
from a2ad.daemon.core.registry import Limits, Registry
from a2ad.sim.world import Outcome, Violation, register

#: A rank the daemon holds attached for a live process that does not hold it: seconds until it
#: must be given back (the process's next join, or its death, ends it).
STRANDED_BOUND = 40.0
#: how long a rank's recover waits for the others (the client's default is 60 s)
RECOVER_TIMEOUT = 20.0
#: how long a client takes to ask a daemon that came back again for a request its predecessor
#: held (it sees the daemon go within 1 s, then looks for a listener every 0.5 s and renews)
RESEND_BOUND = 2.0
#: how long a rank's round waits for a peer that does not serve it (a dispatch or combine wait's
#: timeout: it then raises PeerTimeout and recovers)
ROUND_TIMEOUT = 10.0
#: When the server answers a redeem after the event that made it: at the end of its loop's
#: turn, once the state file holds the attach.
ANSWER_DELAY = 0.0001
SPEC = dict(max_num_tokens=8, top_k=2, num_experts=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64)
UIDS = (1001, 1002)
ROW = 1 << 16


# ------------------------------------------------------------------------- the machine
class Kernel:
    """Kernel objects (memory, pidfds) that outlive a daemon instance's descriptors."""

    def __init__(self):
        self.next_obj = 1
        self.procs: dict[int, bool] = {}  # pid -> alive
        #: control blocks' memory (what outlives every descriptor of it)
        self.blocks: dict[object, bytearray] = {}

    def obj(self) -> int:
        self.next_obj += 1
        return self.next_obj


class SimControlBlock(ControlBlock):
    """A control block in the simulator's memory; like the daemon's mmap, its mapping keeps a
    descriptor of its own, given back when it is closed."""

    def __init__(self, mem: bytearray, host: "SimHost", map_fd: int):
        super().__init__(memoryview(mem))
        self._host, self._map_fd = host, map_fd

    def set_abort(self, reason: int, rank: int = -1) -> None:
        super().set_abort(reason, rank)
        if self._host.on_abort is not None:  # the ranks spinning on it see it within microseconds
            self._host.on_abort(self)

    def close(self) -> None:
        if self._map_fd is not None:
            self._host.close_fd(self._map_fd)
            self._map_fd = None


def watch_tids(pid: int) -> list[int]:
    """The thread ids of a simulated rank process's watch threads."""
    return [pid * 8 + 1, pid * 8 + 2]


class SimHost:
    """The Host port of one daemon instance (core/ports.py)."""

    hostname = "sim"
    control_block_fds = 2

    def __init__(self, kernel: Kernel, rng: random.Random, problems: list):
        self.kernel = kernel
        self.rng = rng
        self.problems = problems
        #: fd -> (kind, object, pid or None)
        self.fds: dict[int, tuple[str, object, int | None]] = {}
        self.blocks = kernel.blocks
        self.next_fd = 10
        #: told when a control block's abort word is set (the world's ranks read it in their rounds)
        self.on_abort = None

    def _open(self, kind: str, obj, pid=None) -> int:
        self.next_fd += 1
        self.fds[self.next_fd] = (kind, obj, pid)
        return self.next_fd

    def open_pidfd(self, pid: int) -> int | None:
        if not self.kernel.procs.get(pid, False):
            raise ProcessLookupError(pid)
        return self._open("pidfd", ("pid", pid), pid)

    def open_thread_pidfd(self, pid: int, tid: int) -> int | None:
        if not self.kernel.procs.get(pid, False) or tid not in watch_tids(pid):
            return None
        return self._open("pidfd", ("tid", tid), pid)

    def token(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def close_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is None:
            self.problems.append(("fd-leak", f"closed fd {fd}, which the daemon does not hold"))

    def alive(self, pid: int) -> bool:
        return self.kernel.procs.get(pid, False)

    def new_control_block(self, ep_size: int, policy: int):
        mem = bytearray(L.CONTROL_BLOCK_SIZE)
        obj = ("cb", self.kernel.obj())
        self.blocks[obj] = mem
        fd = self._open("cb", obj)
        cb = SimControlBlock(mem, self, self._open("cb-map", obj))
        cb.initialize(ep_size, policy)
        return fd, cb

    def adopt_control_block(self, fd: int, job: str):
        kind, obj, _ = self.fds[fd]
        if kind != "cb":
            raise errors.BackendError(f"kept fd {fd} of job {job!r} is not a control block")
        return SimControlBlock(self.blocks[obj], self, self._open("cb-map", obj))

    # what the daemon holds (for the invariants)
    def held(self, kind: str) -> list:
        return [obj for k, obj, _ in self.fds.values() if k == kind]


class SimBackend(Backend):
    """Rows as kernel objects in the daemon's descriptor table (the memory backend seam)."""

    name = "host"

    def __init__(self, host: SimHost, lines_tail: bool = False):
        self.host = host
        #: rows get a handle other nodes of a domain import them by
        self.fabric = False
        #: rows get a lines tail, as the CUDA backend's (Backend.lines_tail)
        self.lines_tail = lines_tail
        #: per row fd: the tail its last initialize zeroed
        self.tails: dict[int, int] = {}

    def check_device(self, device: str) -> None:
        if device != "host":
            raise errors.InvalidField(f"device {device!r}: this daemon serves host memory only", field="device")

    def row_stride(self, size_per_rank: int, device: str) -> int:
        return -(-size_per_rank // 4096) * 4096

    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        obj = ("row", self.host.kernel.obj())
        extra = {"fabric_handle": obj[1].to_bytes(32, "little")} if self.fabric else {}
        return Allocation(fd=self.host._open("row", obj), size=self.row_stride(size_per_rank, device), device=device,
                          handle_type="memfd", extra=extra)

    def initialize(self, alloc, aux_bytes, flag_offset, initial_round, fresh=False, words=None, tail=0) -> None:
        if alloc.fd not in self.host.fds:
            self.host.problems.append(("fd-leak", f"initialized row fd {alloc.fd}, which the daemon does not hold"))
        self.tails[alloc.fd] = tail

    def adopt(self, fd, size, device, handle_type, fabric=None) -> Allocation:
        return Allocation(fd=fd, size=size, device=device, handle_type=handle_type,
                          extra={"fabric_handle": fabric} if fabric else {})

    def release(self, alloc: Allocation) -> None:
        if alloc.fd >= 0:
            self.host.close_fd(alloc.fd)
            alloc.fd = -1


class SimKeeper:
    """The fd store: kernel objects by name, across daemon instances."""

    def __init__(self):
        self.kept: dict[str, object] = {}
        #: a keeper that died holds nothing and takes nothing until its successor is filled
        self.down = False

    def view(self, host: SimHost) -> "KeeperView":
        return KeeperView(self, host)


@dataclass
class KeeperView:
    keeper: SimKeeper
    host: SimHost

    def put(self, name: str, fd: int) -> None:
        if not self.keeper.down:
            self.keeper.kept[name] = self.host.fds[fd][1]

    def drop(self, name: str) -> None:
        self.keeper.kept.pop(name, None)


# ------------------------------------------------------------------------- a daemon
#: how often a running gate reports to its daemon (domain.GATE_REPORT_EVERY)
GATE_PERIOD = 0.5


class SimConfig:
    """What the federation and the links read of a domain's configuration."""

    def __init__(self, names: list[str], heartbeat_interval: float, misses: int):
        self.name = "sim"
        self.names = names
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_misses = misses

    @property
    def loss_bound(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses


class SimBus:
    """The domain bus port of one daemon instance: messages to its peers go through the
    world's network; what it hears goes to the links (core/links.py) and the federation, as
    domain.py hands them over."""

    def __init__(self, world: "World", node: "Node", cfg: SimConfig, boot: bytes):
        self.world, self.n, self.cfg, self.boot = world, node, cfg, boot
        self.node = node.name
        self.peers = {name: Link(name) for name in cfg.names if name != node.name}
        self.links = Links(cfg.name, self.peers, cfg.heartbeat_interval, cfg.loss_bound, world.now,
                           receiver_period=GATE_PERIOD)
        for p in self.peers.values():  # the transport connects (and reconnects) by itself
            self.links.link_up(p)
        self._handler = None
        self.next_beat = 0.0
        #: the time of the gate's last report handed to the links (it reports every GATE_PERIOD
        #: while it runs: not while it is deaf, see Node.deaf)
        self.gate_fed = world.now

    @property
    def handler(self):
        return self._handler

    @handler.setter
    def handler(self, h) -> None:
        self._handler = h
        self.links.handler = h

    def state(self, node: str) -> str:
        return PEER_UP if node == self.node else self.peers[node].state

    def send(self, node: str, msg: dict, heartbeat: bool = False) -> bool:
        env = {"v": 1, "dom": self.cfg.name, "from": self.node, "boot": self.boot, **msg}
        data = msgpack.packb(env, use_bin_type=True)
        ok = self.world.network(self.n, node, data)
        if ok:
            self.peers[node].counters["heartbeats_sent" if heartbeat else "messages_sent"] += 1
        else:
            self.links.send_failed(self.peers[node], heartbeat)
        return ok

    def send_many(self, nodes, msg: dict) -> None:
        for node in nodes:
            self.send(node, msg)

    def broadcast(self, msg: dict) -> None:
        for name, p in self.peers.items():
            if p.state != PEER_DOWN or p.connected:
                self.send(name, msg)

    def receive(self, sender: str, data: bytes) -> None:
        """A frame from ``sender``'s connection, as domain.py takes it from the gate."""
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        p = self.peers[sender]
        if not self.links.heard(p, msg["boot"], msg["t"], self.world.now):
            return
        if msg["t"] == "hb":
            p.counters["heartbeats_received"] += 1
            self.links.their_losses(p, msg.get("lost", 0))
            return
        p.counters["messages_received"] += 1
        try:
            self._handler.on_message(sender, msg)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, errors.A2ADError) as exc:
            self.world.log(self.node, f"dropped a {msg['t']!r} from {sender}: {type(exc).__name__}: {exc}")

    def gate_reports(self, now: float) -> None:
        """The reports the gate made up to ``now`` (it runs on while the daemon is stopped: they
        wait on the channel, with their own times), none while it was deaf."""
        t = self.gate_fed
        while t + GATE_PERIOD <= now:
            t += GATE_PERIOD
            if not any(a <= t < b for a, b in self.n.deaf):
                self.links.receiver_ran(t)
        self.gate_fed = t

    def tick(self, now: float) -> None:
        if now < self.next_beat:
            return
        self.next_beat = now + self.cfg.heartbeat_interval
        self.gate_reports(now)
        self.links.discount_own_stall(now)
        unheard = [p.name for p in self.peers.values() if p.state == PEER_CONNECTING]
        self.links.beat(now, self.send)
        for name in unheard:
            if self.peers[name].state == PEER_DOWN:
                self.world.check_unheard_loss(self.n, name)
        self.links.resyncs()


class Node:
    """One node's daemon: its instances come and go, the keeper and the state file stay."""

    def __init__(self, world: "World", name: str, cfg: SimConfig | None):
        self.world, self.name, self.cfg = world, name, cfg
        self.keeper = SimKeeper()
        self.state_records: dict | None = None
        self.disk_full_until = 0.0
        #: instances that stopped gracefully: the replies they sent before going still arrive
        self.flushed: set[int] = set()
        self.instance = 0
        self.reg: Registry | None = None
        self.host: SimHost | None = None
        self.bus: SimBus | None = None
        self.fed = None
        self.stalled_until = 0.0
        #: (from, until): the times its daemon was stopped, and its gate did not run (a new
        #: gate starved of CPU, a gate restarting): nobody could be heard for the first time
        self.stalls: list[tuple[float, float]] = []
        self.deaf: list[tuple[float, float]] = []
        #: when its current daemon instance started listening
        self.listen_at = 0.0
        #: it handled an event since the last check of its descriptors
        self.touched = False
        #: the lease connections the current instance made (closed when it goes)
        self.conns: list[LeaseConn] = []
        #: the redeems the current instance has not answered yet (the end of its turn):
        #: (process, Redeemed, kind, travel)
        self.answers: list = []
        #: the state file missed a change (a full disk), and the current instance adopted
        #: from such a file: what it holds may lag what its clients hold
        self.unwritten = False
        self.adopted_stale = False
        #: kill the daemon at the next answer to a join's redeem: "before" it or "after" it
        #: (before the state write that follows), or None
        self.kill_mid_redeem: str | None = None

    def start(self, adopt: bool, handover: dict | None = None) -> None:
        w = self.world
        self.instance += 1
        self.conns, self.answers = [], []
        self.adopted_stale = adopt and self.unwritten and handover is None
        self.host = SimHost(w.kernel, random.Random(w.rng.random()), w.problems)
        self.host.on_abort = lambda cb, node=self: w.abort_seen(node, cb)
        backend = SimBackend(self.host, lines_tail=w.lines_tail)
        reg = Registry(backend, self.keeper.view(self.host), Auth(allow_uids=UIDS), w.limits, self.host)
        reg.limits.max_fds_per_uid = 10_000
        reg.now = w.now
        self.reg = reg
        if self.cfg is not None:
            backend.fabric = True
            self.bus = SimBus(w, self, self.cfg, w.rng.randbytes(8))
            self.fed = Federation(reg, self.bus, backend.name)
        if adopt:
            fds = {name: self.host._open(obj[0], obj) for name, obj in sorted(self.keeper.kept.items())}
            reg.adopt_state(handover if handover is not None else self.state_records, fds)
        if self.bus is not None:
            self.bus.links.listening(w.now)
            self.listen_at = w.now
            deaf = w.slow_gate(self)
            for other in w.nodes.values():  # their links to this node reconnect: a handshake each
                if other is not self and other.bus is not None:
                    if deaf:  # once its gate runs and answers their handshakes
                        w.cut[(other.name, self.name)] = (w.now + deaf, "reset")
                        w.at(w.now + deaf, "reconnect", w.reconnect, other.name, self.name)
                    else:
                        other.bus.links.link_up(other.bus.peers[self.name])
        self.carry_out()
        w.log(self.name, f"instance {self.instance} serving ({len(reg.jobs)} job(s) adopted)")

    def stop(self, why: str) -> None:
        """The daemon is gone (kill -9, a stop, the end of an upgrade): its descriptors with it,
        the keeper keeps its copies; every lease connection it held ends."""
        w = self.world
        if self.reg is None:
            return
        w.log(self.name, f"instance {self.instance} gone ({why})")
        for conn in self.conns:  # (one whose fds were still on their way delivers them first: got_handles)
            if conn.open and not any(p.conn is conn for p in w.procs.values()):
                conn.open = False
        for p in w.procs.values():
            if p.conn is not None and p.conn.daemon == (self.name, self.instance) and p.conn.open:
                p.conn.open = False
                w.at(w.now + 0.001, f"lease EOF {p.pid}", w.on_lease_eof, p.conn)
            if p.alive and p.node == self.name and p.waiting_since is not None and p.waiting_in == self.instance:
                # its request died with the daemon. The client sees it go (a join: its pidfd on the
                # daemon, polled every 0.5 s, or the fd.sock probe every 1 s; a recover: its lease's
                # EOF, looked at every 0.5 s) and asks the next daemon again
                seen = w.rng.choice((0.0005, 0.001, 0.5, 1.0)) if p.state == "joining" else w.rng.uniform(0.001, 0.5)
                w.at(w.now + seen, f"daemon gone {p.pid}", w.request_lost, p, p.rid)
                p.waiting_since = None
        self.reg = self.host = self.bus = self.fed = None

    def shutdown(self) -> None:
        """A stop (SIGTERM), as the server's ``shutdown``: the answers of its last turn sent,
        the registry's stop (a job with no attached rank freed, its held joins left unanswered;
        the others kept), its replies sent, the state file written; then the daemon is gone."""
        if self.reg is None:
            return
        # the stop comes at the end of the server's turn, whose answers go out first (and no
        # kill is aimed at them: the daemon stops)
        armed, self.kill_mid_redeem = self.kill_mid_redeem, None
        for p, r, kind, travel in list(self.answers):
            self.world.answer(p, self, self.instance, r, kind, travel)
        self.kill_mid_redeem = armed
        self.event(self.reg.stop, False)
        self.write_state()
        self.flushed.add(self.instance)
        self.stop("stopped (SIGTERM)")

    def carry_out(self) -> None:
        """What the server does after every event: the domain's reports and steps, the state
        file, then replies and leases to close (and the state file again for what those
        changed)."""
        w, reg = self.world, self.reg
        self.touched = True
        if self.fed is not None:
            self.fed.flush(True)
        self.persist()
        outbox, reg.outbox = reg.outbox, []
        for identity, data in outbox:
            pid = int.from_bytes(identity, "little")
            reply = protocol.decode_reply(data)
            w.at(w.now + w.rng.choice((0.0, 0.0, 0.001, 0.01)), f"reply to {pid}", w.on_reply, pid,
                 (self.name, self.instance), reply)
        closing, reg.closing = reg.closing, []
        for conn in closing:
            if isinstance(conn, LeaseConn) and conn.open:
                conn.open = False
                w.at(w.now + 0.001, f"lease EOF {conn.pid}", w.on_lease_eof, conn)
        self.persist()

    def persist(self) -> None:
        w, reg = self.world, self.reg
        if reg.dirty:
            reg.dirty = False
            if w.now < self.disk_full_until:
                self.unwritten = True
                w.log(self.name, "state file not written: disk full")
                w.at(self.disk_full_until, "state retry", self.retry_state, self.instance)
            else:
                self.write_state()

    def write_state(self) -> None:
        self.unwritten = False
        self.state_records = {"backend": "host", "jobs": [persist.job_record(j) for j in self.reg.jobs.values()]}

    def retry_state(self, instance: int) -> None:
        if self.reg is not None and self.instance == instance and self.world.now >= self.disk_full_until:
            self.write_state()

    def event(self, fn, *args):
        """One event handed to the daemon at the current time (server.py's ``_guard``)."""
        self.reg.now = self.world.now
        try:
            return fn(*args)
        finally:
            self.carry_out()

    def timers(self) -> None:
        now = self.world.now
        self.reg.now = now
        self.reg.expire(now)
        if self.bus is not None:
            self.bus.tick(now)
            self.fed.tick(now)
        self.carry_out()


# ---------------------------------------------------------------------------- actors
@dataclass(eq=False)
class LeaseConn:
    """A lease connection (an fd.sock connection the daemon keeps as a rank's lease)."""

    pid: int
    daemon: tuple  # (node, instance) it belongs to
    open: bool = True


@dataclass
class Proc:
    """A rank process: it runs the client's attach, serves, and leaves, dies or re-joins."""

    pid: int
    uid: int
    node: str
    job: str
    rank: int
    ep_size: int
    policy: str
    state: str = "idle"  # idle, joining, redeeming, attached, recovering, gone
    #: renewing its lease after a daemon restart (beside whatever else it does)
    renewing: bool = False
    alive: bool = True
    stalled_until: float = 0.0
    lease: bytes | None = None
    conn: LeaseConn | None = None
    waiting_since: float | None = None
    wait_bound: float = 0.0
    #: the daemon instance its request waits in
    waiting_in: int = 0
    #: when its join's or recover's own wait ends (a request sent again after its daemon went
    #: away asks for what is left), and the control block it reads (the client's mapping)
    deadline: float = 0.0
    cb: object = None
    sent_generation: int = 0
    rid: int = 0
    tries: int = 0
    #: the current chain of its own actions (an older one scheduled before a re-attach is dropped)
    acts: int = 0
    #: a client of a release before the lines tails: its join says nothing of them
    old: bool = False
    #: since when the daemon holds it attached while the process does not hold it
    stranded_since: float | None = None


class World:
    """Rank processes, daemons and the network between them, on one seeded schedule."""

    def __init__(self, name: str, seed: int, mutation: str | None, nodes: int, domain: bool,
                 job_size: tuple[int, int] | None = None):
        self.name = name
        #: (least, most) ranks of the one job of a wide domain; None: the usual jobs
        self.job_size = job_size
        self.seed = seed
        self.mutation = mutation
        self.rng = random.Random(seed)
        #: rows with a lines tail (as the CUDA backend's) on even seeds: no draw from rng, so the
        #: schedules stay those of the seeds
        self.lines_tail = seed % 2 == 0
        #: half of those seeds mix client releases: every fourth process is a client of a release
        #: before the lines (its join says nothing of them), again with no draw from rng
        self.mixed_releases = seed % 4 == 2
        self.now = 0.0
        self.q: list = []
        self.seq = 0
        self.trace: list[str] = []
        self.violations: list[Violation] = []
        self.problems: list[tuple[str, str]] = []
        self.faults = 0
        self.steps = 0
        self.kernel = Kernel()
        self.limits = Limits(grace=5.0, max_rendezvous_timeout=30.0, max_fds_per_uid=None)
        names = [f"n{i}" for i in range(nodes)]
        self.cfg = SimConfig(names, 1.0, 3) if domain else None
        self.nodes = {n: Node(self, n, self.cfg) for n in names}
        self.procs: dict[int, Proc] = {}
        self.next_pid = 100
        self.jobs: dict[str, tuple] = {}  # name -> (ep_size, policy, uid, [node of each rank])
        #: (a, b) -> (until when the link from a to b is cut, "delay" or "reset")
        self.cut: dict[tuple[str, str], tuple[float, str]] = {}
        #: per link, the time its last message arrives (links keep their order, as TCP does)
        self.link_clock: dict[tuple[str, str], float] = {}
        #: (sender, receiver) -> until when frames on that link may be duplicated or reordered
        self.mess: dict[tuple[str, str], float] = {}
        #: the rng of those duplicates and reorderings (apart, so the other schedules stay)
        self.mess_rng = random.Random(seed * 104729 + 3)
        #: the rng of the kills in the middle of a redeem's answer (apart, likewise)
        self.mrng = random.Random(seed * 7907 + 29)
        #: the rng of the new gates starved of CPU (apart, likewise); in half the domain seeds a
        #: restarted daemon's new gate may not run for a while (Node.deaf)
        self.gate_rng = random.Random(seed * 6151 + 37)
        self.slow_gates = domain and self.gate_rng.random() < 0.5
        #: (job, generation) -> the release table first seen for it
        self.releases: dict[tuple[str, int], bytes] = {}
        self.last_fault = 0.0
        self.horizon = 0.0
        #: the next rank to attach has its daemon stopped right after (before its next report)
        self.stall_next_attach = False
        #: job -> since when its live ranks have not all served together (their rounds wait)
        self.stuck: dict[str, float] = {}
        #: seconds after the last fault by which every complete job has converged: a request
        #: held by a daemon that restarted is lost, and its client asks the next daemon again
        #: (RESEND_BOUND); a rank serving rounds with a peer that does not serve it
        #: recovers after its round timeout (ROUND_TIMEOUT); then the loss bound three times
        #: over (a loss, a resync, a re-arm) and the steps of a rendezvous
        self.settle = RESEND_BOUND + ROUND_TIMEOUT + (3 * self.cfg.loss_bound if domain else 0.0) + 6.0
        #: faults happen in the first ACTIVE seconds; then the world is left to settle
        self.active = 40.0
        for node in self.nodes.values():
            node.start(adopt=False)

    # ---------------------------------------------------------------- scheduling
    def at(self, t: float, what: str, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, what, fn, args))

    def log(self, actor: str, text: str) -> None:
        self.trace.append(f"{self.now:9.3f} {actor:>8} {text}")

    def violate(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, detail, self.now))
        self.log("CHECK", f"VIOLATION {invariant}: {detail}")

    def fault(self, text: str) -> None:
        self.faults += 1
        self.last_fault = self.now
        self.log("fault", text)
        self.at(self.now + self.settle, "settled?", self.settled, self.faults)

    def settled(self, faults: int) -> None:
        """``settle`` seconds after a fault with none since: the job must have converged."""
        if faults == self.faults and not self.violations:
            self.check_settled()

    def stopped_for(self, node: Node) -> float:
        return max(0.0, node.stalled_until - self.now)

    def on_node(self, node: Node, what: str, fn, *args) -> bool:
        """Run ``fn`` as an event of ``node``'s daemon: deferred while its loop is stopped,
        dropped while no daemon runs there. False when it did not run now."""
        if node.reg is None:
            return False
        if self.now < node.stalled_until:
            self.at(node.stalled_until, what, self.on_node, node, what, fn, *args)
            return False
        node.event(fn, *args)
        return True

    # ------------------------------------------------------------------ network
    def network(self, src: Node, dst: str, data: bytes) -> bool:
        """A frame from ``src`` to node ``dst``, delivered in order after a delay (a TCP
        connection). On a cut link it waits for the heal (TCP retransmits it then), or, when
        the cut resets the connection, it is lost with the connection: the transport
        reconnects at the heal and both ends' links say so (a handshake, a resync owed)."""
        key = (src.name, dst)
        until, mode = self.cut.get(key, (0.0, ""))
        if self.now < until and mode == "reset":
            return True
        delay = self.rng.choice((0.0005, 0.001, 0.002, 0.005, 0.05))
        if self.now < until:
            delay += until - self.now + self.rng.choice((0.05, 0.2, 1.0))  # the retransmission after the heal
        if self.now < self.mess.get(key, 0.0):
            m = self.mess_rng
            if m.random() < 0.3:  # a copy comes again later
                self.at(max(self.now + delay, self.link_clock.get(key, 0.0)) + m.uniform(0.001, 0.5),
                        f"frame {src.name}>{dst} (again)", self.deliver, src.name, src.instance, dst, data)
            if m.random() < 0.3:  # this one comes late: frames sent after it overtake it
                self.at(self.now + delay + m.uniform(0.01, 0.5), f"frame {src.name}>{dst} (late)", self.deliver,
                        src.name, src.instance, dst, data)
                return True
        t = max(self.now + delay, self.link_clock.get(key, 0.0))
        self.link_clock[key] = t
        self.at(t, f"frame {src.name}>{dst}", self.deliver, src.name, src.instance, dst, data)
        return True

    def deliver(self, src: str, instance: int, dst: str, data: bytes) -> None:
        node = self.nodes[dst]
        if node.reg is None:
            return
        if self.now < node.stalled_until:  # read when its loop runs again
            self.at(node.stalled_until, f"frame {src}>{dst}", self.deliver, src, instance, dst, data)
            return
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if msg.get("t") == "release":
            self.check_release(dst, msg)
        node.reg.now = self.now
        node.bus.receive(src, data)
        node.carry_out()

    def check_release(self, dst: str, msg: dict) -> None:
        """One job, one generation, one table: two releases of the same generation of a job
        with different tables would give ranks different views of the job."""
        key = (msg.get("job"), msg.get("generation"))
        table = msgpack.packb(msg.get("table"), use_bin_type=True)
        first = self.releases.setdefault(key, table)
        if first != table:
            self.violate("one-table", f"node {dst} got a release of job {key[0]} generation {key[1]} whose table "
                                      "differs from another release of that generation")

    # ------------------------------------------------------------------ processes
    def spawn(self, job: str, rank: int, uid: int | None = None) -> Proc:
        ep_size, policy, owner, placement = self.jobs[job]
        self.next_pid += 1
        p = Proc(pid=self.next_pid, uid=owner if uid is None else uid, node=placement[rank], job=job, rank=rank,
                 ep_size=ep_size, policy=policy, old=self.mixed_releases and self.next_pid % 4 == 1)
        self.kernel.procs[p.pid] = True
        self.procs[p.pid] = p
        self.at(self.now + self.rng.uniform(0, 0.2), f"join {p.pid}", self.join, p)
        return p

    @staticmethod
    def peer(p: Proc) -> Peer:
        return Peer(p.uid, p.uid, p.pid)

    def node_of(self, p: Proc) -> Node:
        return self.nodes[p.node]

    def join(self, p: Proc, timeout: float | None = None) -> None:
        """Attach (``timeout``: what is left of a join sent again after its daemon went)."""
        if not p.alive or p.state != "idle":
            return
        node = self.node_of(p)
        if node.reg is None:  # the client retries until a daemon answers
            self.at(self.now + 0.5, f"join {p.pid}", self.join, p)
            return
        p.rid += 1
        if timeout is None:
            timeout = self.rng.choice((2.0, 5.0, 10.0)) if self.cfg is None else self.rng.choice((5.0, 10.0, 20.0))
            p.deadline = self.now + timeout
        f = {"job": p.job, "ep_rank": p.rank, "ep_size": p.ep_size, "spec": dict(SPEC, on_peer_loss=p.policy),
             "pid": p.pid, "device": "host", "timeout": timeout, "watch": watch_tids(p.pid)}
        if not p.old:
            f["lines"] = True  # (this release's client combines through lines tails where a job has them)
        p.state = "joining"
        # (a daemon whose loop is stopped reads the request when it runs again)
        p.waiting_since, p.wait_bound, p.waiting_in = self.now, timeout + 1.5 + self.stopped_for(node), node.instance
        self.log(f"p{p.pid}", f"join {p.job} rank {p.rank} on {p.node} (timeout {timeout:g} s)")

        def go():
            try:
                node.reg.join(self.peer(p), p.pid.to_bytes(8, "little"), p.rid, f)
            except errors.A2ADError as exc:
                self.join_failed(p, exc.code, exc.message, exc.details)
        self.on_node(node, "join", go)

    def join_failed(self, p: Proc, code: str, message: str, details: dict) -> None:
        p.state = "idle"
        p.waiting_since = None
        self.log(f"p{p.pid}", f"join refused: {code}: {message[:100]}")
        if code == "job_destroyed":  # nothing here destroys a job a rank is joining
            self.violate("join-destroyed", f"pid {p.pid}'s join of {p.job} rank {p.rank} ended: {message}")
        holder = details.get("node")
        if code == "rank_taken" and holder is not None and not any(
                q.alive and q.job == p.job and q.rank == p.rank and q.node == holder for q in self.procs.values()):
            self.violate("coordinator-decides", f"pid {p.pid}'s join of {p.job} rank {p.rank} refused as held on "
                                                f"node {holder}, where no process holds it: {message}")
        if code == "rank_taken" and details.get("holder_pid") == p.pid and p.conn is None:
            self.violate("own-rank-refused", f"pid {p.pid}'s join of {p.job} rank {p.rank} refused as held by itself: "
                                             f"{message}")
        p.tries += 1
        if p.tries < 6:
            self.at(self.now + self.rng.uniform(0.2, 2.0), f"join {p.pid}", self.join, p)
        else:
            self.exit(p, "gave up")

    def on_reply(self, pid: int, daemon: tuple, reply) -> None:
        p = self.procs.get(pid)
        node = self.nodes[daemon[0]]
        if p is None or not p.alive:
            return
        if (daemon[1] != node.instance or node.reg is None) and daemon[1] not in node.flushed:
            return  # lost with a daemon that was killed
        if self.now < p.stalled_until:
            self.at(p.stalled_until, f"reply to {pid}", self.on_reply, pid, daemon, reply)
            return
        if p.state == "joining":
            p.waiting_since = None
            if not reply.ok:
                self.join_failed(p, reply.code, reply.message, reply.payload)
                return
            p.lease = reply.payload["lease"]
            p.state = "redeeming"
            if self.stall_next_attach:
                # its daemon stops right after it released the join, before it sees the redeem:
                # its last report says the rank is joining
                self.stall_next_attach = False
                self.stall_node(node, self.rng.choice((3.0, 5.0, 8.0)))
            self.at(self.now + self.rng.choice((0.0, 0.001, 0.05)), f"redeem {pid}", self.redeem, p,
                    reply.payload["ticket"], "join")
        elif p.state == "recovering":
            p.waiting_since = None
            p.state = "attached"
            self.log(f"p{p.pid}", f"recovered ({reply.code})")
            # (a recover that timed out is asked again at once while the job still needs it)
            self.next_act(p, self.rng.uniform(0.05, 0.2) if not reply.ok else self.rng.uniform(0.1, 4.0))

    def abort_seen(self, node: Node, cb) -> None:
        """An abort word was set: the ranks of that job on that node leave their rounds and,
        at their next step, recover."""
        for p in self.procs.values():
            if p.alive and p.node == node.name and p.state == "attached" and node.reg is not None:
                job = node.reg.jobs.get(p.job)
                if job is not None and job.control is cb:
                    self.next_act(p, self.rng.uniform(0.001, 0.05) + max(0.0, p.stalled_until - self.now))

    def request_lost(self, p: Proc, rid: int) -> None:
        """The client saw the daemon holding its join or recover go (client/attach.py): a
        recover whose job was re-armed before the daemon went (its control block's generation
        moved) is done; otherwise it waits for a daemon to listen and asks it again for what is
        left of its wait."""
        if not p.alive or p.rid != rid or p.state not in ("joining", "recovering"):
            return
        if p.state == "recovering" and p.cb is not None and p.cb.generation != p.sent_generation:
            p.state = "attached"
            self.log(f"p{p.pid}", "its daemon went, after the re-arm: recovered")
            self.next_act(p, self.rng.uniform(0.1, 4.0))
            return
        self.log(f"p{p.pid}", f"its daemon went away during its {p.state}: it asks the next one")
        self.ask_again(p, rid)

    def ask_again(self, p: Proc, rid: int) -> None:
        if not p.alive or p.rid != rid or p.state not in ("joining", "recovering"):
            return
        node = self.node_of(p)
        left = p.deadline - self.now
        # a recover waits for its lease too (maintain renews it once a daemon listens)
        ready = node.reg is not None and (p.state == "joining" or p.conn is not None)
        if ready:
            if p.state == "joining":
                p.state = "idle"
                self.join(p, timeout=max(0.0, left))
            else:
                self.recover(p, timeout=max(0.0, left))
            return
        if left <= 0:  # DaemonUnavailable: no daemon listened again within the wait
            self.log(f"p{p.pid}", f"its {p.state} waited its time for a daemon to listen again; none did")
            if p.state == "joining":
                self.join_failed(p, "daemon_unavailable", "no daemon listened again", {})
            else:
                p.state = "attached"
                self.next_act(p, 0.1)
            return
        self.at(self.now + min(0.5, left), f"ask again {p.pid}", self.ask_again, p, rid)

    def redeem(self, p: Proc, ticket: bytes, kind: str) -> None:
        node = self.node_of(p)
        if not p.alive or not (p.state == "redeeming" if kind == "join" else p.renewing):
            return
        if node.reg is None:
            # no daemon listens on fd.sock: the client's connect fails (DaemonUnavailable); a join
            # is tried again, a renew asked for again once a daemon answers
            self.log(f"p{p.pid}", "redeem: no daemon listening")
            if kind == "join":
                self.join_later(p, 0.5)
            else:
                p.renewing = False
                self.at(self.now + 0.5, f"renew {p.pid}", self.renew, p)
            return
        if self.now < node.stalled_until:
            self.at(node.stalled_until, f"redeem {p.pid}", self.redeem, p, ticket, kind)
            return
        try:
            r = node.event(node.reg.redeem, ticket, self.peer(p))
        except errors.A2ADError as exc:
            self.log(f"p{p.pid}", f"redeem refused: {exc.code}")
            if kind == "join":
                self.join_later(p, 0.2)
            else:
                p.renewing = False
                self.exit(p, "could not renew its lease")
            return
        # (drawn at the redeem, so that the world's rng does not depend on when the answer goes out)
        gone = kind == "join" and self.rng.random() < 0.03  # the client stalls or closes before the fds reach it
        travel = None if gone else self.rng.choice((0.0, 0.002, 0.2))
        # the server answers the turn's redeems at its end, once the state file holds them
        node.answers.append((p, r, kind, travel))
        self.at(self.now + ANSWER_DELAY, f"answer {p.pid}", self.answer, p, node, node.instance, r, kind, travel)

    def join_later(self, p: Proc, after: float) -> None:
        """``p`` does not hold its rank (its redeem failed or went unanswered): it joins again
        ``after`` seconds later."""
        p.state = "idle"
        self.at(self.now + after, f"join {p.pid}", self.join, p)

    def answer(self, p: Proc, node: Node, instance: int, r, kind: str, travel: float | None) -> None:
        """The end of the server's turn (server.py ``_flush``): the state file was written
        (``carry_out`` of the redeem's event), now the redeem's answer goes out, and then the
        state file again for what that changed. A daemon that went before it leaves the
        client's connection without an answer: a join's process joins again, a renew is asked
        again (the client's lease upkeep). An armed ``kill-mid-redeem`` kills the daemon here,
        before the answer or after it and before the write that follows."""
        if node.instance == instance and node.reg is not None:
            mine = [a for a in node.answers if a[1] is r]
            if not mine:
                return  # (answered already: its daemon stopped at the end of that turn)
            if self.now < node.stalled_until:
                self.at(node.stalled_until, f"answer {p.pid}", self.answer, p, node, instance, r, kind, travel)
                return
            node.answers.remove(mine[0])
        else:
            if kind == "join" and p.alive and p.state == "redeeming":
                self.log(f"p{p.pid}", "its redeem got no answer: the daemon went; it joins again")
                self.join_later(p, self.rng.uniform(0.05, 1.0))
            elif kind == "renew" and p.alive and p.renewing:
                p.renewing = False  # (its lease stays down: the client renews again, with backoff)
                self.at(self.now + 0.5, f"renew {p.pid}", self.renew, p)
            return
        when = node.kill_mid_redeem if kind == "join" else None
        if when == "before":
            node.kill_mid_redeem = None
            self.restart(node, self.mrng.uniform(0.1, 2.0), "after it recorded a redeem, before its answer")
            if node.reg is None:
                self.answer(p, node, instance, r, kind, travel)
                return
        reg = node.reg
        reg.now = self.now
        exc = reg.undeliverable(r)
        if exc is not None:
            node.carry_out()
            self.log(f"p{p.pid}", f"redeem refused at its answer: {exc.code}")
            if kind == "join" and p.state == "redeeming":
                self.join_later(p, 0.2)
            elif kind == "renew" and p.renewing:
                p.renewing = False  # (asked again: a rank no longer attached for it is refused there)
                self.at(self.now + 0.5, f"renew {p.pid}", self.renew, p)
            return
        if travel is None:
            reg.undelivered(r, "client gone")
            node.carry_out()
            self.log(f"p{p.pid}", "handles not delivered")
            self.join_later(p, 0.3)
            return
        conn = LeaseConn(pid=p.pid, daemon=(node.name, node.instance))
        node.conns.append(conn)
        reg.delivered(r, conn)
        # the fds travel; an upgrade in between resets them (upgrade() below)
        self.at(self.now + travel, f"handles {p.pid}", self.got_handles, p, conn, kind)
        if when == "after":
            node.kill_mid_redeem = None
            self.restart(node, self.mrng.uniform(0.1, 2.0), "after it sent a redeem's handles, before the "
                                                              "state write that follows")
            if node.reg is None:
                return
        node.carry_out()

    def got_handles(self, p: Proc, conn: LeaseConn, kind: str) -> None:
        """The answer reaches the client. Its fds were queued on the socket before the daemon
        could go: a connection closed since (its daemon killed) still delivers them, and the
        client then sees its lease end and renews."""
        if not p.alive:
            return
        if kind == "renew":
            if p.renewing:
                p.renewing = False
                if conn.open:
                    p.conn = conn
                    self.log(f"p{p.pid}", "renewed its lease")
                else:
                    self.at(self.now + self.rng.uniform(0.05, 1.0), f"renew {p.pid}", self.renew, p)
            return
        if p.state != "redeeming":
            return
        p.state = "attached"
        p.tries = 0
        if conn.open:
            p.conn = conn
            self.log(f"p{p.pid}", f"attached ({kind})")
        else:
            self.log(f"p{p.pid}", f"attached ({kind}); its daemon went after sending the handles: it renews")
            self.at(self.now + self.rng.uniform(0.05, 1.0), f"renew {p.pid}", self.renew, p)
        self.next_act(p, self.rng.uniform(0.5, 8.0))

    def next_act(self, p: Proc, after: float) -> None:
        p.acts += 1
        self.at(self.now + after, f"act {p.pid}", self.act, p, p.acts)

    def act(self, p: Proc, chain: int) -> None:
        """An attached process's next step: serve on, leave, die, stall, ask for a re-arm."""
        if not p.alive or p.state != "attached" or chain != p.acts:
            return
        if self.now < p.stalled_until:
            self.next_act(p, p.stalled_until - self.now)
            return
        node = self.node_of(p)
        job = node.reg.jobs.get(p.job) if node.reg is not None else None
        if job is not None and job.control.abort_word:
            # its next round raises (PeerLost, or a re-arm asked for): it recovers
            self.recover(p)
            return
        stuck = self.stuck.get(p.job)
        if stuck is not None and self.now - stuck > ROUND_TIMEOUT:
            # a peer has not served its rounds for the round timeout: PeerTimeout, then recover
            self.log(f"p{p.pid}", "PeerTimeout")
            self.recover(p)
            return
        x = self.rng.random()
        if self.now > self.active:  # then quiet: it serves (and recovers when told to)
            self.next_act(p, self.rng.uniform(0.5, 2.0))
            return
        # (in a domain the daemons' faults are what is explored: its ranks churn less)
        leave, kill = (0.2, 0.4) if self.cfg is None else (0.03, 0.1)
        if x < leave:
            self.leave(p)
        elif x < kill:
            self.kill(p)
        elif x < kill + 0.06:
            self.stall(p, self.rng.uniform(0.5, 10.0))
            self.next_act(p, p.stalled_until - self.now)
        elif x < kill + 0.1:
            self.recover(p)
        else:
            self.next_act(p, self.rng.uniform(0.5, 8.0))

    def leave(self, p: Proc) -> None:
        node = self.node_of(p)
        if node.reg is not None:
            try:
                node.event(node.reg.leave, self.peer(p), {"job": p.job, "ep_rank": p.rank, "lease": p.lease})
                self.log(f"p{p.pid}", "left")
            except errors.A2ADError as exc:
                self.log(f"p{p.pid}", f"leave refused: {exc.code}")
        self.exit(p, "after leaving")

    def recover(self, p: Proc, timeout: float | None = None) -> None:
        """Ask for the re-arm (``timeout``: what is left of a recover sent again after its
        daemon went)."""
        node = self.node_of(p)
        if node.reg is None or self.now < node.stalled_until:
            if timeout is not None:  # sent again: the client waits on, within its own wait
                self.at(self.now + 0.5, f"ask again {p.pid}", self.ask_again, p, p.rid)
            else:
                self.next_act(p, 1.0)
            return
        if timeout is None:
            timeout = RECOVER_TIMEOUT
            p.deadline = self.now + timeout
        p.rid += 1
        job = node.reg.jobs.get(p.job)
        p.cb = job.control if job is not None else None
        p.sent_generation = p.cb.generation if p.cb is not None else 0
        try:
            node.event(node.reg.recover, self.peer(p), p.pid.to_bytes(8, "little"), p.rid,
                       {"job": p.job, "ep_rank": p.rank, "lease": p.lease, "timeout": timeout})
        except errors.A2ADError as exc:
            self.log(f"p{p.pid}", f"recover refused: {exc.code}")
            p.state = "attached"
            self.next_act(p, 1.0)
            return
        p.state = "recovering"
        p.waiting_since, p.wait_bound, p.waiting_in = self.now, timeout + 1.5 + self.stopped_for(node), \
            node.instance
        self.log(f"p{p.pid}", "recover")

    def stall(self, p: Proc, seconds: float) -> None:
        self.fault(f"p{p.pid} stalled {seconds:.1f} s")
        p.stalled_until = self.now + seconds
        if p.waiting_since is not None:  # a stalled process reads no reply: its wait is that much longer
            p.wait_bound += seconds

    def exit(self, p: Proc, why: str) -> None:
        """The process ends: its watch threads end first, then the kernel closes its lease
        socket and reports it to its pidfds."""
        if not p.alive:
            return
        p.alive = False
        p.state = "gone"
        self.kernel.procs[p.pid] = False
        self.log(f"p{p.pid}", f"exits ({why})")
        for tid in watch_tids(p.pid):
            self.at(self.now + self.rng.choice((0.0, 0.0001, 0.001)), f"thread {tid} ends", self.on_thread_exit, p, tid)
        conn = p.conn
        if conn is not None and conn.open:
            self.at(self.now + self.rng.choice((0.0, 0.001, 0.1)), f"lease EOF {p.pid}", self.on_lease_closed, conn)
        self.at(self.now + self.rng.choice((0.0, 0.001, 0.1)), f"pidfd {p.pid}", self.on_pid_exit, p)

    def kill(self, p: Proc, replace: bool = False) -> None:
        self.fault(f"kill -9 p{p.pid} ({p.job} rank {p.rank})")
        self.exit(p, "kill -9")
        if replace or self.rng.random() < (0.8 if self.cfg is None else 0.95):  # a replacement comes for the rank
            self.at(self.now + self.rng.uniform(0.1, 3.0), "replace", self.spawn, p.job, p.rank)

    def on_lease_closed(self, conn: LeaseConn) -> None:
        """The daemon sees the lease connection end (EOF)."""
        if not conn.open:
            return
        conn.open = False
        node = self.nodes[conn.daemon[0]]
        if node.instance == conn.daemon[1]:
            self.on_node(node, "lease closed", node.reg.lease_closed, conn) if node.reg is not None else None

    def on_pid_exit(self, p: Proc) -> None:
        node = self.node_of(p)
        if node.reg is None:
            return
        for fd, (kind, obj, opid) in list(node.host.fds.items()):
            if kind == "pidfd" and opid == p.pid and fd in node.reg.pidfds:
                self.on_node(node, "pidfd", node.reg.pid_exited, fd)

    def on_thread_exit(self, p: Proc, tid: int) -> None:
        node = self.node_of(p)
        if node.reg is None:
            return
        for fd, (kind, obj, opid) in list(node.host.fds.items()):
            if kind == "pidfd" and obj == ("tid", tid) and fd in node.reg.pidfds:
                self.on_node(node, "thread pidfd", node.reg.pid_exited, fd)

    def on_lease_eof(self, conn: LeaseConn) -> None:
        """The client sees its lease connection end: a daemon restart; it renews its lease."""
        p = self.procs.get(conn.pid)
        if p is None or not p.alive or p.conn is not conn:
            return
        p.conn = None
        if p.state in ("attached", "recovering"):
            self.at(self.now + self.rng.uniform(0.05, 1.0), f"renew {p.pid}", self.renew, p)

    def renew(self, p: Proc) -> None:
        node = self.node_of(p)
        if not p.alive or p.conn is not None or p.state not in ("attached", "recovering"):
            return
        if node.reg is None or self.now < node.stalled_until:
            self.at(max(self.now + 0.5, node.stalled_until), f"renew {p.pid}", self.renew, p)
            return
        try:
            out = node.event(node.reg.renew, self.peer(p), {"job": p.job, "ep_rank": p.rank, "lease": p.lease,
                                                             "pid": p.pid, "watch": watch_tids(p.pid)})
        except errors.A2ADError as exc:
            self.log(f"p{p.pid}", f"renew refused: {exc.code}: {exc.message[:80]}")
            if not node.adopted_stale:
                self.violate("attach-kept", f"pid {p.pid} holds the handles of {p.job} rank {p.rank}; {node.name}'s "
                                            f"daemon (instance {node.instance}) refused its renew: {exc.message}")
            self.exit(p, "lost its job")
            return
        p.renewing = True
        self.at(self.now + 0.001, f"redeem {p.pid}", self.redeem, p, out["ticket"], "renew")

    # ------------------------------------------------------------------- daemons
    def upgrade(self, node: Node) -> None:
        """``a2ad-ctl upgrade``: the successor takes every job over (the state and the fds
        handed to it). The old daemon's queued answers to redeems are dropped (``answer``:
        their processes join again); handles it already sent still arrive (``got_handles``:
        their processes renew at the successor); a ticket not yet presented is unknown to the
        successor (``redeem``: refused, its process joins again)."""
        if node.reg is None or self.now < node.stalled_until:
            return
        self.fault(f"upgrade of {node.name}")
        if node.keeper.down:  # a daemon that hands over starts a keeper first (fdstore.py close)
            self.keeper_refill(node, node.instance)
        node.write_state()
        handover = node.state_records
        node.stop("upgrade hand-over")
        node.start(adopt=True, handover=handover)

    def keeper_restart(self, node: Node, down: float) -> None:
        """``node``'s keeper dies with every fd it held; the daemon notices at its next check
        and starts another, which it fills with every fd it holds (fdstore.py ``check``)."""
        if node.reg is None or node.keeper.down:
            return
        self.fault(f"{node.name}'s keeper killed, a new one filled after {down:.1f} s")
        node.keeper.down = True
        node.keeper.kept.clear()
        self.at(self.now + down, "keeper refill", self.keeper_refill, node, node.instance)

    def keeper_refill(self, node: Node, instance: int) -> None:
        if node.reg is None or node.instance != instance:
            return
        if self.now < node.stalled_until:
            self.at(node.stalled_until, "keeper refill", self.keeper_refill, node, instance)
            return
        node.keeper.kept = {name: node.host.fds[fd][1] for name, fd in node.reg.all_fds().items()}
        node.keeper.down = False
        self.log(node.name, f"keeper filled again ({len(node.keeper.kept)} fds)")

    def slow_gate(self, node: Node) -> float:
        """A restarted daemon's new gate, on a machine whose CPUs are taken, may not run its
        loop for a while after it said READY: the other nodes' connections wait for its
        handshake (their frames are dropped), and it reports nothing. Returns for how long
        (0: it runs at once)."""
        if not self.slow_gates or node.instance < 2 or self.gate_rng.random() < 0.5:
            return 0.0
        deaf = self.gate_rng.uniform(0.3, 2.5) * self.cfg.loss_bound
        node.deaf.append((self.now, self.now + deaf))
        self.log(node.name, f"its new gate does not run for {deaf:.2f} s")
        return deaf

    def check_unheard_loss(self, node: Node, peer: str) -> None:
        """A peer that ``node``'s daemon has not heard since it started listening is counted
        lost only once it could have been heard for the loss bound: time in which its daemon
        was stopped or its gate did not run is not the peer's silence (less what the links
        cannot tell: two heartbeats of each stop, a report period of each time the gate did
        not run)."""
        start, now = node.listen_at, self.now

        def overlap(spans):
            return [min(b, now) - max(a, start) for a, b in spans if min(b, now) > max(a, start)]

        deaf, stalls = overlap(node.deaf), overlap(node.stalls)
        could_hear = now - start - sum(deaf) - sum(stalls)
        slack = GATE_PERIOD * len(deaf) + 2 * self.cfg.heartbeat_interval * len(stalls)
        if could_hear < self.cfg.loss_bound - slack - 1e-9:
            self.violate("unheard-loss", f"{node.name} counted {peer} lost, not heard since it started listening "
                                         f"{now - start:.2f} s ago, while it could hear for {could_hear:.2f} s "
                                         f"(its gate did not run for {sum(deaf):.2f} s, it was stopped "
                                         f"{sum(stalls):.2f} s)")

    def restart(self, node: Node, down: float, when: str = "") -> None:
        if node.keeper.down:
            # a daemon killed while its keeper is down takes the only copies of its fds with it:
            # a double failure that loses its jobs by design; not scheduled
            self.log(node.name, "kill -9 of the daemon left out: its keeper is down")
            return
        self.fault(f"kill -9 of {node.name}'s daemon{' ' + when if when else ''}, back after {down:.1f} s")
        node.stop("killed")
        self.at(self.now + down, "daemon start", self._start, node)

    def graceful_restart(self, node: Node, down: float) -> None:
        if node.reg is None or self.now < node.stalled_until:
            return
        self.fault(f"{node.name}'s daemon stopped (SIGTERM), started again after {down:.1f} s")
        if node.keeper.down:  # a daemon that stops keeping jobs starts a keeper first (fdstore.py close)
            self.keeper_refill(node, node.instance)
        node.shutdown()
        self.at(self.now + down, "daemon start", self._start, node)

    def _start(self, node: Node) -> None:
        if node.reg is None:
            node.start(adopt=True)

    def arm_kill_mid_redeem(self, node: Node, when: str) -> None:
        self.log(node.name, f"armed: a kill -9 {when} the next answer to a join's redeem")
        node.kill_mid_redeem = when

    def disk_full(self, node: Node, seconds: float) -> None:
        self.fault(f"{node.name}'s disk full for {seconds:.1f} s")
        node.disk_full_until = self.now + seconds

    def stall_node(self, node: Node, seconds: float) -> None:
        self.fault(f"{node.name}'s daemon stopped (SIGSTOP) for {seconds:.1f} s")
        node.stalled_until = max(node.stalled_until, self.now + seconds)
        node.stalls.append((self.now, self.now + seconds))
        for p in self.procs.values():  # what waits on it waits that much longer
            if p.alive and p.node == node.name and p.waiting_since is not None:
                p.wait_bound += seconds + 0.5

    def partition(self, a: list[str], b: list[str], seconds: float, one_way: bool) -> None:
        mode = self.rng.choice(("delay", "reset"))
        self.fault(f"{'one-way ' if one_way else ''}partition {a} | {b} for {seconds:.1f} s ({mode})")
        until = self.now + seconds
        for x in a:
            for y in b:
                if x == y:
                    continue
                pairs = [(x, y)] if one_way else [(x, y), (y, x)]
                for pair in pairs:
                    self.cut[pair] = (until, mode)
                if mode == "reset":
                    self.at(until, "reconnect", self.reconnect, x, y)

    def mess_link(self, a: str, b: str, seconds: float) -> None:
        self.fault(f"frames between {a} and {b} duplicated and reordered for {seconds:.1f} s")
        self.mess[(a, b)] = self.mess[(b, a)] = self.now + seconds

    def gate_restart(self, node: Node, seconds: float) -> None:
        """``node``'s gate dies and its successor binds the domain port ``seconds`` later: the
        connections other nodes hold to it are reset and refused until then (the daemon itself
        serves on: it waits for the new gate in its loop)."""
        self.fault(f"{node.name}'s gate killed, a new one listening after {seconds:.1f} s")
        until = self.now + seconds
        node.deaf.append((self.now, until))
        for other in self.nodes:
            if other != node.name:
                self.cut[(other, node.name)] = (until, "reset")
                self.at(until, "reconnect", self.reconnect, other, node.name)

    def reconnect(self, a: str, b: str) -> None:
        """The transport between ``a`` and ``b`` connects again: a handshake at both ends."""
        for x, y in ((a, b), (b, a)):
            node = self.nodes[x]
            if node.bus is not None:
                node.bus.links.link_up(node.bus.peers[y])

    def steal(self) -> None:
        """Another user's process presents a lease token it got hold of."""
        victims = [p for p in self.procs.values() if p.alive and p.state == "attached" and p.lease]
        if not victims:
            return
        v = self.rng.choice(victims)
        node = self.node_of(v)
        if node.reg is None or self.now < node.stalled_until:
            return
        other = UIDS[1] if v.uid == UIDS[0] else UIDS[0]
        self.next_pid += 1
        thief = self.next_pid
        self.kernel.procs[thief] = True
        self.fault(f"uid {other} presents {v.job} rank {v.rank}'s lease token")
        try:
            node.event(node.reg.leave, Peer(other, other, thief), {"job": v.job, "ep_rank": v.rank, "lease": v.lease})
        except errors.A2ADError as exc:
            self.log("thief", f"leave refused: {exc.code}")
        else:
            self.violate("foreign-leave", f"uid {other} (pid {thief}) made {v.job} rank {v.rank} (uid {v.uid}) leave "
                                          "with its lease token")
        self.kernel.procs[thief] = False

    def arm_stall_after_attach(self, job: str) -> None:
        """A rank of ``job`` is killed and replaced, and the replacement's daemon stops right
        after it released the replacement's join, before the replacement redeems its ticket
        and attaches."""
        victims = [p for p in self.procs.values() if p.alive and p.job == job and p.state == "attached"]
        if victims:
            self.stall_next_attach = True
            self.kill(self.rng.choice(victims), replace=True)

    def node_ranks_lost(self, job: str) -> None:
        """Every rank of ``job`` outside one node is killed, and one rank on that node: its
        replacement comes first (let back in while no other node has live ranks of the job),
        the other nodes' replacements seconds later."""
        alive = [p for p in self.procs.values() if p.alive and p.job == job and p.state == "attached"]
        keep = [n for n in sorted({p.node for p in alive}) if sum(p.node == n for p in alive) >= 2]
        if not keep or len({p.node for p in alive}) < 2:
            return
        kept = self.rng.choice(keep)
        self.fault(f"every rank of {job} outside {kept} killed, and one on it")
        for p in alive:
            if p.node != kept:
                self.exit(p, "kill -9")
                self.at(self.now + self.rng.uniform(3.0, 6.0), "replace", self.spawn, p.job, p.rank)
        self.kill(self.rng.choice([p for p in alive if p.node == kept]), replace=True)

    def liar(self, job: str) -> None:
        """A node that is not the job's coordinator claims, as if it were, that one of the
        job's ranks is held on it: while a replacement of that rank waits in its join, the
        others must refuse the claim (only a job's coordinator decides)."""
        victims = [p for p in self.procs.values() if p.alive and p.job == job and p.state == "attached"]
        if not victims:
            return
        v = self.rng.choice(victims)
        order = coordinator_order(job, sorted(self.nodes))
        liar = self.nodes[order[-1]]
        if liar.reg is None or liar.name == v.node:
            return
        self.fault(f"{liar.name} (not {job}'s coordinator) claims rank {v.rank}, while it is replaced")
        self.kill(v, replace=True)
        for k in range(20):
            self.at(self.now + 0.3 * k, "forged refuse_rank", self._forge, liar, job, v.rank)

    def _forge(self, liar: Node, job: str, rank: int) -> None:
        if liar.bus is None:
            return
        for name in self.nodes:
            if name != liar.name:
                liar.bus.send(name, {"t": "refuse_rank", "job": job, "rank": rank, "holder": liar.name})

    def timers(self, node: Node) -> None:
        if node.reg is not None and self.now >= node.stalled_until:
            node.timers()
        self.at(self.now + 0.25 if self.now >= node.stalled_until else node.stalled_until, f"timers {node.name}",
                self.timers, node)

    # -------------------------------------------------------------------- checks
    def check(self) -> None:
        for name in self.jobs:  # since when a job's live ranks have not all been serving together
            serving = all(q.state == "attached" and self.now >= q.stalled_until
                          for q in self.procs.values() if q.alive and q.job == name)
            if serving:
                self.stuck.pop(name, None)
            else:
                self.stuck.setdefault(name, self.now)
        for kind, detail in self.problems:
            self.violate(kind, detail)
        self.problems.clear()
        for p in self.procs.values():
            if not p.alive:
                continue
            node = self.node_of(p)
            reg = node.reg
            if p.waiting_since is not None and self.now - p.waiting_since > p.wait_bound and reg is not None \
                    and self.now >= max(p.stalled_until, node.stalled_until):
                self.violate("reply-bound", f"pid {p.pid} waits in its {p.state} on {p.node} since "
                                            f"{p.waiting_since:.3f} (bound {p.wait_bound:g} s)")
                p.waiting_since = None
            if reg is None:
                continue
            job = reg.jobs.get(p.job)
            if p.state == "attached" and p.conn is not None and job is None and node.instance == p.conn.daemon[1]:
                self.violate("job-lost", f"pid {p.pid} holds {p.job} rank {p.rank}, which {p.node}'s daemon no "
                                         "longer has")
            slot = job.slots[p.rank] if job is not None else None
            held_for_it = slot is not None and slot.node is None and slot.state == L.RANK_ATTACHED \
                and slot.pid == p.pid
            if held_for_it and p.state in ("idle", "joining"):
                if p.stranded_since is None:
                    p.stranded_since = self.now
                elif self.now - p.stranded_since > STRANDED_BOUND:
                    self.violate("stranded-rank", f"{p.job} rank {p.rank} held attached for pid {p.pid} since "
                                                  f"{p.stranded_since:.3f}, which does not hold it")
                    p.stranded_since = None
            else:
                p.stranded_since = None
        for node in self.nodes.values():
            if node.reg is not None and node.touched:
                node.touched = False
                self.check_fds(node)
                for job in node.reg.jobs.values():
                    self.check_tail(node, job)
                    if not job.freed and job.generation != job.control.generation:
                        self.violate("generation-kept", f"{node.name}'s daemon holds job {job.name} at generation "
                                                        f"{job.generation}; its control block says "
                                                        f"{job.control.generation}")

    def check_tail(self, node: Node, job) -> None:
        backend = node.reg.backend
        want = backend.lines_tail and node.bus is None and job.ep_size <= L.MAX_LINES_EP_SIZE
        # (where releases mix, a job that an earlier release's client created has no tail)
        missing = not job.lines_tail and want and not self.mixed_releases
        if missing or (job.lines_tail and not want) or (job.lines_tail and job.lines_tail != L.lines_tail_offset(
                job.size_per_rank, job.row_stride)):
            self.violate("row-tail", f"{node.name}'s job {job.name} (ep {job.ep_size}) has its lines tail at "
                                     f"{job.lines_tail} in rows of {job.row_stride} bytes")
        for s in job.slots:
            # (rows adopted after a restart were initialized by an earlier instance)
            zeroed = backend.tails.get(s.alloc.fd, job.tail_bytes) if s.alloc is not None else job.tail_bytes
            if zeroed != job.tail_bytes:
                self.violate("row-tail", f"{node.name}'s last initialization of {job.name} rank {s.rank}'s row "
                                         f"zeroed a tail of {zeroed} bytes, not {job.tail_bytes}")
                backend.tails[s.alloc.fd] = job.tail_bytes  # (reported once)
            q = self.procs.get(s.pid) if s.live else None
            if job.lines_tail and q is not None and q.old and q.alive:
                self.violate("one-release", f"{node.name}'s job {job.name} combines through lines tails, and holds "
                                            f"rank {s.rank} for pid {s.pid}, a client of a release before them")

    def check_fds(self, node: Node) -> None:
        reg, host = node.reg, node.host
        owner: dict = {}
        for job in reg.jobs.values():
            owner[("cb", job.control_fd)] = job.owner_uid
            owner[("cb-map", job.control._map_fd)] = job.owner_uid
            for s in job.slots:
                if s.alloc is not None and s.alloc.fd >= 0:
                    owner[("row", s.alloc.fd)] = job.owner_uid
                if s.pidfd is not None:
                    owner[("pidfd", s.pidfd)] = job.owner_uid
                for fd in s.watchfds:
                    owner[("pidfd", fd)] = job.owner_uid
        for fd, (kind, obj, pid) in host.fds.items():
            if (kind, fd) not in owner:
                self.violate("fd-leak", f"{node.name}'s daemon holds {kind} fd {fd} for no job it knows")
        for uid in UIDS:
            counted = reg.uid_usage(uid)["fds"]
            real = sum(1 for (kind, fd), u in owner.items() if u == uid and fd in host.fds)
            # and a lease connection is the fd.sock connection the daemon keeps open
            real += sum(1 for job in reg.jobs.values() if job.owner_uid == uid for s in job.slots
                        if s.lease_conn is not None)
            if counted != real:
                self.violate("uid-fds", f"uid {uid}'s jobs hold {real} fds on {node.name}'s daemon; the per-uid cap "
                                        f"counts {counted}")

    def check_settled(self) -> None:
        """Once every fault is long over, for every job with a live process for each of its
        ranks: every node that holds it agrees on its generation, abort word, active mask and
        (degrade jobs) the ranks it counts let into the rounds (``job_info``'s active_ranks),
        and every one of those processes holds its rank."""
        complete = {name for name, (ep, _, _, _) in self.jobs.items()
                    if {p.rank for p in self.procs.values() if p.alive and p.job == name} == set(range(ep))}
        for name in sorted(complete):
            seen = {}
            for node in self.nodes.values():
                job = node.reg.jobs.get(name) if node.reg is not None else None
                if job is None or not any(s.node is None and s.state == L.RANK_ATTACHED for s in job.slots):
                    continue
                cb = job.control
                seen[node.name] = (job.generation, cb.abort_word != 0,
                                   tuple(L.mask_ranks(job.active_mask)) if job.degrade else None,
                                   tuple(job.mask_summary(self.now)["active_ranks"] or ()) if job.degrade else None)
            if len(set(seen.values())) > 1:
                self.violate("converged", f"job {name}: the nodes holding it disagree after the last fault at "
                                          f"{self.last_fault:.3f}: {seen}")
        for p in self.procs.values():
            if p.alive and p.job in complete and p.state not in ("attached", "gone"):
                self.violate("converged", f"pid {p.pid} ({p.job} rank {p.rank} on {p.node}) is still {p.state} "
                                          f"{self.now - self.last_fault:.1f} s after the last fault")

    # ---------------------------------------------------------------- the schedule
    def schedule(self) -> None:
        names = sorted(self.nodes)
        for j in range(1 if self.job_size else self.rng.randint(1, 3 if self.cfg is None else 2)):
            name = f"j{j}"
            if self.job_size:
                ep = self.rng.randint(*self.job_size)
            else:
                ep = self.rng.choice((1, 2, 2, 3, 4)) if self.cfg is None else self.rng.randint(2, 2 * len(names))
            placement = [names[r % len(names)] for r in range(ep)] if self.cfg is not None else [names[0]] * ep
            self.jobs[name] = (ep, self.rng.choice(("raise", "degrade")), UIDS[j % 2], placement)
            for r in range(ep):
                self.spawn(name, r)
        self.horizon = self.active + self.settle + 5.0
        for node in self.nodes.values():
            self.at(0.25, f"timers {node.name}", self.timers, node)
        kinds = ["restart", "upgrade", "upgrade", "disk-full", "steal", "kill-daemon"]
        if self.cfg is not None:
            kinds += ["stall-node", "stall-node", "partition", "partition", "one-way", "liar", "stall-after-attach",
                      "restart-while-lost", "node-ranks-lost"]
        for _ in range(self.rng.randint(0, 4)):
            t = self.rng.uniform(3, self.active)
            what = self.rng.choice(kinds)
            node = self.nodes[self.rng.choice(names)]
            if what == "restart":
                self.at(t, what, self.restart, node, self.rng.uniform(0.0, 2.0))
            elif what == "kill-daemon":
                self.at(t, what, self.restart, node, self.rng.uniform(0.5, 4.0))
            elif what == "upgrade":
                self.at(t, what, self.upgrade, node)
            elif what == "disk-full":
                self.at(t, what, self.disk_full, node, self.rng.uniform(1.0, 10.0))
            elif what == "stall-node":
                self.at(t, what, self.stall_node, node, self.rng.choice((0.5, 1.5, 3.0, 8.0)))
            elif what == "restart-while-lost":
                # a node is counted lost (stopped past the loss bound) and another node's daemon
                # is killed and started again before the lost node is heard again
                other = self.nodes[self.rng.choice([n for n in names if n != node.name])]
                lost_for = self.rng.uniform(1.6, 2.6) * self.cfg.loss_bound
                self.at(t, "stall-node", self.stall_node, node, lost_for)
                self.at(t + self.rng.uniform(1.1, 1.4) * self.cfg.loss_bound, "kill-daemon", self.restart, other,
                        self.rng.uniform(0.2, 1.0))
            elif what == "node-ranks-lost":
                self.at(t, what, self.node_ranks_lost, self.rng.choice(sorted(self.jobs)))
            elif what == "stall-after-attach":
                self.at(t, what, self.arm_stall_after_attach, self.rng.choice(sorted(self.jobs)))
            elif what == "liar":
                self.at(t, what, self.liar, self.rng.choice(sorted(self.jobs)))
            elif what in ("partition", "one-way"):
                side = [n for n in names if self.rng.random() < 0.5] or [names[0]]
                other = [n for n in names if n not in side] or [names[-1]]
                self.at(t, what, self.partition, side, other, self.rng.choice((0.5, 2.0, 6.0)), what == "one-way")
            else:
                self.at(t, what, self.steal)
        srng = random.Random(self.seed * 2654435761 + 11)  # (an rng of its own: the schedules above stay)
        if srng.random() < 0.3:
            # a daemon stopped (SIGTERM, as systemctl restart does) and started again: early, while
            # the jobs' first joins are held, or later
            t = srng.uniform(0.05, 1.5) if srng.random() < 0.5 else srng.uniform(3, self.active)
            self.at(t, "stop", self.graceful_restart, self.nodes[srng.choice(names)], srng.uniform(0.1, 2.0))
        if self.mrng.random() < 0.3:
            # a daemon killed in the middle of answering a join's redeem: after the state file
            # recorded the attach and before the handles went out, or after they went out and
            # before the state write that follows; armed early (the first joins) or later (a
            # replacement's)
            t = self.mrng.uniform(0.0, 1.5) if self.mrng.random() < 0.5 else self.mrng.uniform(3, self.active)
            self.at(t, "kill-mid-redeem", self.arm_kill_mid_redeem, self.nodes[self.mrng.choice(names)],
                    self.mrng.choice(("before", "after")))
        krng = random.Random(self.seed * 15485863 + 5)
        if krng.random() < 0.25:
            # a node's keeper is killed; its daemon starts and fills another within 0.5-2 s
            self.at(krng.uniform(3, self.active), "keeper-restart", self.keeper_restart,
                    self.nodes[krng.choice(names)], krng.uniform(0.5, 2.0))
        if self.cfg is not None:
            # a node's gate process is killed and started again; the new one binds the domain
            # port only after seconds (another process held it): an rng of its own, so that the
            # schedules above stay what they were
            grng = random.Random(self.seed * 7919 + 17)
            if grng.random() < 0.25:
                self.at(grng.uniform(3, self.active), "gate-restart", self.gate_restart,
                        self.nodes[grng.choice(names)], grng.uniform(0.05, 5.5))
            if grng.random() < 0.3:
                # frames between two nodes duplicated and reordered for a while
                a, b = grng.sample(names, 2)
                start, length = grng.uniform(2, self.active), grng.uniform(1.0, 10.0)
                self.at(start, "mess", self.mess_link, a, b, length)

    def run(self) -> Outcome:
        self.schedule()
        while self.q and self.steps < 60000:
            t, _, what, fn, args = heapq.heappop(self.q)
            if t > self.horizon:
                break
            self.now = t
            self.steps += 1
            fn(*args)
            self.check()
            if len(self.violations) >= 3:
                break
        if not self.violations:
            self.now = self.horizon
            self.check_settled()
        return Outcome(world=self.name, seed=self.seed, steps=self.steps, faults=self.faults,
                       violations=self.violations, trace=self.trace)


def _quiet() -> None:
    logging.getLogger("a2ad").setLevel(logging.CRITICAL)


@register("daemon")
def run_daemon(seed: int, mutation: str | None = None) -> Outcome:
    """One node's daemon and up to three jobs of up to four ranks."""
    _quiet()
    with mutations.enabled(mutation):
        return World("daemon", seed, mutation, nodes=1, domain=False).run()


@register("wide", default=False)
def run_wide(seed: int, mutation: str | None = None) -> Outcome:
    """A domain of the sizes the docs measure with real daemons: 8-18 nodes with a job of 2 to
    4 ranks per node (up to ep 72 over 18), or, one seed in four, ep 256 over 4 nodes."""
    _quiet()
    rng = random.Random(seed ^ 0x3D1E)
    if rng.random() < 0.25:
        nodes, size = 4, (256, 256)
    else:
        nodes = rng.randint(8, 18)
        size = (2 * nodes, 4 * nodes)
    with mutations.enabled(mutation):
        return World("wide", seed, mutation, nodes=nodes, domain=True, job_size=size).run()


@register("domain")
def run_domain(seed: int, mutation: str | None = None) -> Outcome:
    """Two to four nodes' daemons in a domain, one or two jobs spread over them."""
    _quiet()
    rng = random.Random(seed ^ 0x5EED)
    with mutations.enabled(mutation):
        return World("domain", seed, mutation, nodes=rng.randint(2, 4), domain=True).run()
