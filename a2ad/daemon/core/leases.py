"""Tickets, leases and pidfds: how a rank proves who it is after its join, and how the
registry learns that it is gone.

- A released join carries a one-use *ticket* (``TICKET_TTL`` seconds) and a *lease*
  secret. The rank presents the ticket on fd.sock (``redeem``); it is attached from then on
  (``attach``: the state file records it before the handles go out, so a daemon killed
  after sending them comes back holding the rank for its process); the handles go out and
  that connection becomes its lease connection (``delivered``), whose end is its death or,
  after a ``leave``, its departure (``lease_closed``). A redeem whose handles cannot be sent
  is a death (``undelivered``).
- Later requests (leave, recover, renew) prove their holder with the lease secret.
- While no lease connection stands for a rank (joining, or adopted after a daemon restart
  until it renews), a pidfd watches its process (``watch_pid``, ``pid_exited``); the server
  polls ``Registry.pidfds``.

``Leases`` is one of the Registry's parts (registry.py composes them). It owns the tickets,
the pidfds and the lease connections (``tickets``, ``pidfds``, ``conns``: each names the job
and rank it stands for); it is given the host port (tokens, pidfds), who may do what
(``auth``), the shared effects (effects.py), a way to find a job by name, and the one step of
the Registry it triggers: ``mark(job, slot, state, why)``, a rank's death or departure.
"""

from __future__ import annotations

import logging
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from a2ad import errors, layout as L, mutations
from a2ad.daemon.auth import Auth, Peer

if TYPE_CHECKING:
    from a2ad.daemon.core.effects import Effects
    from a2ad.daemon.core.jobs import Job, RankSlot
    from a2ad.daemon.core.ports import Host

log = logging.getLogger("a2ad")

#: Seconds a released join's (or a renew's) ticket stays valid.
TICKET_TTL = 30.0


@dataclass
class Redeemed:
    """What the fd socket must send for a redeemed ticket (fds in handle order), and to whom
    the connection belongs once sent."""

    kind: str
    job: Job
    slot: RankSlot
    fds: list[int]
    #: the process it was redeemed by
    pid: int = 0
    #: whether the rank was attached at the redeem (a join's), before its handles go out
    attached: bool = False
    #: the slot's attach count after the redeem: a later attach of the rank (a re-join in
    #: between) makes this redeem stale
    attaches: int = 0


