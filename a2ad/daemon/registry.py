"""The job registry: jobs, their rank slots, rendezvous, tickets, leases, re-arm, recover and
free. It owns no socket: callers hand it requests and events, and it answers with a reply or
an error, and queues what else it decided in two lists that the server carries out:

- ``outbox``: (ZeroMQ identity, encoded frame) for held replies it releases (rendezvous,
  recover) or ends with an error (timeouts, spec mismatch, destroy);
- ``closing``: lease connections (opaque objects of the fd socket) to close.

It watches the processes of joining ranks with pidfds (plain fds, no I/O), which the server
polls and hands back through :meth:`Registry.pid_exited`.

In a domain (federation.py) a job may span nodes: its slots for ranks whose rows another
node's daemon holds are *remote* (``RankSlot.node`` names that node) and mirror what that
node reports; only local slots have rows, fds, leases and held requests here. The
rendezvous and every re-arm of such a job are decided by its coordinator, not by
``_maybe_release``; losses of remote ranks go through the same policy as local ones.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from a2ad import errors, layout as L, protocol
from a2ad.control import ControlBlock, hold_job
from a2ad.daemon import memfd
from a2ad.daemon.auth import Auth, Peer
from a2ad.daemon.backends.base import Allocation, Backend
from a2ad.daemon.fdstore import FdStore, cb_name, ws_name

log = logging.getLogger("a2ad")

TICKET_TTL = 30.0


@dataclass
class Limits:
    grace: float = 30.0
    max_rendezvous_timeout: float = 600.0
    max_job_bytes: int = 1 << 40
    max_total_bytes: int = 1 << 42
    #: joins held in a rendezvous at once, per uid
    max_held_joins_per_uid: int = 256


@dataclass
class Held:
    """A reply the registry holds back (a join waiting for its rendezvous, a recover waiting
    for the re-arm)."""

    identity: bytes
    request_id: int
    deadline: float


# kept for readers of older code and tests
PendingJoin = Held


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
    leaving: bool = False
    #: A replacement let into a degraded job without a job-wide re-arm: its bit in the
    #: active mask is set once it holds its handles (see Registry._readmit).
    readmitting: bool = False
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
    def is_remote(self) -> bool:
        return self.node is not None

    @property
    def waiting(self) -> str | None:
        """The request this rank waits in, wherever it is held: "join", "recover" or None."""
        if self.node is not None:
            return self.remote_waiting
        return "join" if self.pending is not None else "recover" if self.recovering is not None else None

    def clear_remote(self) -> None:
        self.node = self.remote_waiting = self.remote = None
        self.lost_with_node = False

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
    created_at: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)
    generation: int = 0
    #: When set, the job is freed at this monotonic time unless a rank comes back.
    grace_deadline: float | None = None
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
    #: This daemon's node name in its domain (None without one).
    home: str | None = None
    #: The id of the coordinator's prepare this daemon carried out last (its release must match).
    fed_attempt: int | None = None
    #: When a rank of the job (here or elsewhere) was last seen to start joining.
    last_join_seen: float = 0.0
    #: Degrade jobs: the active-rank mask as this daemon decided it (None until the first
    #: rendezvous). The control block's CB_ACTIVE_MASK is its published copy, in memory the
    #: job's clients can write, so the daemon derives nothing from that copy and puts its own
    #: value back when the copy differs.
    mask: int | None = None
    #: Times the published mask was found changed behind the daemon's back and put back.
    mask_restores: int = 0

    def __post_init__(self):
        # a job adopted from a daemon that knew no policy ran with the default one
        if "on_peer_loss" not in self.spec:
            self.spec = {**self.spec, "on_peer_loss": protocol.DEFAULT_PEER_LOSS}

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

    @property
    def decided_mask(self) -> int:
        """The active mask as this daemon decided it; for a job adopted from a state file that
        did not record it, the control block's copy, bounded to the job's ranks."""
        if self.mask is not None:
            return self.mask
        return self.control.active_mask & L.full_mask(self.ep_size)

    def mask_summary(self) -> dict:
        """The active-rank mask as this daemon decided it, with the admit state the control
        block holds (degrade jobs; None otherwise)."""
        if not self.degrade or self.control is None or getattr(self.control, "_mv", None) is None:
            return {"active_mask": None, "active_ranks": None, "admitting_ranks": None,
                    "mask_generation": None, "degraded_s": None, "mask_restores": None}
        cb = self.control
        mask = self.decided_mask
        admitted = cb.admitted_mask(self.ep_size, mask)
        since = cb.degraded_since_ns
        return {
            "active_mask": mask,
            "active_ranks": L.mask_ranks(admitted),
            "admitting_ranks": L.mask_ranks(mask & ~admitted),
            "mask_generation": cb.mask_generation,
            "degraded_s": None if not since else round(max(0, time.monotonic_ns() - since) / 1e9, 3),
            "mask_restores": self.mask_restores,
        }

    @property
    def job_bytes(self) -> int:
        """Bytes this daemon reserves for the job: every row, or in a domain the rows it holds
        (the others' rows are their daemons' memory)."""
        if self.domain:
            return sum(1 for s in self.slots if s.alloc is not None) * self.row_stride
        return self.ep_size * self.row_stride

    def slot(self, rank: int) -> RankSlot:
        if not 0 <= rank < self.ep_size:
            raise errors.InvalidField(f"job {self.name!r} has ranks 0-{self.ep_size - 1}; got ep_rank {rank}", field="ep_rank")
        return self.slots[rank]

    @property
    def spans(self) -> bool:
        """Whether some rank's row is held by another node's daemon."""
        return any(s.node is not None for s in self.slots)

    def local_slots(self) -> list[RankSlot]:
        return [s for s in self.slots if s.node is None]

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
            **self.mask_summary(),
            "readmits": self.readmits,
            "abort": L.ABORT_NAMES.get(self.control.abort_word, str(self.control.abort_word)),
            "age_s": round(now - self.created_at, 3),
            "grace_remaining_s": None if self.grace_deadline is None else round(max(0.0, self.grace_deadline - now), 3),
            "ranks": [dict(s.summary(show_pids), node=s.node or self.home) if self.home else s.summary(show_pids)
                      for s in self.slots],
            "ranks_attached": sum(1 for s in self.slots if s.state == L.RANK_ATTACHED),
            "ranks_dead": sum(1 for s in self.slots if s.state == L.RANK_DEAD),
        }

    def spec_mismatch(self, ep_size: int, spec: dict) -> errors.SpecMismatch | None:
        """The SpecMismatch naming the first field where a join differs from the job, or None."""
        if ep_size != self.ep_size:
            return errors.SpecMismatch(
                f"job {self.name!r}: ep_size differs (job has {self.ep_size}, join asked for {ep_size})",
                field="ep_size", job_value=self.ep_size, requested=ep_size,
            )
        for key in sorted(set(self.spec) | set(spec)):
            a, b = self.spec.get(key), spec.get(key)
            if a != b:
                return errors.SpecMismatch(
                    f"job {self.name!r}: spec field {key} differs (job has {a}, join asked for {b})",
                    field=key, job_value=a, requested=b,
                )
        return None


def new_control_block(ep_size: int, policy: int = L.POLICY_RAISE) -> tuple[int, ControlBlock]:
    """A sealed memfd (clients cannot shrink it under the daemon's mapping) holding a fresh
    control block."""
    fd = memfd.sealed_memfd("a2ad-ctl", L.CONTROL_BLOCK_SIZE)
    try:
        hold_job(fd)  # the holder lock: ranks learn when no daemon or fd store holds the job
        cb = ControlBlock.map_fd(fd)
    except BaseException:
        os.close(fd)
        raise
    cb.initialize(ep_size, policy)
    return fd, cb


def new_secret() -> bytes:
    return secrets.token_bytes(32)


@dataclass
class Redeemed:
    """What the fd socket must send for a redeemed ticket (fds in handle order), and to whom
    the connection belongs once sent."""

    kind: str
    job: Job
    slot: RankSlot
    fds: list[int]


class Registry:
    def __init__(self, backend: Backend, store: FdStore, auth: Auth, limits: Limits):
        self.backend = backend
        self.store = store
        self.auth = auth
        self.limits = limits
        self.jobs: dict[str, Job] = {}
        self.tickets: dict[bytes, tuple[Job, int]] = {}
        #: pidfd -> (job, rank)
        self.pidfds: dict[int, tuple[Job, int]] = {}
        #: lease connection -> (job, rank) whose lease it is
        self.leases: dict[object, tuple[Job, int]] = {}
        self.draining = False
        self.counters = {"joins": 0, "attaches": 0, "detaches": 0, "deaths": 0, "rendezvous": 0,
                         "bad_requests": 0, "rearms": 0, "refused": 0, "readmits": 0,
                         "mask_restores": 0}
        self.rendezvous_latencies: list[float] = []
        self.on_rendezvous: Callable[[float], None] | None = None
        #: memory of freed jobs still mapped by processes: [{job, bytes, pids}]
        self.released: list[dict] = []
        self.outbox: list[tuple[bytes, bytes]] = []
        self.closing: list[object] = []
        self.dirty = False
        #: The domain's job federation (federation.py), when the daemon runs in a domain.
        self.fed = None
        #: called before a job is freed, to decide whether the fd-store entries go too
        self.fd_budget: Callable[[int], None] = lambda n: None

    # ------------------------------------------------------------------ lookups
    def job_for(self, peer: Peer, name: str) -> Job:
        """The job ``name`` as ``peer`` may see it: NoSuchJob for a job of another user (its
        existence is not revealed), unless the peer is an admin."""
        job = self.jobs.get(name)
        if job is None or not self.auth.may_use(peer, job.owner_uid):
            raise errors.NoSuchJob(f"no job named {name!r}")
        return job

    def visible_jobs(self, peer: Peer) -> list[Job]:
        return [j for j in self.jobs.values() if self.auth.may_use(peer, j.owner_uid)]

    def _slot_for_lease(self, name: str, rank: int, lease: bytes) -> tuple[Job, RankSlot]:
        job = self.jobs.get(name)
        if job is None:
            raise errors.NoSuchJob(f"no job named {name!r}")
        slot = job.slot(rank)
        if slot.lease is None or not secrets.compare_digest(lease, slot.lease):
            raise errors.PermissionDenied(f"job {job.name!r} rank {rank}: the lease does not match its holder")
        return job, slot

    def _reply(self, held: Held, payload: dict) -> None:
        self.outbox.append((held.identity, protocol.encode_reply(held.request_id, payload)))

    def _fail(self, held: Held, exc: errors.A2ADError) -> None:
        self.outbox.append((held.identity, protocol.encode_error(held.request_id, exc)))

    # --------------------------------------------------------------------- join
    def join(self, peer: Peer, identity: bytes, rid: int, f: dict) -> None:
        """Register a join. The reply is held until the rendezvous (see ``outbox``); errors
        raise at once."""
        if peer.uid is not None and not peer.pid:
            # the kernel gave the peer's pid as 0: it lives in a pid namespace the daemon cannot
            # see into, so its claimed pid would name some other process here
            raise errors.PermissionDenied(
                f"the joining process (pid {f['pid']} in its own namespace) is not visible in the daemon's pid "
                "namespace: run the daemon and its workers in one pid namespace (hostPID, or a shared namespace; "
                "docs/DEPLOYMENT.md)"
            )
        if peer.pid and peer.pid != f["pid"]:
            raise errors.PermissionDenied(f"join claims pid {f['pid']} but comes from pid {peer.pid}")
        self.backend.check_device(f["device"])
        spec = protocol.normalize_spec(f["spec"], f["ep_size"])
        name, rank = f["job"], f["ep_rank"]
        job = self.jobs.get(name)
        # a join that completes its rendezvous is released at once: it is never held; nor is a
        # replacement let back into a degraded job that kept serving
        completes = f["ep_size"] == 1 or (
            job is not None and job.ep_size == f["ep_size"]
            and (all(s.live for s in job.slots if s.rank != rank) or self._readmits(job, rank))
        )
        if peer.uid is not None and not completes:
            held = sum(1 for j in self.jobs.values() for s in j.slots if s.pending is not None and s.uid == peer.uid)
            if held >= self.limits.max_held_joins_per_uid:
                self.counters["refused"] += 1
                raise errors.LimitExceeded(
                    f"uid {peer.uid} already holds {held} joins waiting for their rendezvous "
                    f"(limit {self.limits.max_held_joins_per_uid})",
                    needed=held + 1, limit=self.limits.max_held_joins_per_uid,
                )
        # the joining process must exist before anything is created for it
        try:
            pidfd = os.pidfd_open(f["pid"])
        except ProcessLookupError:
            raise errors.InvalidField(f"pid {f['pid']} is not a running process", field="pid") from None
        except OSError:
            pidfd = None  # no pidfd support: a death during rendezvous is caught by the timeout
        try:
            if job is None:
                if self.draining:
                    raise errors.Draining("the daemon is draining: no new jobs are accepted")
                confirmed = True
                if self.fed is not None:
                    # what the domain already decided about this job (another node created it)
                    confirmed = self.fed.check_new_job(name, f["ep_size"], spec, peer)
                job = self._create_job(name, f["ep_size"], spec, peer.uid, f["device"])
                if self.fed is not None:
                    self.fed.job_created(job, confirmed)
            else:
                if not self.auth.may_use(peer, job.owner_uid):
                    raise errors.PermissionDenied(f"job {name!r} belongs to another user; choose another job name")
                mismatch = job.spec_mismatch(f["ep_size"], spec)
                if mismatch is not None:
                    self._refuse_waiting(job, mismatch)
                    if self.fed is not None and job.domain and job.confirmed:
                        self.fed.spread_refusal(job, mismatch)  # the ranks waiting on other nodes hear it too
                    raise mismatch
            slot = job.slot(rank)
            if slot.node is not None:
                if slot.live:
                    raise errors.RankTaken(
                        f"job {name!r} rank {rank} is held by live pid {slot.pid} on node {slot.node} "
                        f"({L.RANK_STATE_NAMES[slot.state]})", holder_pid=slot.pid, node=slot.node)
                raise errors.RankTaken(
                    f"job {name!r} rank {rank} has its workspace on node {slot.node}: a replacement joins through "
                    "that node's daemon", node=slot.node)
            if slot.live:
                raise errors.RankTaken(
                    f"job {name!r} rank {rank} is held by live pid {slot.pid} ({L.RANK_STATE_NAMES[slot.state]})",
                    holder_pid=slot.pid,
                )
            if slot.alloc is not None and slot.device != f["device"]:
                raise errors.InvalidField(
                    f"job {name!r} rank {rank}'s workspace lives on {slot.device}; a replacement must declare the same device",
                    field="device",
                )
            if slot.alloc is None:
                self._allocate(job, slot, f["device"])
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            if job is not None and not job.freed and not job.live_ranks() and job.grace_deadline is None:
                self._start_grace(job)
            raise
        replacing = slot.state == L.RANK_DEAD or slot.attaches > 0
        self.drop_pidfd(slot)
        slot.state = L.RANK_JOINING
        slot.pid, slot.uid, slot.device = f["pid"], peer.uid, f["device"]
        slot.leaving = False
        slot.joined_at = time.monotonic()
        slot.lease = new_secret()
        if pidfd is not None:
            slot.pidfd = pidfd
            self.pidfds[pidfd] = (job, rank)
        timeout = min(f.get("timeout", 60.0), self.limits.max_rendezvous_timeout)
        slot.pending = Held(identity=identity, request_id=rid, deadline=time.monotonic() + timeout)
        job.control.set_rank_state(rank, L.RANK_JOINING)
        job.grace_deadline = None
        job.last_join_seen = slot.joined_at
        if job.rendezvous_started is None:
            job.rendezvous_started = time.monotonic()
        self.counters["joins"] += 1
        self.dirty = True
        log.info(
            "job %s: rank %d %s (pid %d, device %s); %d/%d ranks present",
            name, rank, "rejoined" if replacing else "joined", f["pid"], f["device"], len(job.live_ranks()), job.ep_size,
        )
        if self._readmits(job, rank):
            self._readmit(job, slot)
        else:
            if job.domain and job.spans and job.serving_degraded and replacing:
                # the others serve on other nodes, whose control blocks this daemon cannot
                # write: a replacement comes back through a job-wide re-arm (docs/DOMAIN.md)
                job.needs_rearm = True
                if not job.control.abort_word:
                    job.control.set_abort(L.ABORT_REARM, rank)
                log.info("job %s: rank %d's replacement comes back through a job-wide re-arm (the job spans nodes)",
                         name, rank)
            self._maybe_release(job)

    # ----------------------------------------------------------- degraded mode
    def _readmits(self, job: Job, rank: int) -> bool:
        """Whether a join of ``rank`` is let into ``job`` while the others keep serving (a
        degrade job whose admitted ranks run on), instead of waiting for a job-wide re-arm."""
        if not job.serving_degraded or job.control.abort_word or job.recovering() or job.spans:
            return False
        admitted = job.control.admitted_mask(job.ep_size, self.job_mask(job))
        return any(s.rank != rank and s.state == L.RANK_ATTACHED and admitted >> s.rank & 1 for s in job.slots)

    def _readmit(self, job: Job, slot: RankSlot) -> None:
        """Release a replacement's join at once, without the others (the degrade path of a
        re-arm): only its own row is re-initialized, and its admit round says it has not
        dispatched yet. Its bit is set when it holds its handles (``delivered``); its first
        dispatch asks to be let in and the lowest active rank picks the round
        (docs/PROTOCOL.md, "Degraded mode")."""
        cb = job.control
        t0 = time.monotonic()
        try:
            self.backend.initialize(slot.alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=False)
        except BaseException:
            slot.pending = None  # the error is this join's reply
            self._reset_joining(job, slot)
            raise
        cb.set_admit_round(slot.rank, L.ADMIT_JOINED)
        cb.clear_status(slot.rank)
        cb.clear_input_error(slot.rank)
        slot.readmitting = True
        self._release_join(job, slot, time.monotonic())
        self.dirty = True
        log.info("job %s: rank %d let back in without stopping the others (row re-initialized in %.1f ms); "
                 "its first dispatch joins the rounds", job.name, slot.rank, (time.monotonic() - t0) * 1e3)

    @staticmethod
    def job_mask(job: Job) -> int:
        """:attr:`Job.decided_mask`, kept: a job adopted without a recorded mask takes the
        control block's copy once."""
        if job.mask is None:
            job.mask = job.decided_mask
        return job.mask

    def _set_mask(self, job: Job, mask: int) -> bool:
        """Decide the job's active mask, keep it and publish it; whether it changed."""
        mask &= L.full_mask(job.ep_size)
        changed = mask != job.mask
        job.mask = mask
        job.control.set_active_mask(mask, job.ep_size, time.monotonic_ns())
        if changed:
            self.dirty = True
        return changed

    def restore_published_mask(self, job: Job) -> None:
        """Put the daemon's mask back when the control block's copy was changed by someone
        else (only the daemon writes it)."""
        if job.mask is None or job.freed or job.control is None or getattr(job.control, "_mv", None) is None:
            return
        seen = job.control.active_mask
        if seen == job.mask:
            return
        job.control.set_active_mask(job.mask, job.ep_size, time.monotonic_ns())
        job.mask_restores += 1
        self.counters["mask_restores"] += 1
        if job.mask_restores == 1 or job.mask_restores % 100 == 0:
            log.warning("job %s: its control block's active mask was changed to %#x by something other than this "
                        "daemon (a client writing the control block); put back %#x (%d time(s) so far)",
                        job.name, seen, job.mask, job.mask_restores)

    def _drop_rank(self, job: Job, slot: RankSlot, why: str) -> None:
        """A rank of a degrade job that serves died or left: clear its bit (the others stop
        waiting for it and drop its tokens); no abort. When no admitted rank is left, nobody
        can let a replacement in: the job then needs a job-wide re-arm, and ranks still
        holding it (replacements waiting to be let in) are told through the abort word."""
        cb = job.control
        slot.readmitting = False
        if self._set_mask(job, self.job_mask(job) & ~(1 << slot.rank)):
            log.warning("job %s: rank %d (pid %s) %s; the job serves on with ranks %s (mask generation %d)",
                        job.name, slot.rank, slot.pid, why, L.mask_ranks(cb.admitted_mask(job.ep_size, job.mask)),
                        cb.mask_generation)
        else:
            log.warning("job %s: rank %d (pid %s) %s", job.name, slot.rank, slot.pid, why)
        if not cb.admitted_mask(job.ep_size, job.mask):
            job.needs_rearm = True
            if any(s.live for s in job.slots if s is not slot) and not cb.abort_word:
                cb.set_abort(L.ABORT_PEER_LOST, slot.rank)
            log.warning("job %s: no active rank is left; the next rendezvous re-arms every rank", job.name)

    # ------------------------------------------------------------------- domain
    def apply_remote(self, job: Job, node: str, ranks: dict[int, dict] | None, fields: dict | None = None,
                     why_gone: str = "") -> None:
        """Mirror what ``node`` reports about ``job`` (federation.py): ``ranks`` maps every
        rank whose row that node holds to its record (state, held request, pid, device,
        row); None or a missing rank: the node holds it no more. ``fields``: the node's
        job-wide fields (generation, abort word, needs_rearm), of which an abort word or a
        re-arm need of the same generation is taken over. State changes go through the
        job's policy as local ones do (``_lose``), unless the report is of an older
        generation than this daemon's copy (it reached here after the re-arm that dealt with
        what it says: the mirror follows it, nothing more)."""
        ranks = ranks or {}
        effects = fields is None or fields.get("generation", 0) >= job.generation
        for slot in job.slots:
            if slot.node == node and slot.rank not in ranks:
                if slot.live:
                    slot.remote_waiting = None
                    self._remote_state(job, slot, L.RANK_DEAD, why_gone or f"node {node} no longer holds it")
                slot.clear_remote()
                self.dirty = True
        for r, rec in ranks.items():
            if not 0 <= r < job.ep_size:
                continue
            slot = job.slots[r]
            if slot.node is None and (slot.alloc is not None or slot.live):
                continue  # this daemon's own rank: a conflict that the job's coordinator settles
            before = (slot.node, slot.pid, slot.device, slot.deaths, slot.attaches, slot.remote_waiting, slot.remote)
            slot.node = node
            slot.pid, slot.device, slot.uid = rec.get("pid"), rec.get("device"), None
            slot.deaths, slot.attaches = rec.get("deaths", 0), rec.get("attaches", 0)
            slot.remote_waiting = rec.get("waiting")
            slot.remote = {k: rec.get(k) for k in ("size", "handle_type", "handle", "handle_error")}
            if before != (slot.node, slot.pid, slot.device, slot.deaths, slot.attaches, slot.remote_waiting, slot.remote):
                self.dirty = True
            state = rec["state"]
            if slot.lost_with_node:
                slot.lost_with_node = False
                if effects and state == L.RANK_ATTACHED and slot.state == L.RANK_DEAD:
                    # counted lost with its node, yet alive: the job's rounds cannot agree any
                    # more (the others dropped or aborted it): everyone goes through a re-arm
                    job.needs_rearm = self.dirty = True
                    if not job.control.abort_word:
                        job.control.set_abort(L.ABORT_REARM, r)
                    log.warning("job %s: rank %d on node %s, counted lost with its node, is alive: the job re-arms",
                                job.name, r, node)
            if state != slot.state:
                self._remote_state(job, slot, state, f"(as node {node} reports)", effects)
        if fields is not None and fields.get("generation") == job.generation:
            word = fields.get("abort", 0)
            if word and word != L.ABORT_DESTROYED and not job.control.abort_word:
                job.control.set_abort(word, fields.get("abort_rank", -1))
                job.needs_rearm = True
                self.dirty = True
                log.warning("job %s: %s on node %s (rank %s): this node's ranks are told too", job.name,
                            L.ABORT_NAMES.get(word, f"abort {word}"), node, fields.get("abort_rank"))
            if fields.get("needs_rearm") and not job.needs_rearm and job.rendezvous_count > 0:
                job.needs_rearm = True
                self.dirty = True
        if job.live_ranks():
            if job.grace_deadline is not None:
                job.grace_deadline = None
                self.dirty = True
        elif job.grace_deadline is None:
            self._start_grace(job)

    def _remote_state(self, job: Job, slot: RankSlot, state: int, why: str, effects: bool = True) -> None:
        old = slot.state
        slot.state = state
        job.control.set_rank_state(slot.rank, state)
        self.dirty = True
        if state == L.RANK_JOINING:
            job.last_join_seen = time.monotonic()
            job.grace_deadline = None
        elif effects and state in (L.RANK_DEAD, L.RANK_LEFT) and old in (L.RANK_JOINING, L.RANK_ATTACHED):
            self._lose(job, slot, state, old == L.RANK_ATTACHED,
                       ("died " if state == L.RANK_DEAD else "left ") + why)

    def remote_node_lost(self, job: Job, node: str, why: str) -> None:
        """``node`` is lost (its daemon went silent): its live ranks of ``job`` count as dead."""
        for slot in job.slots:
            if slot.node == node and slot.live:
                slot.remote_waiting = None
                slot.lost_with_node = True
                self._remote_state(job, slot, L.RANK_DEAD, f"with its node {node} ({why})")
        if not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def domain_quiesced(self, job: Job) -> str | None:
        """Why a re-arm of ``job`` must not touch this daemon's rows now (a local rank that
        is live but not held in a join or recover could be inside a round), or None."""
        busy = [s.rank for s in job.slots if s.node is None and s.live and s.pending is None and s.recovering is None]
        return f"rank(s) {busy} are not quiesced" if busy else None

    def domain_prepare(self, job: Job, generation: int, rearm: bool) -> None:
        """The first step of a domain rendezvous: re-arm this daemon's rows (``rearm``) or take
        the generation the coordinator picked; no rank is released yet."""
        if rearm:
            self._rearm(job, generation)
        elif job.generation != generation:
            job.generation = generation
            job.control.generation = generation
        job.confirmed = True
        self.dirty = True

    def domain_release(self, job: Job, generation: int, rendezvous_count: int, table: list[dict]) -> None:
        """The second step: every node has prepared; release this daemon's held joins (with
        every row's handle) and recovers together."""
        for rec in table:
            r, node = rec.get("rank"), rec.get("node")
            if not (isinstance(r, int) and 0 <= r < job.ep_size) or node == job.home:
                continue
            slot = job.slots[r]
            if slot.node is None and slot.alloc is None and not slot.live:
                slot.node = node  # the release came before that node's report of the rank
                slot.state = L.RANK_JOINING
                job.control.set_rank_state(r, L.RANK_JOINING)
            if slot.node == node:
                slot.remote = dict(slot.remote or {}, size=rec.get("size"), handle=rec.get("handle"),
                                   handle_type=rec.get("handle_type"))
                slot.device = rec.get("device")
        now = time.monotonic()
        for slot in job.recovering():
            self._reply(slot.recovering, {"generation": job.generation})
            slot.recovering = None
        self.dirty = True
        pending = job.pending()
        if not pending:
            log.info("job %s: all %d ranks resumed at generation %d", job.name, job.ep_size, job.generation)
            return
        latency = now - (job.last_join_seen or now)
        for slot in pending:
            try:
                self._release_join(job, slot, now)
            except errors.A2ADError as exc:
                self._fail(slot.pending, exc)
                slot.pending = None
                self._reset_joining(job, slot)
        job.rendezvous_started = None
        job.rendezvous_count = max(job.rendezvous_count + 1, rendezvous_count)
        self.counters["rendezvous"] += 1
        self.rendezvous_latencies.append(latency)
        del self.rendezvous_latencies[:-1000]
        if self.on_rendezvous is not None:
            self.on_rendezvous(latency)
        log.info("job %s: domain rendezvous done (%d ranks, %d here, generation %d, %.3f ms after the last join "
                 "this daemon saw)", job.name, job.ep_size, len(pending), generation, latency * 1e3)

    def domain_refuse(self, job: Job, exc: errors.A2ADError, drop: bool) -> None:
        """The domain refused the job (a spec mismatch, rows without fabric handles): every join
        of it held here hears ``exc``; with ``drop`` (this daemon's tentative job lost to
        another spec) the job goes once no local rank holds it."""
        for slot in job.pending():
            self._fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
            log.warning("job %s: rank %d's join refused by the domain: %s", job.name, slot.rank, exc.message)
        if drop and not any(s.live for s in job.slots if s.node is None):
            self.free(job, "its spec lost to the domain's")
        elif not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def domain_refuse_rank(self, job: Job, rank: int, exc: errors.A2ADError) -> None:
        """Another node holds ``rank``: this daemon's join of it is refused and its row freed."""
        slot = job.slots[rank]
        if slot.node is not None:
            return
        if slot.pending is not None:
            self._fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
        if not slot.live and slot.alloc is not None:
            self.store.drop(ws_name(job.name, rank))
            self.backend.release(slot.alloc)
            slot.alloc = None
            slot.state = L.RANK_EMPTY
            job.control.set_rank_state(rank, L.RANK_EMPTY)
        self.dirty = True
        if not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def rank_lost_while_away(self, job: Job, slot: RankSlot) -> None:
        """A rank found dead when its job is adopted (it died while no daemon ran): marked as
        a death of that job's policy would be (the raise policy aborts the job, the degrade
        policy clears the rank's bit)."""
        slot.deaths += 1
        slot.state = L.RANK_DEAD
        job.control.set_rank_state(slot.rank, L.RANK_DEAD)
        if job.serving_degraded:
            self._drop_rank(job, slot, "died while no daemon ran")
        else:
            job.needs_rearm = True
            job.control.set_abort(L.ABORT_PEER_LOST, slot.rank)

    def _refuse_waiting(self, job: Job, exc: errors.SpecMismatch) -> None:
        """A join that does not match the job's spec: the ranks already waiting in its
        rendezvous learn it at once too (their group is misconfigured), instead of waiting for
        their timeout. Running ranks are left alone."""
        for slot in job.pending():
            self._fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
            log.warning("job %s: rank %d's join ended by a mismatching join: %s", job.name, slot.rank, exc.message)
        if not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def _reset_joining(self, job: Job, slot: RankSlot) -> None:
        self.drop_pidfd(slot)
        self._drop_ticket(slot)
        slot.state = L.RANK_EMPTY
        slot.lease = None
        job.control.set_rank_state(slot.rank, L.RANK_EMPTY)
        self.dirty = True

    def _create_job(self, name: str, ep_size: int, spec: dict, owner_uid: int | None, device: str) -> Job:
        size = spec["workspace_size_per_rank"]
        aux = L.aux_layout(ep_size, spec["max_num_tokens"])
        if size < L.pad_up(aux.aux_data_size) + 1:
            raise errors.InvalidField(
                f"workspace_size_per_rank {size} is smaller than the aux region alone ({L.pad_up(aux.aux_data_size)} bytes "
                f"for ep_size {ep_size}, max_num_tokens {spec['max_num_tokens']})",
                field="spec.workspace_size_per_rank",
            )
        stride = self.backend.row_stride(size, device)
        # in a domain the job's rows are spread over the nodes: each row is counted when allocated
        job_bytes = stride if self.fed is not None else ep_size * stride
        if job_bytes > self.limits.max_job_bytes:
            raise errors.LimitExceeded(
                f"job {name!r} needs {job_bytes} bytes, over the per-job limit of {self.limits.max_job_bytes}",
                needed=job_bytes, limit=self.limits.max_job_bytes,
            )
        total = sum(j.job_bytes for j in self.jobs.values())
        if total + job_bytes > self.limits.max_total_bytes:
            raise errors.LimitExceeded(
                f"job {name!r} needs {job_bytes} bytes; the daemon holds {total} of its {self.limits.max_total_bytes} limit",
                needed=job_bytes, limit=self.limits.max_total_bytes,
            )
        self.fd_budget(ep_size + 2)
        cfd, cb = new_control_block(ep_size, L.POLICY_CODES[spec.get("on_peer_loss", protocol.DEFAULT_PEER_LOSS)])
        job = Job(
            name=name, ep_size=ep_size, spec=spec, size_per_rank=size, row_stride=stride, aux=aux,
            control_fd=cfd, control=cb, slots=[RankSlot(rank=r) for r in range(ep_size)], owner_uid=owner_uid,
        )
        self.jobs[name] = job
        self.store.put(cb_name(name), cfd)
        self.dirty = True
        log.info("job %s created by uid %s: ep_size %d, %d bytes per rank, spec %s", name, owner_uid, ep_size, size, spec)
        return job

    def _allocate(self, job: Job, slot: RankSlot, device: str) -> None:
        stride = self.backend.row_stride(job.size_per_rank, device)
        if stride != job.row_stride:
            raise errors.BackendError(
                f"device {device} needs a row stride of {stride} bytes; job {job.name!r} uses {job.row_stride}"
            )
        if job.domain:
            held, total = job.job_bytes + stride, sum(j.job_bytes for j in self.jobs.values()) + stride
            if held > self.limits.max_job_bytes:
                raise errors.LimitExceeded(
                    f"job {job.name!r} would hold {held} bytes on this node, over the per-job limit of "
                    f"{self.limits.max_job_bytes}", needed=held, limit=self.limits.max_job_bytes)
            if total > self.limits.max_total_bytes:
                raise errors.LimitExceeded(
                    f"job {job.name!r} needs {stride} more bytes; the daemon holds {total - stride} of its "
                    f"{self.limits.max_total_bytes} limit", needed=stride, limit=self.limits.max_total_bytes)
        self.fd_budget(2)
        alloc = self.backend.allocate(job.size_per_rank, device)
        try:
            self.backend.initialize(alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=True)
        except BaseException:
            self.backend.release(alloc)
            raise
        slot.alloc = alloc
        slot.device = device
        self.store.put(ws_name(job.name, slot.rank), alloc.fd)
        self.dirty = True

    def _maybe_release(self, job: Job) -> None:
        """Release every held join and recover once all ranks are present (and, when the
        job needs a re-arm, every attached rank is quiesced in `recover`)."""
        if job.domain:
            return  # its coordinator decides (federation.py); this daemon's reports go out after the request
        if job.missing_ranks() or not (job.pending() or job.recovering()):
            return
        if job.needs_rearm or job.control.abort_word:
            if any(s.state == L.RANK_ATTACHED and s.recovering is None for s in job.slots):
                return  # a survivor has not quiesced yet
            self._rearm(job)
        now = time.monotonic()
        latency = now - max(s.joined_at for s in job.pending()) if job.pending() else 0.0
        for slot in job.recovering():
            self._reply(slot.recovering, {"generation": job.generation})
            slot.recovering = None
        if not job.pending():
            log.info("job %s: all %d ranks resumed at generation %d", job.name, job.ep_size, job.generation)
            self.dirty = True
            return
        for slot in job.pending():
            self._release_join(job, slot, now)
        job.rendezvous_started = None
        job.rendezvous_count += 1
        self.dirty = True
        self.counters["rendezvous"] += 1
        self.rendezvous_latencies.append(latency)
        del self.rendezvous_latencies[:-1000]
        if self.on_rendezvous is not None:
            self.on_rendezvous(latency)
        log.info("job %s: rendezvous done (%d ranks, %.3f ms after the last join)", job.name, job.ep_size, latency * 1e3)

    def _release_join(self, job: Job, slot: RankSlot, now: float) -> None:
        """Answer ``slot``'s held join: the layout, the handles it will receive, its ticket and lease."""
        handles = [self._handle_entry(job, s) for s in job.slots]
        handles.append({"kind": "control", "size": L.CONTROL_BLOCK_SIZE})
        self._issue_ticket(job, slot, "join", now)
        self._reply(slot.pending, {
            "job": job.name,
            "ep_rank": slot.rank,
            "ep_size": job.ep_size,
            "spec": job.spec,
            "size_per_rank": job.size_per_rank,
            "row_stride": job.row_stride,
            "backend": self.backend.name,
            "handle_type": slot.alloc.handle_type,
            "generation": job.generation,
            "metainfo": job.aux.metainfo(),
            "handles": handles,
            "ticket": slot.ticket,
            "lease": slot.lease,
        })
        slot.pending = None

    @staticmethod
    def _handle_entry(job: Job, s: RankSlot) -> dict:
        """One workspace entry of a join reply: a local row comes as the next fd, a remote one
        as its fabric handle (docs/PROTOCOL.md; protocol.py, "Handles in a join reply")."""
        if s.node is None:
            if s.alloc is None:
                raise errors.BackendError(f"job {job.name!r}: rank {s.rank}'s workspace is not known here")
            entry = {"kind": "workspace", "rank": s.rank, "size": s.alloc.size, "device": s.device}
            if job.home is not None:
                entry.update(node=job.home, fd=True, handle_type=s.alloc.handle_type)
            return entry
        remote = s.remote or {}
        if not remote.get("handle"):
            raise errors.BackendError(
                f"job {job.name!r}: rank {s.rank}'s workspace on node {s.node} has no fabric handle"
                + (f": {remote['handle_error']}" if remote.get("handle_error") else ""))
        return {"kind": "workspace", "rank": s.rank, "size": remote["size"], "device": s.device, "node": s.node,
                "fd": False, "fabric": remote["handle"], "handle_type": remote.get("handle_type")}

    def _issue_ticket(self, job: Job, slot: RankSlot, kind: str, now: float) -> bytes:
        self._drop_ticket(slot)
        ticket = new_secret()
        self.tickets[ticket] = (job, slot.rank)
        slot.ticket, slot.ticket_kind, slot.ticket_expiry = ticket, kind, now + TICKET_TTL
        return ticket

    def _drop_ticket(self, slot: RankSlot) -> None:
        if slot.ticket is not None:
            self.tickets.pop(slot.ticket, None)
            slot.ticket = slot.ticket_kind = None

    def _rearm(self, job: Job, generation: int | None = None) -> None:
        """Reset every rank's flags and counters to one agreed state and bump the generation
        (to ``generation``: the one a domain's coordinator picked). Only called while no rank
        can be inside dispatch or combine (all quiesced or joining). In a job that spans nodes
        each daemon re-arms the rows it holds, all before any rank is released."""
        t0 = time.monotonic()
        with self.backend.batch():
            for slot in job.slots:
                if slot.alloc is None:
                    continue  # another node's row: its daemon re-arms it
                self.backend.initialize(slot.alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=False)
        for r in range(job.ep_size):
            job.control.clear_status(r)
            job.control.set_admit_round(r, 0)
        for slot in job.slots:
            slot.readmitting = False
        self._set_mask(job, L.full_mask(job.ep_size))  # every rank takes part from the first round on
        job.generation = job.generation + 1 if generation is None else generation
        job.control.generation = job.generation
        job.control.clear_abort()
        job.needs_rearm = False
        job.rearms += 1
        self.counters["rearms"] += 1
        self.dirty = True
        log.info("job %s: re-armed at generation %d in %.1f ms", job.name, job.generation, (time.monotonic() - t0) * 1e3)

    # ----------------------------------------------------------- lease requests
    def leave(self, peer: Peer, f: dict) -> dict:
        job, slot = self._slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        if not slot.live:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank} is {L.RANK_STATE_NAMES[slot.state]}, not held")
        slot.leaving = True
        if slot.lease_conn is not None:
            # the leave is complete when its reply goes out: the rank is free for a successor
            # at once, whether or not the client's socket close has arrived yet
            self.lease_closed(slot.lease_conn)
        else:  # left before redeeming its ticket, or adopted after a restart without a lease
            self._drop_ticket(slot)
            if slot.pending is not None:
                slot.pending = None
            self.drop_pidfd(slot)
            self._mark(job, slot, L.RANK_LEFT, "left")
        return {}

    def recover(self, peer: Peer, identity: bytes, rid: int, f: dict) -> None:
        """Hold this (attached, quiesced) rank until the job is re-armed with all ranks present."""
        job, slot = self._slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        if slot.state != L.RANK_ATTACHED:
            raise errors.PermissionDenied(
                f"job {job.name!r} rank {slot.rank} is {L.RANK_STATE_NAMES[slot.state]}, not attached: join again instead"
            )
        if not job.needs_rearm:
            job.needs_rearm = True
            if not job.control.abort_word:
                # tell the other ranks, inside or outside a wait, that they must recover too
                job.control.set_abort(L.ABORT_REARM, slot.rank)
            log.info("job %s: rank %d asks for a re-arm", job.name, slot.rank)
        timeout = min(f.get("timeout", 60.0), self.limits.max_rendezvous_timeout)
        if slot.recovering is not None:  # a client that gave up and asks again: the new request wins
            self._fail(slot.recovering, errors.StateError("superseded by a newer recover request"))
        slot.recovering = Held(identity=identity, request_id=rid, deadline=time.monotonic() + timeout)
        self.dirty = True
        self._maybe_release(job)

    def renew(self, peer: Peer, f: dict) -> dict:
        """A ticket for a new lease connection (after a daemon restart dropped the old one)."""
        job, slot = self._slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        if peer.pid and peer.pid != f["pid"]:
            raise errors.PermissionDenied(f"renew claims pid {f['pid']} but comes from pid {peer.pid}")
        if slot.state != L.RANK_ATTACHED or slot.pid != f["pid"]:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank} is not attached to pid {f['pid']}")
        ticket = self._issue_ticket(job, slot, "renew", time.monotonic())
        return {"ticket": ticket, "generation": job.generation}

    # ------------------------------------------------------------ the fd socket
    def redeem(self, ticket, peer: Peer) -> Redeemed:
        """Check a ticket presented on fd.sock by ``peer``; the ticket is used up only when it
        is valid for this peer (a foreign pid leaves it to its rightful owner)."""
        if not isinstance(ticket, bytes) or ticket not in self.tickets:
            raise errors.BadTicket("unknown, expired or already used ticket")
        job, rank = self.tickets[ticket]
        slot = job.slots[rank]
        want = L.RANK_JOINING if slot.ticket_kind == "join" else L.RANK_ATTACHED
        if job.freed or slot.ticket != ticket or slot.state != want:
            self.tickets.pop(ticket, None)
            raise errors.BadTicket("the ticket's rank is no longer waiting for it")
        if peer.pid != slot.pid:
            raise errors.PermissionDenied(f"ticket belongs to pid {slot.pid}, not to pid {peer.pid}")
        self.auth.check_connect(peer)
        kind = slot.ticket_kind
        self._drop_ticket(slot)
        fds = [] if kind == "renew" else [s.alloc.fd for s in job.slots if s.node is None] + [job.control_fd]
        return Redeemed(kind=kind, job=job, slot=slot, fds=fds)

    def delivered(self, r: Redeemed, conn: object) -> None:
        """The redeem's answer went out: ``conn`` is now the rank's lease."""
        slot, job = r.slot, r.job
        if slot.lease_conn is not None and slot.lease_conn is not conn:
            self.leases.pop(slot.lease_conn, None)
            self.closing.append(slot.lease_conn)  # a renewed lease replaces the old connection
        slot.lease_conn = conn
        self.leases[conn] = (job, slot.rank)
        self.drop_pidfd(slot)
        if r.kind == "renew":
            log.info("job %s: rank %d renewed its lease (pid %d)", job.name, slot.rank, slot.pid)
            return
        slot.state = L.RANK_ATTACHED
        slot.attached_at = time.monotonic()
        slot.attaches += 1
        job.control.set_rank_state(slot.rank, L.RANK_ATTACHED)
        self.dirty = True
        self.counters["attaches"] += 1
        log.info("job %s: rank %d attached (pid %d)", job.name, slot.rank, slot.pid)
        if slot.readmitting:
            slot.readmitting = False
            if job.serving_degraded and not job.control.abort_word:
                # it holds its handles: its bit goes back (its admit round still keeps it out
                # of every round until its first dispatch is let in)
                self._set_mask(job, self.job_mask(job) | 1 << slot.rank)
                job.readmits += 1
                self.counters["readmits"] += 1
                log.info("job %s: rank %d is active again (mask generation %d)", job.name, slot.rank,
                         job.control.mask_generation)

    def undelivered(self, r: Redeemed, why: str) -> None:
        """The redeem's answer could not be sent (the client closed or stalled): a joining rank
        never got its handles, so it is dead to the job; a renewing rank keeps its pidfd lease."""
        if r.job.freed or r.kind == "renew":
            return
        log.warning("job %s: rank %d's handles could not be delivered (%s)", r.job.name, r.slot.rank, why)
        self._mark(r.job, r.slot, L.RANK_DEAD, "never received its handles")

    def lease_closed(self, conn: object) -> None:
        """A lease connection ended (EOF, error, or a leave)."""
        self.closing.append(conn)
        entry = self.leases.pop(conn, None)
        if entry is None:
            return
        job, rank = entry
        slot = job.slots[rank]
        if job.freed or slot.lease_conn is not conn:
            return
        slot.lease_conn = None
        if slot.leaving:
            self._mark(job, slot, L.RANK_LEFT, "left")
        else:
            self._mark(job, slot, L.RANK_DEAD, "died (lease connection closed without leave)")

    # ----------------------------------------------------------------- pidfds
    def watch_pid(self, job: Job, slot: RankSlot) -> bool:
        """Watch a rank's process with a pidfd; False when it is already gone."""
        self.drop_pidfd(slot)
        try:
            slot.pidfd = os.pidfd_open(slot.pid)
        except (ProcessLookupError, OSError, TypeError):
            return False
        self.pidfds[slot.pidfd] = (job, slot.rank)
        return True

    def drop_pidfd(self, slot: RankSlot) -> None:
        if slot.pidfd is not None:
            self.pidfds.pop(slot.pidfd, None)
            os.close(slot.pidfd)
            slot.pidfd = None

    def pid_exited(self, pidfd: int) -> None:
        entry = self.pidfds.get(pidfd)
        if entry is None:
            return
        job, rank = entry
        slot = job.slots[rank]
        self.drop_pidfd(slot)
        if job.freed:
            return
        if slot.state == L.RANK_JOINING:
            slot.pending = None
            self._drop_ticket(slot)
            self._mark(job, slot, L.RANK_DEAD, "died before attaching")
        elif slot.state == L.RANK_ATTACHED and slot.lease_conn is None:
            # adopted after a daemon restart, lease not renewed yet: the pidfd is the lease
            self._mark(job, slot, L.RANK_DEAD, "died (seen by its pidfd)")

    # ------------------------------------------------------------ rank states
    def _mark(self, job: Job, slot: RankSlot, state: int, why: str) -> None:
        was_live = slot.state == L.RANK_ATTACHED
        slot.state = state
        job.control.set_rank_state(slot.rank, state)
        self.dirty = True
        if slot.recovering is not None:
            self._fail(slot.recovering, errors.PermissionDenied(f"rank {slot.rank} is {L.RANK_STATE_NAMES[state]}"))
            slot.recovering = None
        if state == L.RANK_DEAD:
            slot.deaths += 1
            self.counters["deaths"] += 1
        else:
            self.counters["detaches"] += 1
        self._lose(job, slot, state, was_live, why)
        if not job.live_ranks():
            self._start_grace(job)

    def _lose(self, job: Job, slot: RankSlot, state: int, was_live: bool, why: str) -> None:
        """What a rank's death or departure does to its job, by the job's policy: a degrade job
        that serves clears its bit; otherwise a death sets the abort word (peers spinning on the
        rank leave their waits at once) and a live rank's departure makes the job need a re-arm.
        The same for a rank of this daemon and for a remote rank of a job that spans nodes."""
        others_live = any(s.live for s in job.slots if s is not slot)
        where = f" on node {slot.node}" if slot.node else ""
        if job.serving_degraded:
            # the others serve on without it: its bit goes, no abort
            self._drop_rank(job, slot, why + where)
        elif state == L.RANK_DEAD:
            job.control.set_abort(L.ABORT_PEER_LOST, slot.rank)
            job.needs_rearm = job.needs_rearm or job.rendezvous_count > 0
            log.warning("job %s: rank %d (pid %s%s) %s", job.name, slot.rank, slot.pid, where, why)
        else:
            if was_live and others_live:
                # the job's rounds can no longer agree: survivors must recover with a replacement
                job.needs_rearm = True
                if not job.control.abort_word:
                    job.control.set_abort(L.ABORT_PEER_LEFT, slot.rank)
            log.info("job %s: rank %d (pid %s%s) %s", job.name, slot.rank, slot.pid, where, why)

    def _start_grace(self, job: Job) -> None:
        job.grace_deadline = time.monotonic() + self.limits.grace
        self.dirty = True
        log.info("job %s: no ranks attached; freed in %.1f s unless one re-attaches", job.name, self.limits.grace)

    # ----------------------------------------------------------------- operator
    def abort(self, peer: Peer, name: str) -> dict:
        job = self.job_for(peer, name)
        job.control.set_abort(L.ABORT_OPERATOR, -1)
        job.needs_rearm = True
        self.dirty = True
        log.warning("job %s: aborted by uid %s", job.name, peer.uid)
        return {"aborted": job.name, "generation": job.generation}

    def destroy(self, peer: Peer, name: str) -> dict:
        job = self.job_for(peer, name)
        self.free(job, f"destroyed by request of uid {peer.uid}")
        if self.fed is not None and job.domain:
            self.fed.spread_destroy(job, f"destroyed on node {job.home} by request of uid {peer.uid}")
        return {"destroyed": name}

    # ----------------------------------------------------------------- timers
    def next_deadline(self) -> float | None:
        times = []
        for job in self.jobs.values():
            if job.grace_deadline is not None:
                times.append(job.grace_deadline)
            for s in job.slots:
                if s.pending is not None:
                    times.append(s.pending.deadline)
                if s.recovering is not None:
                    times.append(s.recovering.deadline)
                if s.ticket is not None:
                    times.append(s.ticket_expiry)
        return min(times) if times else None

    def expire(self, now: float) -> None:
        for job in list(self.jobs.values()):
            if job.degrade:
                try:  # a failure here must not hold up the other jobs' timers
                    self.restore_published_mask(job)
                except Exception:
                    log.exception("job %s: checking its published active mask failed", job.name)
            for slot in job.slots:
                if slot.ticket is not None and now >= slot.ticket_expiry:
                    kind = slot.ticket_kind
                    self._drop_ticket(slot)
                    if kind == "join" and slot.state == L.RANK_JOINING:
                        self._mark(job, slot, L.RANK_DEAD, "never redeemed its ticket")
                if slot.recovering is not None and now >= slot.recovering.deadline:
                    missing = [s.rank for s in job.slots if not s.live or (s.state == L.RANK_ATTACHED and s.recovering is None)]
                    self._fail(slot.recovering, errors.RendezvousTimeout(
                        f"job {job.name!r}: recovery timed out waiting for rank(s) {missing}", missing_ranks=missing))
                    log.warning("job %s: rank %d's recovery timed out; waiting for %s", job.name, slot.rank, missing)
                    slot.recovering = None
                if slot.pending is not None and now >= slot.pending.deadline:
                    missing = job.missing_ranks()
                    lost = sorted({s.node for s in job.slots if s.rank in missing and s.lost_with_node})
                    self._fail(slot.pending, errors.RendezvousTimeout(
                        f"job {job.name!r}: rendezvous timed out waiting for rank(s) {missing}"
                        + (f" (node(s) {', '.join(lost)} unreachable)" if lost else ""), missing_ranks=missing))
                    log.warning("job %s: rank %d's rendezvous timed out; missing %s", job.name, slot.rank, missing)
                    slot.pending = None
                    self._reset_joining(job, slot)
                    if not job.live_ranks():
                        self._start_grace(job)
            if job.grace_deadline is not None and now >= job.grace_deadline:
                self.free(job, "grace period over")

    # --------------------------------------------------------------- teardown
    def free(self, job: Job, why: str) -> None:
        """Free a job now: its ranks see ABORT_DESTROYED, held replies end with JobDestroyed,
        its memory and fd-store entries are released."""
        if job.freed:
            return
        self.jobs.pop(job.name, None)
        job.freed = True
        self.dirty = True
        job.control.set_abort(L.ABORT_DESTROYED, -1)
        holders = [s.pid for s in job.slots if s.state == L.RANK_ATTACHED and s.pid and s.node is None]
        if holders:
            self.released.append({"job": job.name, "bytes": job.job_bytes, "pids": holders})
        gone = errors.JobDestroyed(f"job {job.name!r} was destroyed ({why})")
        for slot in job.slots:
            for held in (slot.pending, slot.recovering):
                if held is not None:
                    self._fail(held, gone)
            slot.pending = slot.recovering = None
            self._drop_ticket(slot)
            if slot.lease_conn is not None:
                self.leases.pop(slot.lease_conn, None)
                self.closing.append(slot.lease_conn)
                slot.lease_conn = None
            self.drop_pidfd(slot)
            if slot.alloc is not None:
                self.store.drop(ws_name(job.name, slot.rank))
                self.backend.release(slot.alloc)
                slot.alloc = None
        self.store.drop(cb_name(job.name))
        job.control.close()
        if job.control_fd >= 0:
            os.close(job.control_fd)
            job.control_fd = -1
        log.info("job %s freed (%s)", job.name, why)

    def release_handles(self, job: Job) -> None:
        """Close the daemon's own copies of a job's fds without freeing anything (the job lives
        on in the fd store for the next daemon)."""
        for slot in job.slots:
            self.drop_pidfd(slot)
            if slot.alloc is not None and slot.alloc.fd >= 0:
                os.close(slot.alloc.fd)
                slot.alloc.fd = -1
        job.control.close()
        if job.control_fd >= 0:
            os.close(job.control_fd)
            job.control_fd = -1

    def all_fds(self) -> dict[str, int]:
        """Every fd a restarted daemon needs, by fd-store name."""
        out = {}
        for job in self.jobs.values():
            out[cb_name(job.name)] = job.control_fd
            for slot in job.slots:
                if slot.alloc is not None:
                    out[ws_name(job.name, slot.rank)] = slot.alloc.fd
        return out

    def released_mapped(self) -> dict:
        """Memory of freed jobs that live processes may still map (the driver returns it only
        when the last importer unmaps; a process that held a rank at free time counts)."""
        keep = []
        for rec in self.released:
            rec["pids"] = [p for p in rec["pids"] if _alive(p)]
            if rec["pids"]:
                keep.append(rec)
        self.released = keep
        return {
            "released_mapped_bytes": sum(r["bytes"] for r in keep),
            "released_mapped_processes": len({p for r in keep for p in r["pids"]}),
            "released_mapped_jobs": [{"job": r["job"], "bytes": r["bytes"], "pids": r["pids"]} for r in keep],
        }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) maps nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
