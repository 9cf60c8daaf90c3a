"""Job registry state: jobs, their rank slots, rendezvous and leases. No sockets here;
the daemon (a2ad/daemon/server.py) drives it and does the I/O."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

from a2ad import errors, layout as L
from a2ad.daemon.backends.base import Allocation, Backend
from a2ad.control import ControlBlock

TICKET_TTL = 30.0


@dataclass
class PendingJoin:
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
    pending: PendingJoin | None = None
    #: A held `recover` reply: this rank is quiesced and waits for the job's re-arm.
    recovering: PendingJoin | None = None
    #: Secret that proves a later request (leave) comes from this rank's holder.
    lease: bytes | None = None
    ticket: bytes | None = None
    ticket_expiry: float = 0.0
    #: The open fd-socket connection that is this rank's lease (daemon.FdConn).
    lease_conn: object | None = None
    #: pidfd watching a joining process that has not redeemed its ticket yet.
    pidfd: int | None = None
    leaving: bool = False
    joined_at: float = 0.0
    attached_at: float = 0.0
    deaths: int = 0
    attaches: int = 0

    @property
    def live(self) -> bool:
        return self.state in (L.RANK_JOINING, L.RANK_ATTACHED)

    def summary(self) -> dict:
        return {
            "rank": self.rank,
            "state": L.RANK_STATE_NAMES[self.state],
            "recovering": self.recovering is not None,
            "pid": self.pid,
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

    @property
    def job_bytes(self) -> int:
        return self.ep_size * self.row_stride

    def live_ranks(self) -> list[int]:
        return [s.rank for s in self.slots if s.live]

    def missing_ranks(self) -> list[int]:
        return [s.rank for s in self.slots if not s.live]

    def pending(self) -> list[RankSlot]:
        return [s for s in self.slots if s.pending is not None]

    def recovering(self) -> list[RankSlot]:
        return [s for s in self.slots if s.recovering is not None]

    def state_name(self) -> str:
        if self.grace_deadline is not None:
            return "grace"
        if self.pending() or self.recovering():
            return "rendezvous"
        if self.needs_rearm:
            return "needs-rearm"
        if all(s.state == L.RANK_ATTACHED for s in self.slots):
            return "ready"
        return "degraded"

    def summary(self, now: float) -> dict:
        return {
            "name": self.name,
            "state": self.state_name(),
            "ep_size": self.ep_size,
            "spec": dict(self.spec),
            "size_per_rank": self.size_per_rank,
            "row_stride": self.row_stride,
            "bytes": self.job_bytes,
            "generation": self.generation,
            "rearms": self.rearms,
            "abort": L.ABORT_NAMES.get(self.control.abort_word, str(self.control.abort_word)),
            "age_s": round(now - self.created_at, 3),
            "grace_remaining_s": None if self.grace_deadline is None else round(max(0.0, self.grace_deadline - now), 3),
            "ranks": [s.summary() for s in self.slots],
            "ranks_attached": sum(1 for s in self.slots if s.state == L.RANK_ATTACHED),
            "ranks_dead": sum(1 for s in self.slots if s.state == L.RANK_DEAD),
        }


def spec_mismatch(job: Job, ep_size: int, spec: dict) -> None:
    """Raise SpecMismatch naming the first field where a join differs from the job."""
    if ep_size != job.ep_size:
        raise errors.SpecMismatch(
            f"job {job.name!r}: ep_size differs (job has {job.ep_size}, join asked for {ep_size})",
            field="ep_size",
            job_value=job.ep_size,
            requested=ep_size,
        )
    for key in sorted(set(job.spec) | set(spec)):
        a, b = job.spec.get(key), spec.get(key)
        if a != b:
            raise errors.SpecMismatch(
                f"job {job.name!r}: spec field {key} differs (job has {a}, join asked for {b})",
                field=key,
                job_value=a,
                requested=b,
            )


def new_control_block(ep_size: int) -> tuple[int, ControlBlock]:
    fd = os.memfd_create("a2ad-ctl", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, L.CONTROL_BLOCK_SIZE)
        cb = ControlBlock.map_fd(fd)
    except BaseException:
        os.close(fd)
        raise
    cb.initialize(ep_size)
    return fd, cb


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def free_job(job: Job, backend: Backend) -> None:
    """Release everything the daemon holds for a job (allocations, control block)."""
    for slot in job.slots:
        if slot.alloc is not None:
            backend.release(slot.alloc)
            slot.alloc = None
        if slot.pidfd is not None:
            os.close(slot.pidfd)
            slot.pidfd = None
    job.control.close()
    if job.control_fd >= 0:
        os.close(job.control_fd)
        job.control_fd = -1