class Leases:
    """The Registry's tickets, leases and pidfds."""

    def __init__(self, fx: Effects, host: Host, auth: Auth, find_job: Callable[[str], Job | None],
                 mark: Callable[[Job, RankSlot, int, str], None], fd_budget: Callable[[int], None]):
        self.fx = fx
        self.host = host
        self.auth = auth
        self._find_job = find_job
        self._mark = mark
        #: refuses (LimitExceeded) fds the daemon may not open now
        self._fd_budget = fd_budget
        #: ticket -> (job, rank) it was issued for
        self.tickets: dict[bytes, tuple[Job, int]] = {}
        #: pidfd -> (job, rank)
        self.pidfds: dict[int, tuple[Job, int]] = {}
        #: lease connection -> (job, rank) whose lease it is
        self.conns: dict[object, tuple[Job, int]] = {}

    # --------------------------------------------------------- lease requests
    def slot_for_lease(self, name: str, rank: int, lease: bytes) -> tuple[Job, RankSlot]:
        job = self._find_job(name)
        if job is None:
            raise errors.NoSuchJob(f"no job named {name!r}")
        slot = job.slot(rank)
        if slot.lease is None or not hmac.compare_digest(lease, slot.lease):
            raise errors.PermissionDenied(f"job {job.name!r} rank {rank}: the lease does not match its holder")
        return job, slot

    def issue_ticket(self, job: Job, slot: RankSlot, kind: str, now: float) -> bytes:
        self.drop_ticket(slot)
        ticket = self.host.token(32)
        self.tickets[ticket] = (job, slot.rank)
        slot.ticket, slot.ticket_kind, slot.ticket_expiry = ticket, kind, now + TICKET_TTL
        return ticket

    def drop_ticket(self, slot: RankSlot) -> None:
        if slot.ticket is not None:
            self.tickets.pop(slot.ticket, None)
            slot.ticket = slot.ticket_kind = None

    def check_holder(self, peer: Peer, job: Job, slot: RankSlot, what: str) -> None:
        """A lease token is the rank's holder's: another uid that got hold of it (a leaked
        token) may not use it; an admin may."""
        if peer.uid is None or peer.uid == slot.uid or self.auth.is_admin(peer):
            return
        if what == "leave" and mutations.active("leave_any_uid"):
            return
        raise errors.PermissionDenied(
            f"job {job.name!r} rank {slot.rank}: uid {peer.uid} may not {what} with the lease of uid {slot.uid}'s rank")

    def leave(self, peer: Peer, f: dict) -> dict:
        job, slot = self.slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        self.check_holder(peer, job, slot, "leave")
        if not slot.live:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank} is {L.RANK_STATE_NAMES[slot.state]}, not held")
        slot.leaving = True
        if slot.lease_conn is not None:
            # the leave is complete when its reply goes out: the rank is free for a successor
            # at once, whether or not the client's socket close has arrived yet
            self.lease_closed(slot.lease_conn)
        else:  # left before redeeming its ticket, or adopted after a restart without a lease
            self.drop_ticket(slot)
            if slot.pending is not None:
                slot.pending = None
            self.drop_pidfd(slot)
            self._mark(job, slot, L.RANK_LEFT, "left")
        return {}

    def renew(self, peer: Peer, f: dict) -> dict:
        """A ticket for a new lease connection (after a daemon restart dropped the old one)."""
        job, slot = self.slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        if peer.pid and peer.pid != f["pid"]:
            raise errors.PermissionDenied(f"renew claims pid {f['pid']} but comes from pid {peer.pid}")
        if slot.state != L.RANK_ATTACHED or slot.pid != f["pid"]:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank} is not attached to pid {f['pid']}")
        ticket = self.issue_ticket(job, slot, "renew", self.fx.now)
        slot.watch = f.get("watch") or ()
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
        self.drop_ticket(slot)
        fds = [] if kind == "renew" else [s.alloc.fd for s in job.slots if s.node is None] + [job.control_fd]
        return Redeemed(kind=kind, job=job, slot=slot, fds=fds, pid=slot.pid, attaches=slot.attaches)

    def attach(self, r: Redeemed) -> None:
        """A join's ticket was redeemed: the rank is attached, its handles about to go out (by
        the server, once the state file holds this). Until they did (``delivered``) its pidfd
        still watches its process."""
        slot, job = r.slot, r.job
        job.set_rank_state(slot, L.RANK_ATTACHED)
        slot.attached_at = self.fx.now
        slot.attaches += 1
        r.attached, r.attaches = True, slot.attaches
        self.fx.dirty = True
        self.fx.counters["attaches"] += 1
        log.info("job %s: rank %d attached (pid %d)", job.name, slot.rank, slot.pid)

    def undeliverable(self, r: Redeemed) -> errors.A2ADError | None:
        """Why the handles of a redeem made earlier in the server's turn may not go out any
        more (None: they may): its job was freed, or its rank changed hands or state in
        between (its process died, left, or joined again)."""
        job, slot = r.job, r.slot
        if job.freed:
            return errors.JobDestroyed(f"job {job.name!r} was freed before the handles went out")
        want = L.RANK_ATTACHED if r.attached or r.kind == "renew" else L.RANK_JOINING
        if slot.pid != r.pid or slot.state != want or (r.attached and (slot.attaches != r.attaches
                                                                        or slot.lease_conn is not None)):
            return errors.BadTicket(f"job {job.name!r} rank {slot.rank} is {L.RANK_STATE_NAMES[slot.state]} "
                                    f"(pid {slot.pid}) since the ticket was redeemed")
        return None

    def delivered(self, r: Redeemed, conn: object) -> None:
        """The redeem's answer went out: ``conn`` is now the rank's lease."""
        slot, job = r.slot, r.job
        if slot.lease_conn is not None and slot.lease_conn is not conn:
            self.conns.pop(slot.lease_conn, None)
            self.fx.closing.append(slot.lease_conn)  # a renewed lease replaces the old connection
        slot.lease_conn = conn
        self.conns[conn] = (job, slot.rank)
        self.drop_pidfd(slot)
        self._watch_threads(job, slot)
        if r.kind == "renew":
            log.info("job %s: rank %d renewed its lease (pid %d)", job.name, slot.rank, slot.pid)

    def undelivered(self, r: Redeemed, why: str) -> None:
        """The redeem's answer could not be sent (the client closed or stalled): a joining rank
        never got its handles, so it is dead to the job; a renewing rank keeps its pidfd lease."""
        if r.kind == "renew" or self.undeliverable(r) is not None:  # (a freed job's too)
            return
        log.warning("job %s: rank %d's handles could not be delivered (%s)", r.job.name, r.slot.rank, why)
        self._mark(r.job, r.slot, L.RANK_DEAD, "never received its handles")

    def lease_closed(self, conn: object) -> None:
        """A lease connection ended (EOF, error, or a leave)."""
        self.fx.closing.append(conn)
        entry = self.conns.pop(conn, None)
        if entry is None:
            return
        job, rank = entry
        slot = job.slots[rank]
        if job.freed or slot.lease_conn is not conn:
            return
        slot.lease_conn = None
        self.drop_pidfd(slot)
        if slot.leaving:
            self._mark(job, slot, L.RANK_LEFT, "left")
        else:
            self._mark(job, slot, L.RANK_DEAD, "died (lease connection closed without leave)")

    def end_lease(self, slot: RankSlot) -> None:
        """Close ``slot``'s lease connection, if it has one, without counting it an end of the
        rank (its job is being freed)."""
        if slot.lease_conn is not None:
            self.conns.pop(slot.lease_conn, None)
            self.fx.closing.append(slot.lease_conn)
            slot.lease_conn = None

    # ----------------------------------------------------------------- pidfds
    def watch_pid(self, job: Job, slot: RankSlot) -> bool:
        """Watch a rank's process with a pidfd; False when it is already gone."""
        self.drop_pidfd(slot)
        try:
            slot.pidfd = self.host.open_pidfd(slot.pid)
        except (ProcessLookupError, OSError, TypeError):
            return False
        if slot.pidfd is None:
            return False
        self.pidfds[slot.pidfd] = (job, slot.rank)
        return True

    def _watch_threads(self, job: Job, slot: RankSlot) -> None:
        """The rank holds its lease: watch the watch threads its join or renew named (a
        thread that is not one of its process's is not watched)."""
        if not slot.watch:
            return
        try:
            self._fd_budget(len(slot.watch))
        except errors.LimitExceeded:
            log.warning("job %s: rank %d's watch threads not watched: the daemon is near its open-file limit "
                        "(its death is seen when its lease connection closes)", job.name, slot.rank)
            return
        for tid in slot.watch:
            fd = self.host.open_thread_pidfd(slot.pid, tid)
            if fd is not None:
                slot.watchfds.append(fd)
                self.pidfds[fd] = (job, slot.rank)

    def hold_pidfd(self, job: Job, slot: RankSlot, pidfd: int) -> None:
        """Watch ``slot``'s rank by ``pidfd``, already opened on its process (a join's)."""
        slot.pidfd = pidfd
        self.pidfds[pidfd] = (job, slot.rank)

    def drop_pidfd(self, slot: RankSlot) -> None:
        """Stop watching the rank's process: its pidfd and its watch threads' pidfds."""
        if slot.pidfd is not None:
            self.pidfds.pop(slot.pidfd, None)
            self.host.close_fd(slot.pidfd)
            slot.pidfd = None
        for fd in slot.watchfds:
            self.pidfds.pop(fd, None)
            self.host.close_fd(fd)
        slot.watchfds = []

    def pid_exited(self, pidfd: int) -> None:
        entry = self.pidfds.get(pidfd)
        if entry is None:
            return
        job, rank = entry
        slot = job.slots[rank]
        watched = pidfd in slot.watchfds
        self.drop_pidfd(slot)
        if job.freed:
            return
        if watched:
            # a watch thread ended: its process is dying (they end only with it), and its
            # lease connection would close only once the kernel has torn the process down
            conn = slot.lease_conn
            if slot.state != L.RANK_ATTACHED or conn is None or slot.leaving:
                return
            self.conns.pop(conn, None)
            self.fx.closing.append(conn)
            slot.lease_conn = None
            self._mark(job, slot, L.RANK_DEAD, "died (its watch thread ended with its process)")
            return
        if slot.state == L.RANK_JOINING:
            slot.pending = None
            self.drop_ticket(slot)
            self._mark(job, slot, L.RANK_DEAD, "died before attaching")
        elif slot.state == L.RANK_ATTACHED and slot.lease_conn is None:
            # adopted after a daemon restart, lease not renewed yet: the pidfd is the lease
            self._mark(job, slot, L.RANK_DEAD, "died (seen by its pidfd)")
