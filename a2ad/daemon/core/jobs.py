"""A job and its rank slots: what the registry holds about each, and the one place a rank's
state changes (:meth:`Job.set_rank_state`, which keeps the slot and the job's control block,
where the ranks read it, in step).

A slot of a job that spans nodes (federation.py) whose row another node's daemon holds has
``RankSlot.node`` set and mirrors what that node reports (mirror.py); every other slot is
this daemon's own. ``Job.this_node`` is this daemon's own node name in its domain.

The domain protocol (federation.py) does not read these objects: it gets a job as plain
data through the registry, ``JobFacts`` (``Job.facts``: its fixed fields, whether the
domain's decision reached it) and its report (``Job.report``: this daemon's ranks of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a2ad import errors, layout as L, protocol
from a2ad.control import ControlBlock
from a2ad.daemon.backends.base import Allocation
from a2ad.daemon.core.policy import active_mask, admitted_ranks


@dataclass
class Held:
    """A reply the registry holds back (a join waiting for its rendezvous, a recover waiting
    for the re-arm)."""

    identity: bytes
    request_id: int
    deadline: float


@dataclass
class RankSlot:
    rank: int
    state: int = L.RANK_EMPTY
    pid: int | None = None
    uid: int | None = None
    device: str | None = None
    alloc: Allocation | None = None
    pending: Held | None = None
    #: A held `recover` reply: this rank is quiesced and waits for the job's re-arm.
    recovering: Held | None = None
    #: Secret that proves a later request (leave, recover, renew) comes from this rank's holder.
    lease: bytes | None = None
    ticket: bytes | None = None
    ticket_kind: str | None = None
    ticket_expiry: float = 0.0
    #: The open fd-socket connection that is this rank's lease (an fd socket connection).
    lease_conn: object | None = None
    #: pidfd watching the rank's process while no lease connection stands for it.
    pidfd: int | None = None
    #: Thread ids of the rank process's watch threads (its join or renew names them): threads
    #: that end only with the process, each watched with a thread pidfd while the rank holds
    #: its lease. A sub-thread's end is reported before the process has torn down its memory
    #: and closed its files, the kernel's slow part of a death: tens of milliseconds sooner
    #: than the lease connection's end.
    watch: tuple[int, ...] = ()
    #: the thread pidfds on ``watch`` (each also in ``Registry.pidfds``)
    watchfds: list[int] = field(default_factory=list)
    leaving: bool = False
    #: A replacement let into a degraded job without a job-wide re-arm: its bit in the
    #: active mask is set once it holds its handles (see LossPolicy.readmit).
    readmitting: bool = False
    #: A replacement let into a degrade job that spans nodes: its join is held until every
    #: other node with live ranks of the job has taken it back in (set its admit entry to
    #: ADMIT_ROW and its bit; that node's report lists it in ``admits``). Not a join the
    #: job's coordinator sees waiting (``waiting`` is None).
    readmit_wait: bool = False  # (of another node's rank: as its node reports)
    #: Nodes that have taken the held replacement back in (see ``readmit_wait``).
    readmit_acks: set = field(default_factory=set)
    #: Of another node's rank: a replacement of a rank this node counted gone, reported
    #: while the job serves degraded here; taken back in here once reported attached (its
    #: node may have answered its join before any report said ``readmit``).
    replaced: bool = False
    #: Of another node's rank: the state its node's last report gave it (None: none yet).
    reported: int | None = None
    #: A remote rank let back in by its node without a job-wide re-arm: its ``deaths`` count
    #: at that re-admission, which this node has applied (this node's reports list it).
    admit_ack: int | None = None
    #: Of another node's rank: (pid, deaths, attaches) of the join this node counts attached
    #: because it was answered (a domain release, or its node's answer of a held
    #: re-admission) before its node reported it attached. That node's reports of it still
    #: joining with nothing held are from before its attach, which is no news here (its other
    #: holders do not hear it: federation.Federation._peer_key): it stays attached here.
    answered: tuple | None = None
    #: In a job that spans nodes: the node whose daemon holds this rank's row (None: this
    #: daemon's, or nobody's yet). Such a slot mirrors that node's reports.
    node: str | None = None
    #: A remote rank's held request: "join" or "recover" (None: none).
    remote_waiting: str | None = None
    #: A remote rank's row: {"size", "handle_type", "handle", "handle_error"}.
    remote: dict | None = None
    #: Counted dead because its node was lost (not because its node said so).
    lost_with_node: bool = False
    joined_at: float = 0.0
    attached_at: float = 0.0
    deaths: int = 0
    attaches: int = 0

    @property
    def live(self) -> bool:
        return self.state in (L.RANK_JOINING, L.RANK_ATTACHED)

    @property
    def waiting(self) -> str | None:
        """The request this rank waits in, wherever it is held: "join", "recover" or None."""
        if self.node is not None:
            return self.remote_waiting
        if self.pending is not None:
            return None if self.readmit_wait else "join"
        return "recover" if self.recovering is not None else None

    def clear_remote(self) -> None:
        self.node = self.remote_waiting = self.remote = self.admit_ack = self.reported = self.answered = None
        self.lost_with_node = self.readmit_wait = False

    def summary(self, show_pid: bool = True) -> dict:
        return {
            "rank": self.rank,
            "state": L.RANK_STATE_NAMES[self.state],
            "recovering": self.waiting == "recover",
            "pid": self.pid if show_pid else None,
            "device": self.device,
            "deaths": self.deaths,
            "attaches": self.attaches,
        }


@dataclass(frozen=True)
class JobFacts:
    """What the domain protocol (federation.py) may know of a job held here: its fixed
    fields and where it stands, as plain data (``Job.facts``)."""

    name: str
    #: a job of a domain (its coordinator decides its rendezvous and re-arms)
    domain: bool
    ep_size: int
    spec: dict
    owner_uid: int | None
    row_stride: int
    size_per_rank: int
    #: the domain's decision on its spec has reached this daemon
    confirmed: bool
    rendezvous_count: int


@dataclass
class Job:
    name: str
    ep_size: int
    spec: dict
    size_per_rank: int
    row_stride: int
    aux: L.AuxLayout
    control_fd: int
    control: ControlBlock
    slots: list[RankSlot]
    #: The uid that created the job: only it (or an admin) may join, inspect or end it.
    owner_uid: int | None = None
    #: when the job was created or adopted, on the clock of the events (Registry.now)
    created_at: float = 0.0
    generation: int = 0
    #: When set, the job is freed at this monotonic time unless a rank comes back.
    grace_deadline: float | None = None
    #: Row offset of the rows' lines tail (their last layout.ROW_TAIL_BYTES, zeroed with the aux
    #: region: where a small CUDA combine stages its rows as lines); 0: the rows have none.
    lines_tail: int = 0
    #: Whether a join of the job must say that its client combines through the lines tails
    #: (where the rows have one): set for the jobs this release's daemon creates; a job kept
    #: from a daemon before the word lets any client in, as that daemon did.
    lines_checked: bool = False
    rendezvous_started: float | None = None
    rendezvous_count: int = 0
    #: Set when the job's rounds can no longer agree (a rank died or left while the job
    #: was live, a rank asked for recovery, an operator aborted): the next release of the
    #: ranks re-arms every row first.
    needs_rearm: bool = False
    rearms: int = 0
    #: Replacements let into a degraded job while the others kept serving.
    readmits: int = 0
    freed: bool = False
    #: A job of a domain: its coordinator decides its rendezvous and re-arms (federation.py).
    domain: bool = False
    #: The domain's decision on the spec has reached this daemon (a job created here before
    #: it did is tentative: the coordinator may still refuse its spec).
    confirmed: bool = True
    #: The name of the node this daemon is in the job's domain (None without a domain). A
    #: slot's ``node`` names the node holding that rank's row; None there means this one.
    this_node: str | None = None
    #: When a rank of the job (here or elsewhere) was last seen to start joining.
    last_join_seen: float = 0.0
    #: Degrade jobs: the active-rank mask as this daemon decided it (None until the first
    #: rendezvous; see policy.active_mask). The control block's CB_ACTIVE_MASK is its
    #: published copy, in memory the job's clients can write, so the daemon derives nothing
    #: from that copy and puts its own value back when the copy differs.
    active_mask: int | None = None
    #: Times the published mask was found changed behind the daemon's back and put back.
    mask_restores: int = 0

    def __post_init__(self):
        # a job adopted from a daemon that knew no policy ran with the default one
        if "on_peer_loss" not in self.spec:
            self.spec = {**self.spec, "on_peer_loss": protocol.DEFAULT_PEER_LOSS}

    @property
    def row_bytes(self) -> int:
        """What each row asks its backend for: ``size_per_rank``, and the lines tail if any."""
        return L.row_bytes_with_tail(self.size_per_rank) if self.lines_tail else self.size_per_rank

    @property
    def tail_bytes(self) -> int:
        """Bytes at the top of each row's allocation zeroed with its aux region (the lines tail)."""
        return L.ROW_TAIL_BYTES if self.lines_tail else 0

    @property
    def degrade(self) -> bool:
        """Whether the job keeps serving without a lost rank (spec on_peer_loss="degrade")."""
        return self.spec.get("on_peer_loss") == "degrade"

    @property
    def serving_degraded(self) -> bool:
        """A degrade job past its first rendezvous and not waiting for a job-wide re-arm: a
        lost rank leaves the active mask, a replacement is let back in without stopping the
        others."""
        return self.degrade and self.rendezvous_count > 0 and not self.needs_rearm

    def mask_summary(self, now: float) -> dict:
        """The active mask as this daemon decided it, with the admit state the control block
        holds (degrade jobs; None otherwise)."""
        if not self.degrade or self.control is None or getattr(self.control, "_mv", None) is None:
            return {"active_mask": None, "active_ranks": None, "admitting_ranks": None,
                    "mask_generation": None, "degraded_s": None, "mask_restores": None}
        cb = self.control
        mask = active_mask(self, keep=False)
        admitted = admitted_ranks(self, mask)
        since = cb.degraded_since_ns
        return {
            "active_mask": mask,
            "active_ranks": L.mask_ranks(admitted),
            "admitting_ranks": L.mask_ranks(mask & ~admitted),
            "mask_generation": cb.mask_generation,
            "degraded_s": None if not since else round(max(0, int(now * 1e9) - since) / 1e9, 3),
            "mask_restores": self.mask_restores,
        }

    def mask_wire(self, now: float) -> dict:
        """:meth:`mask_summary` as a reply carries it: the mask as ``layout.mask_to_bytes``
        bytes (msgpack carries at most 64-bit ints), the ranks as lists."""
        m = self.mask_summary(now)
        if m["active_mask"] is not None:
            m["active_mask"] = L.mask_to_bytes(m["active_mask"])
        return m

    @property
    def job_bytes(self) -> int:
        """Bytes this daemon reserves for the job: every row, or in a domain the rows it holds
        (the others' rows are their daemons' memory)."""
        if self.domain:
            return sum(1 for s in self.slots if s.alloc is not None) * self.row_stride
        return self.ep_size * self.row_stride

    def facts(self) -> JobFacts:
        return JobFacts(name=self.name, domain=self.domain, ep_size=self.ep_size, spec=self.spec,
                        owner_uid=self.owner_uid, row_stride=self.row_stride, size_per_rank=self.size_per_rank,
                        confirmed=self.confirmed, rendezvous_count=self.rendezvous_count)

    def report(self, backend: str) -> dict:
        """This daemon's part of a domain job as plain data, the body of its report to the
        other nodes (federation.py): the job's fields, its abort word, the re-admissions of
        other nodes' ranks applied here (``admits``) and a record of every rank whose row
        this daemon holds or that is live here."""
        ranks = []
        for s in self.slots:
            if s.node is not None or (s.alloc is None and not s.live):
                continue
            a = s.alloc
            ranks.append({"rank": s.rank, "state": s.state, "waiting": s.waiting, "pid": s.pid, "device": s.device,
                          "deaths": s.deaths, "attaches": s.attaches, "size": a.size if a else None,
                          "handle_type": a.handle_type if a else None, "handle": a.fabric_handle if a else None,
                          "handle_error": (a.fabric_error or "")[:2000] or None if a else None,
                          "readmit": s.readmit_wait})
        cb = self.control
        # the re-admissions of other nodes' ranks applied here: the answer their nodes wait for
        admits = [[s.rank, s.admit_ack] for s in self.slots if s.node is not None and s.admit_ack is not None]
        return {"ep_size": self.ep_size, "spec": self.spec, "owner_uid": self.owner_uid, "backend": backend,
                "row_stride": self.row_stride, "size_per_rank": self.size_per_rank, "confirmed": self.confirmed,
                "generation": self.generation, "rendezvous_count": self.rendezvous_count,
                "needs_rearm": self.needs_rearm, "abort": cb.abort_word, "abort_rank": cb.abort_rank, "admits": admits,
                "ranks": ranks}

    def rank_holders(self, ranks, here: str | None) -> dict[int, str | None]:
        """For each of ``ranks`` that the job has: the node that holds its row or its live
        process (``here`` for this daemon), or None when nobody does yet."""
        out = {}
        for r in ranks:
            if not 0 <= r < self.ep_size:
                continue
            s = self.slots[r]
            out[r] = here if s.node is None and (s.alloc is not None or s.live) else s.node
        return out

    def set_rank_state(self, slot: RankSlot, state: int) -> None:
        """The one writer of a rank's state: the slot and the control block's copy together."""
        slot.state = state
        self.control.set_rank_state(slot.rank, state)

    def slot(self, rank: int) -> RankSlot:
        if not 0 <= rank < self.ep_size:
            raise errors.InvalidField(f"job {self.name!r} has ranks 0-{self.ep_size - 1}; got ep_rank {rank}", field="ep_rank")
        return self.slots[rank]

    @property
    def spans(self) -> bool:
        """Whether some rank's row is held by another node's daemon."""
        return any(s.node is not None for s in self.slots)

    def live_ranks(self) -> list[int]:
        return [s.rank for s in self.slots if s.live]

    def missing_ranks(self) -> list[int]:
        return [s.rank for s in self.slots if not s.live]

    def pending(self) -> list[RankSlot]:
        return [s for s in self.slots if s.pending is not None]

    def recovering(self) -> list[RankSlot]:
        return [s for s in self.slots if s.recovering is not None]

    def attached(self) -> list[RankSlot]:
        return [s for s in self.slots if s.state == L.RANK_ATTACHED]

    def state_name(self) -> str:
        if self.grace_deadline is not None:
            return "grace"
        if self.pending() or self.recovering() or any(s.remote_waiting for s in self.slots):
            return "rendezvous"
        if self.needs_rearm:
            return "needs-rearm"
        if all(s.state == L.RANK_ATTACHED for s in self.slots):
            return "ready"
        return "degraded"

    def summary(self, now: float, show_pids: bool = True) -> dict:
        return {
            "name": self.name,
            "state": self.state_name(),
            "owner_uid": self.owner_uid,
            "ep_size": self.ep_size,
            "spec": dict(self.spec),
            "size_per_rank": self.size_per_rank,
            "row_stride": self.row_stride,
            "bytes": self.job_bytes,
            "generation": self.generation,
            "rearms": self.rearms,
            "on_peer_loss": self.spec.get("on_peer_loss", protocol.DEFAULT_PEER_LOSS),
            **self.mask_wire(now),
            "readmits": self.readmits,
            "abort": L.ABORT_NAMES.get(self.control.abort_word, str(self.control.abort_word)),
            "age_s": round(now - self.created_at, 3),
            "grace_remaining_s": None if self.grace_deadline is None else round(max(0.0, self.grace_deadline - now), 3),
            "ranks": [dict(s.summary(show_pids), node=s.node or self.this_node) if self.this_node else s.summary(show_pids)
                      for s in self.slots],
            "ranks_attached": sum(1 for s in self.slots if s.state == L.RANK_ATTACHED),
            "ranks_dead": sum(1 for s in self.slots if s.state == L.RANK_DEAD),
        }

    def spec_mismatch(self, ep_size: int, spec: dict, rank: int | None = None, pid: int | None = None,
                      node: str | None = None) -> errors.SpecMismatch | None:
        """The SpecMismatch naming the first field where a join differs from the job, or None.
        ``rank``, ``pid``, ``node``: who asked (named in the error, which the ranks already
        waiting in the job's rendezvous hear too)."""
        who = ""
        if rank is not None:
            who = f"; the join was rank {rank}" + (f" (pid {pid})" if pid else "") + (f" on node {node}" if node else "")
        if ep_size != self.ep_size:
            return errors.SpecMismatch(
                f"job {self.name!r}: ep_size differs (job has {self.ep_size}, join asked for {ep_size}){who}",
                field="ep_size", job_value=self.ep_size, requested=ep_size, rank=rank, node=node,
            )
        for key in sorted(set(self.spec) | set(spec)):
            a, b = self.spec.get(key), spec.get(key)
            if a != b:
                return errors.SpecMismatch(
                    f"job {self.name!r}: spec field {key} differs (job has {a}, join asked for {b}){who}",
                    field=key, job_value=a, requested=b, rank=rank, node=node,
                )
        return None

