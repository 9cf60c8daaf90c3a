"""The job registry: jobs and their rendezvous, re-arm, recover, timers, free and adoption,
and the one entry point of the core's decisions (the server, the fd socket, the federation
and the simulator call it). It owns no socket: callers hand it requests and events, and it
answers with a reply or an error, and leaves what else it decided in its effects
(effects.py), which the server carries out:

- ``outbox``: (ZeroMQ identity, encoded frame) for held replies it releases (rendezvous,
  recover) or ends with an error (timeouts, spec mismatch, destroy);
- ``closing``: lease connections (opaque objects of the fd socket) to close;
- ``dirty``: the state file is to be written.

The Registry composes its parts; each is an object with its own state and the collaborators
it is given, and none calls another's private methods:

- ``leasing`` (leases.py, ``Leases``): tickets, lease connections and pidfds, from a released
  join to an attached rank and to its death or departure; it owns ``tickets``, ``pidfds``
  and the lease connections, and is given the host port, ``auth``, a way to find a job and
  one step of the Registry, ``_mark`` (a rank's state after its death or departure);
- ``policy`` (policy.py, ``LossPolicy``): what losing a rank does by the job's policy,
  re-admission into a degraded job, the active mask; it owns nothing, and is given the
  memory backend and two rendezvous steps (``_release_join``, ``_reset_joining``);
- ``mirror`` (mirror.py, ``Mirror``): in a domain, other nodes' ranks as they report them and
  the two steps of a rendezvous its coordinator decides; it is given the fd store, the
  backend, the policy and the Registry's steps it triggers (``_release_join``,
  ``_reset_joining``, ``_rearm``, ``_start_grace``, ``free``, ``_rendezvous_done``);
- jobs.py: ``Job`` and ``RankSlot``, and ``Job.set_rank_state``, the one writer of a rank's
  state;
- this module: the Registry itself (join, rendezvous and re-arm, recover, operator requests,
  timers, teardown, adoption of a previous daemon's jobs), the thin calls that hand the
  lease requests to ``leasing``, and the calls the federation makes (by job name: the job as
  plain data, ``job_facts``, ``domain_report``, ``rank_holders``, ``remote_nodes``; what the
  domain does to it, ``apply_remote``, ``domain_prepare``, ``domain_release``, ...).

A join in order: ``Registry.join`` (here) seats the rank and holds its reply;
``_maybe_release`` answers every held join with a ticket (``Leases.issue_ticket``);
``Leases.redeem`` and ``Leases.delivered`` hand the fds over and make the connection the
rank's lease.

In a domain (federation.py) a job may span nodes: its slots for ranks whose rows another
node's daemon holds are *remote* (``RankSlot.node`` names that node) and mirror what that
node reports; only local slots have rows, fds, leases and held requests here. The
rendezvous and every re-arm of such a job are decided by its coordinator, not by
``_maybe_release``; losses of remote ranks go through the same policy as local ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from a2ad import errors, layout as L, mutations, protocol
from a2ad.daemon import persist
from a2ad.daemon.auth import Auth, Peer
from a2ad.daemon.backends.base import Backend
from a2ad.daemon.core.effects import Effects
from a2ad.daemon.core.jobs import Held, Job, JobFacts, RankSlot
from a2ad.daemon.core.leases import Leases, Redeemed
from a2ad.daemon.core.mirror import Mirror
from a2ad.daemon.core.names import cb_name, ws_name
from a2ad.daemon.core.policy import LossPolicy, active_mask, readmit_nodes
from a2ad.daemon.core.ports import Host, Store

__all__ = ["Held", "Job", "Limits", "RankSlot", "Redeemed", "Registry"]

log = logging.getLogger("a2ad")


@dataclass
class Limits:
    grace: float = 30.0
    max_rendezvous_timeout: float = 600.0
    max_job_bytes: int = 1 << 40
    max_total_bytes: int = 1 << 42
    #: joins held in a rendezvous at once, per uid
    max_held_joins_per_uid: int = 256
    #: what one uid's jobs may hold at once (None: no cap); admins are not capped
    max_jobs_per_uid: int | None = 256
    max_fds_per_uid: int | None = None
    max_bytes_per_uid: int | None = None


#: The per-uid caps: (usage key, option that sets it, Limits field, what it counts).
UID_CAPS = (
    ("jobs", "--max-jobs-per-uid", "max_jobs_per_uid", "jobs"),
    ("fds", "--max-fds-per-uid", "max_fds_per_uid", "file descriptors"),
    ("bytes", "--max-bytes-per-uid", "max_bytes_per_uid", "bytes of workspace"),
)


class Registry:
    """The daemon's jobs and the one entry point of the core's decisions: what the server, the
    fd socket, the federation and the simulator call. It composes its parts, each with its own
    state and the collaborators it is given: ``leasing`` (``Leases``: tickets, pidfds, lease
    connections), ``policy`` (``LossPolicy``: masks, abort words, re-admissions) and
    ``mirror`` (``Mirror``: other nodes' ranks, the domain rendezvous' steps here); the
    effects they share are ``fx`` (effects.py)."""

    def __init__(self, backend: Backend, store: Store, auth: Auth, limits: Limits, host: Host):
        self.backend = backend
        self.host = host
        self.store = store
        self.auth = auth
        self.limits = limits
        #: the time of the event being handled and the effects decided (``now``, ``outbox``,
        #: ``closing``, ``dirty``, ``counters`` below are its fields)
        self.fx = Effects()
        self.jobs: dict[str, Job] = {}
        self.draining = False
        self.rendezvous_latencies: list[float] = []
        self.on_rendezvous: Callable[[float], None] | None = None
        #: memory of freed jobs still mapped by processes: [{job, bytes, pids}]
        self.released: list[dict] = []
        #: The domain's job federation (federation.py), when the daemon runs in a domain.
        self.fed = None
        #: called before a job is freed, to decide whether the fd-store entries go too
        self.fd_budget: Callable[[int], None] = lambda n: None
        self.leasing = Leases(self.fx, host, auth, lambda name: self.jobs.get(name), mark=self._mark,
                              fd_budget=lambda n: self.fd_budget(n))
        self.policy = LossPolicy(self.fx, backend, release_join=self._release_join, reset_joining=self._reset_joining)
        self.mirror = Mirror(self.fx, store, backend, self.policy, release_join=self._release_join,
                             reset_joining=self._reset_joining, rearm=self._rearm, start_grace=self._start_grace,
                             free=self.free, rendezvous_done=self._rendezvous_done)

    # ------------------------------------------------------------------ effects
    @property
    def now(self) -> float:
        """The time of the event being handled (a monotonic clock's seconds), set by whoever
        hands the registry an event: the server before each, the simulator from its clock."""
        return self.fx.now

    @now.setter
    def now(self, t: float) -> None:
        self.fx.now = t

    @property
    def outbox(self) -> list[tuple[bytes, bytes]]:
        return self.fx.outbox

    @outbox.setter
    def outbox(self, v: list) -> None:
        self.fx.outbox = v

    @property
    def closing(self) -> list[object]:
        return self.fx.closing

    @closing.setter
    def closing(self, v: list) -> None:
        self.fx.closing = v

    @property
    def dirty(self) -> bool:
        return self.fx.dirty

    @dirty.setter
    def dirty(self, v: bool) -> None:
        self.fx.dirty = v

    @property
    def counters(self) -> dict[str, int]:
        return self.fx.counters

    @property
    def tickets(self) -> dict:
        return self.leasing.tickets

    @property
    def pidfds(self) -> dict:
        """pidfd -> (job, rank): what the server polls for process deaths (``pid_exited``)."""
        return self.leasing.pidfds

    # ------------------------------------------------------------------ lookups
    @property
    def node_name(self) -> str:
        """This daemon's node: its name in the domain, or the short host name."""
        return self.fed.node if self.fed is not None else self.host.hostname

    def job_for(self, peer: Peer, name: str) -> Job:
        """The job ``name`` as ``peer`` may see it: NoSuchJob for a job of another user (its
        existence is not revealed), unless the peer is an admin."""
        job = self.jobs.get(name)
        if job is None or not self.auth.may_use(peer, job.owner_uid):
            raise errors.NoSuchJob(f"no job named {name!r}")
        return job

    def visible_jobs(self, peer: Peer) -> list[Job]:
        return [j for j in self.jobs.values() if self.auth.may_use(peer, j.owner_uid)]

    def uid_usage(self, uid: int | None) -> dict[str, int]:
        """What the jobs ``uid`` created hold on this daemon: jobs, fds (control blocks, each
        with the description its mapping keeps; rows, lease connections and pidfds) and bytes."""
        jobs = fds = nbytes = 0
        per_block = 1 if mutations.active("uid_fds_undercount") else self.host.control_block_fds
        for j in self.jobs.values():
            if j.owner_uid != uid:
                continue
            jobs += 1
            nbytes += j.job_bytes
            fds += per_block + sum((s.alloc is not None) + (s.lease_conn is not None) + (s.pidfd is not None)
                                   + len(s.watchfds) for s in j.slots)
        return {"jobs": jobs, "fds": fds, "bytes": nbytes}

    def _check_uid_caps(self, peer: Peer, **need: int) -> None:
        """Refuse a join that would take ``peer``'s jobs past a per-uid cap (``need``: what it
        adds, by usage key); the refusal names the cap. Admins are not capped."""
        if peer.uid is None or not any(need.values()) or self.auth.is_admin(peer):
            return
        use = self.uid_usage(peer.uid)
        for key, option, attr, what in UID_CAPS:
            cap, more = getattr(self.limits, attr), need.get(key, 0)
            if cap is None or not more or use[key] + more <= cap:
                continue
            self.counters["refused"] += 1
            raise errors.LimitExceeded(
                f"uid {peer.uid}'s jobs hold {use[key]} {what} on this daemon and this join needs {more} more, "
                f"over the per-uid cap of {cap} ({option}); end a job first, or ask the operator to raise it",
                needed=use[key] + more, limit=cap, cap=option)

    # --------------------------------------------------------------------- join
    def join(self, peer: Peer, identity: bytes, rid: int, f: dict) -> None:
        """Register a join (``f``: the request's fields, checked by protocol.py). The reply is
        held until the rendezvous (see ``outbox``); errors raise at once. The steps: the
        joining process is who it says (``_check_joiner``) and under its cap of held joins;
        a pidfd is opened on it; the job is created or its spec checked (``_new_job``,
        ``_check_job``); its rank's slot is claimed and given a row (``_claim_slot``); the
        rank is seated in the slot, its reply held (``_seat``); then the rendezvous is
        released if it is complete, or the rank let straight back into a degraded job
        (``_release_or_wait``)."""
        self._check_joiner(peer, f)
        spec = protocol.normalize_spec(f["spec"], f["ep_size"])
        job = self.jobs.get(f["job"])
        self._check_held_joins(peer, job, f)
        pidfd = self._open_pidfd(f["pid"])
        try:
            if job is None:
                job = self._new_job(peer, f, spec)
            else:
                self._check_job(job, peer, f, spec)
            slot = self._claim_slot(job, f, peer)
        except BaseException:
            if pidfd is not None:
                self.host.close_fd(pidfd)
            if job is not None and not job.freed and not job.live_ranks() and job.grace_deadline is None:
                self._start_grace(job)
            raise
        replacing = self._seat(job, slot, peer, identity, rid, f, pidfd)
        self._release_or_wait(job, slot, replacing)

    def _check_joiner(self, peer: Peer, f: dict) -> None:
        """The joining process is the one it claims to be, on a device this daemon serves."""
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

    def _check_held_joins(self, peer: Peer, job: Job | None, f: dict) -> None:
        """A uid holds at most ``max_held_joins_per_uid`` joins waiting for their rendezvous.
        A join that completes its rendezvous is released at once: it is never held; nor is a
        replacement let back into a degraded job that kept serving on one node (across nodes it
        is held until the others take it back in, and counts)."""
        rank = f["ep_rank"]
        completes = f["ep_size"] == 1 or (
            job is not None and job.ep_size == f["ep_size"]
            # (a replacement across nodes is held until the other nodes take it back in: it counts)
            and (all(s.live for s in job.slots if s.rank != rank)
                 or (self.policy.readmits(job, rank) and not (job.domain and job.spans)))
        )
        if peer.uid is None or completes:
            return
        held = sum(1 for j in self.jobs.values() for s in j.slots if s.pending is not None and s.uid == peer.uid)
        if held >= self.limits.max_held_joins_per_uid:
            self.counters["refused"] += 1
            raise errors.LimitExceeded(
                f"uid {peer.uid} already holds {held} joins waiting for their rendezvous "
                f"(limit {self.limits.max_held_joins_per_uid})",
                needed=held + 1, limit=self.limits.max_held_joins_per_uid,
            )

    def _open_pidfd(self, pid: int) -> int | None:
        """A pidfd on the joining process, which must exist before anything is created for it
        (None: no pidfd support; a death during the rendezvous is then caught by its timeout)."""
        try:
            return self.host.open_pidfd(pid)
        except ProcessLookupError:
            raise errors.InvalidField(f"pid {pid} is not a running process", field="pid") from None

    def _new_job(self, peer: Peer, f: dict, spec: dict) -> Job:
        """The first join of a job creates it (in a domain: as the domain decided it, if it has)."""
        if self.draining:
            raise errors.Draining("the daemon is draining: no new jobs are accepted")
        name = f["job"]
        confirmed = True
        if self.fed is not None:
            # what the domain already decided about this job (another node created it)
            confirmed = self.fed.check_new_job(name, f["ep_size"], spec, peer)
        job = self._create_job(name, f["ep_size"], spec, peer, f["device"], len(f.get("watch") or ()),
                               lines=f.get("lines", False))
        if self.fed is not None:
            job.domain, job.this_node, job.confirmed = True, self.fed.node, confirmed
            self.fed.job_created(name)  # other nodes' ranks of it, as they reported them
        return job

    def _check_job(self, job: Job, peer: Peer, f: dict, spec: dict) -> None:
        """A join of an existing job: the peer may use it, and asks for the job's spec (a
        mismatch ends the joins already waiting too)."""
        if not self.auth.may_use(peer, job.owner_uid):
            raise errors.PermissionDenied(f"job {job.name!r} belongs to another user; choose another job name")
        mismatch = job.spec_mismatch(f["ep_size"], spec, rank=f["ep_rank"], pid=f["pid"], node=self.node_name)
        if mismatch is not None:
            self._refuse_waiting(job, mismatch)
            if self.fed is not None and job.domain and job.confirmed:
                self.fed.spread_refusal(job.name, mismatch)  # the ranks waiting on other nodes hear it too
            raise mismatch
        if job.lines_tail and job.lines_checked and not f.get("lines", False) \
                and not mutations.active("lines_word_unchecked"):
            # a client that does not say it combines through the lines (one of an a2ad release
            # before them) would run the other combine in the same rounds: its peers would wait
            # for lines it never writes, and it would read rows they never staged
            raise errors.SpecMismatch(
                f"job {job.name!r}: its ranks combine through the rows' lines tails, and the joining client "
                f"(rank {f['ep_rank']}, pid {f['pid']}) does not say it does (a client of an a2ad release before "
                "the lines?): run the job's ranks on one a2ad release, or let every rank leave so that the job is "
                "made anew by the first join",
                field="lines", job_value=True, requested=False, rank=f["ep_rank"], node=None,
            )

    def _claim_slot(self, job: Job, f: dict, peer: Peer) -> RankSlot:
        """The joining rank's slot: free, this daemon's, with a row on the declared device
        (within the joining uid's caps: a row, its pidfd and then its lease connection)."""
        name, rank = job.name, f["ep_rank"]
        slot = job.slot(rank)
        if slot.node is not None:
            if slot.live:
                raise errors.RankTaken(
                    f"job {name!r} rank {rank} is held by live pid {slot.pid} on node {slot.node} "
                    f"({L.RANK_STATE_NAMES[slot.state]})", holder_pid=slot.pid, node=slot.node)
            raise errors.RankTaken(
                f"job {name!r} rank {rank} has its workspace on node {slot.node}: a replacement joins through "
                "that node's daemon", node=slot.node)
        if slot.live and slot.pid == f["pid"] and slot.lease_conn is None \
                and not mutations.active("own_rank_refused"):
            self._supersede(job, slot)
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
        new_row = slot.alloc is None
        self._check_uid_caps(peer, fds=1 + new_row + len(f.get("watch") or ()),
                             bytes=job.row_stride if new_row and job.domain else 0)
        if new_row:
            self._allocate(job, slot, f["device"])
        return slot

    def _supersede(self, job: Job, slot: RankSlot) -> None:
        """The process the daemon holds ``slot`` for joins it again while it holds no lease
        connection: whatever it had (a join whose reply or handles never reached it, say a
        redeem reset by an upgrade or restart; or an attachment whose handles it gave up) it
        does not hold any more, and its new join replaces it. An attached rank counts as
        gone by its job's policy, exactly as a replacement's predecessor does; a held join is
        answered as superseded."""
        why = "joined again without its lease"
        log.warning("job %s: rank %d's pid %d joins again while the daemon holds the rank %s for it without a lease: "
                    "the new join replaces it", job.name, slot.rank, slot.pid, L.RANK_STATE_NAMES[slot.state])
        if slot.state == L.RANK_JOINING:
            if slot.pending is not None and not slot.readmit_wait:
                self.fx.fail(slot.pending, errors.StateError("superseded by a newer join of the same process"))
            slot.pending = None
            slot.readmit_wait = slot.readmitting = False
            self._reset_joining(job, slot)
        else:
            self.leasing.drop_ticket(slot)
            self.leasing.drop_pidfd(slot)
            self._mark(job, slot, L.RANK_DEAD, why)

    def _seat(self, job: Job, slot: RankSlot, peer: Peer, identity: bytes, rid: int, f: dict,
              pidfd: int | None) -> bool:
        """The rank joins its slot: its pid watched, a fresh lease, its reply held until the
        rendezvous (or the request's timeout). Whether it replaces an earlier holder."""
        replacing = slot.state == L.RANK_DEAD or slot.attaches > 0
        self.leasing.drop_pidfd(slot)
        job.set_rank_state(slot, L.RANK_JOINING)
        slot.pid, slot.uid, slot.device = f["pid"], peer.uid, f["device"]
        slot.watch = f.get("watch") or ()
        slot.leaving = False
        slot.joined_at = self.now
        slot.lease = self.host.token(32)
        if pidfd is not None:
            self.leasing.hold_pidfd(job, slot, pidfd)
        timeout = min(f.get("timeout", 60.0), self.limits.max_rendezvous_timeout)
        slot.pending = Held(identity=identity, request_id=rid, deadline=self.now + timeout)
        job.grace_deadline = None
        job.last_join_seen = slot.joined_at
        if job.rendezvous_started is None:
            job.rendezvous_started = self.now
        self.counters["joins"] += 1
        self.dirty = True
        log.info(
            "job %s: rank %d %s (pid %d, device %s); %d/%d ranks present", job.name, slot.rank,
            "rejoined" if replacing else "joined", f["pid"], f["device"], len(job.live_ranks()), job.ep_size,
        )
        return replacing

    def _release_or_wait(self, job: Job, slot: RankSlot, replacing: bool) -> None:
        """A seated join: let straight back into a degraded job that kept serving, or released
        with the others once the rendezvous is complete (in a domain: by its coordinator)."""
        across = job.domain and job.spans
        readmits = self.policy.readmits(job, slot.rank)
        capable = not across or self.fed is None or self.fed.readmit_capable(job.name, readmit_nodes(job))
        if readmits and capable:
            if across:
                self.policy.readmit_across(job, slot)  # answered once the other nodes took it back in
            else:
                self.policy.readmit(job, slot)
            return
        if job.domain and job.spans and job.serving_degraded and replacing:
            # the others serve on other nodes, but none of them is known here to be attached and
            # admitted (this daemon has not heard their reports yet, say after a restart), or a
            # node with live ranks runs a daemon that does not answer re-admissions: it comes back
            # through a job-wide re-arm
            job.needs_rearm = True
            if not job.control.abort_word:
                job.control.set_abort(L.ABORT_REARM, slot.rank)
            log.info("job %s: rank %d's replacement comes back through a job-wide re-arm (%s)", job.name, slot.rank,
                     "a node with live ranks of the job does not answer re-admissions" if readmits else
                     "no attached and admitted rank of the job is known here to let it in")
        self._maybe_release(job)

    def _refuse_waiting(self, job: Job, exc: errors.SpecMismatch) -> None:
        """A join that does not match the job's spec: the ranks already waiting in its
        rendezvous learn it at once too (their group is misconfigured), instead of waiting for
        their timeout. Running ranks are left alone."""
        for slot in job.pending():
            self.fx.fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
            log.warning("job %s: rank %d's join ended by a mismatching join: %s", job.name, slot.rank, exc.message)
        if not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def _reset_joining(self, job: Job, slot: RankSlot) -> None:
        self.leasing.drop_pidfd(slot)
        self.leasing.drop_ticket(slot)
        job.set_rank_state(slot, L.RANK_EMPTY)
        slot.lease = None
        self.dirty = True

    def _create_job(self, name: str, ep_size: int, spec: dict, peer: Peer, device: str, watch: int = 0,
                    lines: bool = False) -> Job:
        owner_uid = peer.uid
        size = spec["workspace_size_per_rank"]
        aux = L.aux_layout(ep_size, spec["max_num_tokens"])
        if size < L.pad_up(aux.aux_data_size) + 1:
            raise errors.InvalidField(
                f"workspace_size_per_rank {size} is smaller than the aux region alone ({L.pad_up(aux.aux_data_size)} bytes "
                f"for ep_size {ep_size}, max_num_tokens {spec['max_num_tokens']})",
                field="spec.workspace_size_per_rank",
            )
        # rows of a job of at most 64 ranks on a backend whose rows the CUDA kernels use get a lines
        # tail (not in a domain, whose nodes decide the row stride together), when the creating
        # client combines through them (``lines``: a client of a release before them does not, and
        # neither may any other rank of the job then)
        tail = lines and self.backend.lines_tail and self.fed is None and ep_size <= L.MAX_LINES_EP_SIZE
        stride = self.backend.row_stride(L.row_bytes_with_tail(size) if tail else size, device)
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
        # its control block, the first rank's row and that rank's pidfd (then lease connection
        # and watch threads' pidfds)
        self._check_uid_caps(peer, jobs=1, fds=self.host.control_block_fds + 2 + watch, bytes=job_bytes)
        self.fd_budget(ep_size + 2)
        cfd, cb = self.host.new_control_block(ep_size, L.POLICY_CODES[spec.get("on_peer_loss", protocol.DEFAULT_PEER_LOSS)])
        job = Job(
            name=name, ep_size=ep_size, spec=spec, size_per_rank=size, row_stride=stride, aux=aux,
            control_fd=cfd, control=cb, slots=[RankSlot(rank=r) for r in range(ep_size)], owner_uid=owner_uid,
            created_at=self.now, lines_tail=L.lines_tail_offset(size, stride) if tail else 0, lines_checked=True,
        )
        self.jobs[name] = job
        self.store.put(cb_name(name), cfd)
        self.dirty = True
        log.info("job %s created by uid %s: ep_size %d, %d bytes per rank, spec %s", name, owner_uid, ep_size, size, spec)
        return job

    def _allocate(self, job: Job, slot: RankSlot, device: str) -> None:
        stride = self.backend.row_stride(job.row_bytes, device)
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
        alloc = self.backend.allocate(job.row_bytes, device)
        try:
            self.backend.initialize(alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=True,
                                    tail=job.tail_bytes)
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
        now = self.now
        latency = now - max(s.joined_at for s in job.pending()) if job.pending() else 0.0
        for slot in job.recovering():
            self.fx.reply(slot.recovering, {"generation": job.generation})
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
        self._rendezvous_done(latency)
        log.info("job %s: rendezvous done (%d ranks, %.3f ms after the last join)", job.name, job.ep_size, latency * 1e3)

    def _rendezvous_done(self, latency: float) -> None:
        """A rendezvous released its joins, ``latency`` seconds after the last join (counted,
        kept for the status, observed by ``on_rendezvous``)."""
        self.counters["rendezvous"] += 1
        self.rendezvous_latencies.append(latency)
        del self.rendezvous_latencies[:-1000]
        if self.on_rendezvous is not None:
            self.on_rendezvous(latency)

    def _release_join(self, job: Job, slot: RankSlot, now: float) -> None:
        """Answer ``slot``'s held join: the layout, the handles it will receive, its ticket and lease."""
        handles = [self._handle_entry(job, s) for s in job.slots]
        handles.append({"kind": "control", "size": L.CONTROL_BLOCK_SIZE})
        self.leasing.issue_ticket(job, slot, "join", now)
        self.fx.reply(slot.pending, {
            "job": job.name,
            "ep_rank": slot.rank,
            "ep_size": job.ep_size,
            "spec": job.spec,
            "size_per_rank": job.size_per_rank,
            "row_stride": job.row_stride,
            "lines_tail": job.lines_tail,
            "backend": self.backend.name,
            "handle_type": slot.alloc.handle_type,
            "generation": job.generation,
            "metainfo": job.aux.metainfo(),
            "handles": handles,
            "ticket": slot.ticket,
            "lease": slot.lease,
        })
        slot.pending = None
        slot.readmit_wait = False  # (a held re-admission answered by a rendezvous of everyone, too)

    @staticmethod
    def _handle_entry(job: Job, s: RankSlot) -> dict:
        """One workspace entry of a join reply: a local row comes as the next fd, a remote one
        as its fabric handle (docs/PROTOCOL.md; protocol.py, "Handles in a join reply")."""
        if s.node is None:
            if s.alloc is None:
                raise errors.BackendError(f"job {job.name!r}: rank {s.rank}'s workspace is not known here")
            entry = {"kind": "workspace", "rank": s.rank, "size": s.alloc.size, "device": s.device}
            if job.this_node is not None:
                entry.update(node=job.this_node, fd=True, handle_type=s.alloc.handle_type)
            return entry
        remote = s.remote or {}
        if not remote.get("handle"):
            raise errors.BackendError(
                f"job {job.name!r}: rank {s.rank}'s workspace on node {s.node} has no fabric handle"
                + (f": {remote['handle_error']}" if remote.get("handle_error") else ""))
        return {"kind": "workspace", "rank": s.rank, "size": remote["size"], "device": s.device, "node": s.node,
                "fd": False, "fabric": remote["handle"], "handle_type": remote.get("handle_type")}

    def _rearm(self, job: Job, generation: int | None = None) -> None:
        """Reset every rank's flags and counters to one agreed state and bump the generation
        (to ``generation``: the one a domain's coordinator picked). Only called while no rank
        can be inside dispatch or combine (all quiesced or joining). In a job that spans nodes
        each daemon re-arms the rows it holds, all before any rank is released."""
        with self.backend.batch():
            for slot in job.slots:
                if slot.alloc is None:
                    continue  # another node's row: its daemon re-arms it
                self.backend.initialize(slot.alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=False,
                                        tail=job.tail_bytes)
        for r in range(job.ep_size):
            job.control.clear_status(r)
            job.control.set_admit_round(r, 0)
        for slot in job.slots:
            slot.readmitting = slot.readmit_wait = False
            slot.readmit_acks = set()
            slot.admit_ack = None
        self.policy.set_mask(job, L.full_mask(job.ep_size))  # every rank takes part from the first round on
        job.generation = job.control.generation = job.generation + 1 if generation is None else generation
        job.control.clear_abort()
        job.needs_rearm = False
        job.rearms += 1
        self.counters["rearms"] += 1
        self.dirty = True
        log.info("job %s: re-armed at generation %d", job.name, job.generation)

    # ------------------------------------------------------------------ recover
    def recover(self, peer: Peer, identity: bytes, rid: int, f: dict) -> None:
        """Hold this (attached, quiesced) rank until the job is re-armed with all ranks present."""
        job, slot = self.leasing.slot_for_lease(f["job"], f["ep_rank"], f["lease"])
        self.leasing.check_holder(peer, job, slot, "recover")
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
            self.fx.fail(slot.recovering, errors.StateError("superseded by a newer recover request"))
        slot.recovering = Held(identity=identity, request_id=rid, deadline=self.now + timeout)
        self.dirty = True
        self._maybe_release(job)

    # ------------------------------------------- leases and the fd socket (leases.py)
    def leave(self, peer: Peer, f: dict) -> dict:
        return self.leasing.leave(peer, f)

    def renew(self, peer: Peer, f: dict) -> dict:
        return self.leasing.renew(peer, f)

    def redeem(self, ticket, peer: Peer) -> Redeemed:
        """A ticket presented on fd.sock. A join's rank is attached at once (a replacement let
        back into a degraded job gets its bit, policy.py): the caller sends the handles only
        once the state file holds the attach (``dirty``), and then says whether they went out
        (``delivered``, ``undelivered``); ``undeliverable`` first, where other events came in
        between."""
        r = self.leasing.redeem(ticket, peer)
        if r.kind == "join" and not mutations.active("handles_before_record"):
            self._attach(r)
        return r

    def _attach(self, r: Redeemed) -> None:
        self.leasing.attach(r)
        self.policy.attached(r.job, r.slot)

    def undeliverable(self, r: Redeemed) -> errors.A2ADError | None:
        return self.leasing.undeliverable(r)

    def delivered(self, r: Redeemed, conn: object) -> None:
        """The redeem's answer went out: ``conn`` is now the rank's lease (and, under the
        ``handles_before_record`` mutation, only now is a join's rank attached)."""
        self.leasing.delivered(r, conn)
        if r.kind == "join" and not r.attached:
            self._attach(r)

    def undelivered(self, r: Redeemed, why: str) -> None:
        self.leasing.undelivered(r, why)

    def lease_closed(self, conn: object) -> None:
        self.leasing.lease_closed(conn)

    def pid_exited(self, pidfd: int) -> None:
        self.leasing.pid_exited(pidfd)

    # ------------------------------------------- the domain's calls (federation.py)
    # The federation knows a job by its name, reads it as plain data (``job_facts``,
    # ``domain_report``, ``rank_holders``, ``remote_nodes``) and changes it only through these
    # calls, which the mirror (mirror.py) carries out.
    def job_facts(self, name: str) -> JobFacts | None:
        """Job ``name``'s fixed fields and where it stands, or None when no such job is held."""
        job = self.jobs.get(name)
        return None if job is None else job.facts()

    def domain_jobs(self) -> list[str]:
        """The names of the jobs of the domain held here."""
        return [name for name, job in self.jobs.items() if job.domain and not job.freed]

    def domain_report(self, name: str, backend: str) -> dict:
        """This daemon's report of domain job ``name`` (``Job.report``)."""
        return self.jobs[name].report(backend)

    def rank_holders(self, name: str, ranks) -> dict[int, str | None]:
        """Who holds each of ``ranks`` of job ``name`` (``Job.rank_holders``): this node by its
        name, another node, or None."""
        return self.jobs[name].rank_holders(ranks, self.node_name)

    def remote_nodes(self, name: str) -> set[str]:
        """The other nodes this daemon's copy of job ``name`` places ranks on (none for a job
        not held here)."""
        job = self.jobs.get(name)
        return set() if job is None else {s.node for s in job.slots if s.node is not None}

    def apply_remote(self, name: str, node: str, ranks: dict[int, dict] | None, fields: dict | None = None,
                     why_gone: str = "", known: set[int] | None = None) -> bool:
        """``node``'s report of job ``name`` mirrored here (``Mirror.apply_remote``)."""
        return self.mirror.apply_remote(self.jobs[name], node, ranks, fields, why_gone, known)

    def domain_node_lost(self, node: str, why: str) -> None:
        """``node`` is lost: its live ranks count as dead in every domain job that places ranks on
        it (re-adopted jobs too, whose reports may never have come)."""
        for job in list(self.jobs.values()):
            if job.domain and any(s.node == node for s in job.slots):
                self.mirror.remote_node_lost(job, node, why)

    def domain_confirm(self, name: str) -> None:
        """The domain's decision on job ``name``'s spec reached this daemon and matches it."""
        job = self.jobs[name]
        if not job.confirmed:
            job.confirmed = True
            self.dirty = True

    def domain_quiesced(self, name: str) -> str | None:
        return self.mirror.domain_quiesced(self.jobs[name])

    def domain_prepare(self, name: str, generation: int, rearm: bool) -> None:
        self.mirror.domain_prepare(self.jobs[name], generation, rearm)

    def domain_release(self, name: str, generation: int, rendezvous_count: int, table: list[dict]) -> None:
        self.mirror.domain_release(self.jobs[name], generation, rendezvous_count, table)

    def domain_refuse(self, name: str, exc: errors.A2ADError, drop: bool) -> None:
        self.mirror.domain_refuse(self.jobs[name], exc, drop)

    def domain_refuse_rank(self, name: str, rank: int, exc: errors.A2ADError) -> None:
        self.mirror.domain_refuse_rank(self.jobs[name], rank, exc)

    def domain_destroy(self, name: str, why: str) -> None:
        """Another node destroyed job ``name``: freed here too."""
        self.free(self.jobs[name], why)

    # ------------------------------------------------------------ rank states
    def _mark(self, job: Job, slot: RankSlot, state: int, why: str) -> None:
        was_live = slot.state == L.RANK_ATTACHED
        job.set_rank_state(slot, state)
        self.dirty = True
        if slot.recovering is not None:
            self.fx.fail(slot.recovering, errors.PermissionDenied(f"rank {slot.rank} is {L.RANK_STATE_NAMES[state]}"))
            slot.recovering = None
        if state == L.RANK_DEAD:
            slot.deaths += 1
            self.counters["deaths"] += 1
        else:
            self.counters["detaches"] += 1
        self.policy.lose(job, slot, state, was_live, why)
        if not job.live_ranks():
            self._start_grace(job)

    def _start_grace(self, job: Job) -> None:
        job.grace_deadline = self.now + self.limits.grace
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
            self.fed.spread_destroy(job.name, f"destroyed on node {job.this_node} by request of uid {peer.uid}")
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
                    self.policy.restore_published_mask(job)
                except Exception:
                    log.exception("job %s: checking its published active mask failed", job.name)
            # who is absent is taken once, at the moment of the timeouts: a rank whose own wait
            # ends in this same pass was there, and is not named missing to the others
            absent = not_quiesced = None
            if any(h is not None and now >= h.deadline for s in job.slots for h in (s.pending, s.recovering)):
                absent = job.missing_ranks()
                not_quiesced = [s.rank for s in job.slots
                                if not s.live or (s.state == L.RANK_ATTACHED and s.recovering is None)]
            for slot in job.slots:
                if slot.ticket is not None and now >= slot.ticket_expiry:
                    kind = slot.ticket_kind
                    self.leasing.drop_ticket(slot)
                    if kind == "join" and slot.state == L.RANK_JOINING:
                        self._mark(job, slot, L.RANK_DEAD, "never redeemed its ticket")
                if slot.recovering is not None and now >= slot.recovering.deadline:
                    missing = not_quiesced
                    self.fx.fail(slot.recovering, errors.RendezvousTimeout(
                        f"job {job.name!r}: recovery timed out waiting for rank(s) {missing}", missing_ranks=missing))
                    log.warning("job %s: rank %d's recovery timed out; waiting for %s", job.name, slot.rank, missing)
                    slot.recovering = None
                if slot.pending is not None and now >= slot.pending.deadline:
                    if slot.readmit_wait:  # a replacement across nodes, held for the others' answer
                        nodes = sorted(readmit_nodes(job) - slot.readmit_acks)
                        missing = [s.rank for s in job.slots if s.node in nodes and s.live]
                        self.fx.fail(slot.pending, errors.RendezvousTimeout(
                            f"job {job.name!r}: rank {slot.rank}'s re-admission timed out waiting for node(s) "
                            f"{', '.join(nodes)} to take it back in (their live rank(s) {missing})",
                            missing_ranks=missing))
                        slot.readmit_wait = slot.readmitting = False
                        self.policy.set_mask(job, active_mask(job) & ~(1 << slot.rank))
                    else:
                        missing = absent
                        lost = sorted({s.node for s in job.slots if s.rank in missing and s.lost_with_node})
                        # every rank present, yet no re-arm: running ranks that have not quiesced
                        # (asked to recover) are what the replacement waited for
                        busy = [] if missing else [r for r in not_quiesced if r != slot.rank]
                        self.fx.fail(slot.pending, errors.RendezvousTimeout(
                            f"job {job.name!r}: rendezvous timed out waiting for rank(s) {missing or busy}"
                            + (f" (node(s) {', '.join(lost)} unreachable)" if lost else "")
                            + (" to quiesce: they run and have not asked to recover (a replacement's join waits for "
                               "the running ranks' recover)" if busy else ""),
                            missing_ranks=missing or busy))
                    log.warning("job %s: rank %d's rendezvous timed out; missing %s", job.name, slot.rank, missing)
                    slot.pending = None
                    self._reset_joining(job, slot)
                    if not job.live_ranks():
                        self._start_grace(job)
            if job.grace_deadline is not None and now >= job.grace_deadline:
                self.free(job, "grace period over")

    # --------------------------------------------------------------- teardown
    def stop(self, free_jobs: bool = False) -> list[Job]:
        """The daemon stops (SIGTERM, ``a2ad-ctl shutdown``). ``free_jobs``: every job is freed
        and its held requests end with JobDestroyed. Otherwise a job with no attached rank is
        freed without answering its held joins (they die with the daemon, as on a kill -9,
        and their clients ask the next daemon, which makes the job anew), and the others are
        kept for the next daemon. A job of a domain is kept whatever its ranks here: the other
        nodes hold this node's rows in its rendezvous table, and a job made anew would give the
        same generation other rows. Returns the kept jobs."""
        for job in list(self.jobs.values()):
            if free_jobs:
                self.free(job, "daemon shutdown with --free-jobs")
            elif not job.attached() and (not job.domain or mutations.active("domain_job_freed_on_stop")):
                self.free(job, "daemon shutdown; no rank attached", fail_held=mutations.active("held_failed_on_stop"))
        return list(self.jobs.values())

    def free(self, job: Job, why: str, fail_held: bool = True) -> None:
        """Free a job now: its ranks see ABORT_DESTROYED, held replies end with JobDestroyed,
        its memory and fd-store entries are released. ``fail_held=False`` (a daemon that stops
        with the job in its rendezvous): the held joins and recovers get no reply; they die
        with the daemon, as on a kill -9, and their clients ask the next daemon again."""
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
        left = 0
        for slot in job.slots:
            for held in (slot.pending, slot.recovering):
                if held is None:
                    continue
                if fail_held:
                    self.fx.fail(held, gone)
                else:
                    left += 1
            slot.pending = slot.recovering = None
            self.leasing.drop_ticket(slot)
            self.leasing.end_lease(slot)
            self.leasing.drop_pidfd(slot)
            if slot.alloc is not None:
                self.store.drop(ws_name(job.name, slot.rank))
                self.backend.release(slot.alloc)
                slot.alloc = None
        self.store.drop(cb_name(job.name))
        job.control.close()
        if job.control_fd >= 0:
            self.host.close_fd(job.control_fd)
            job.control_fd = -1
        log.info("job %s freed (%s)", job.name, why)
        if left:
            log.info("job %s: %d held request(s) left unanswered; their clients ask the next daemon again",
                     job.name, left)

    def release_handles(self, job: Job) -> None:
        """Close the daemon's own copies of a job's fds without freeing anything (the job lives
        on in the fd store for the next daemon)."""
        for slot in job.slots:
            self.leasing.drop_pidfd(slot)
            if slot.alloc is not None and slot.alloc.fd >= 0:
                self.host.close_fd(slot.alloc.fd)
                slot.alloc.fd = -1
        job.control.close()
        if job.control_fd >= 0:
            self.host.close_fd(job.control_fd)
            job.control_fd = -1

    # --------------------------------------------------------------- adoption
    def adopt_state(self, state: dict | None, fds: dict[str, int]) -> None:
        """Re-adopt the jobs of a previous daemon: its state file (``persist.load``) plus the
        fds its store kept (name -> fd). A record that cannot be adopted is logged and
        skipped; the others are kept. Kept fds no adopted job uses are closed and dropped."""
        used: set[str] = set()
        if state is not None and state.get("backend") != self.backend.name:
            log.error("state file is from a %s daemon; this one runs %s: not adopting", state.get("backend"), self.backend.name)
            state = None
        for rec in (state or {}).get("jobs", []):
            why = persist.check_job_record(rec)
            if why is not None:
                log.error("state file: skipping a job record: %s", why)
                continue
            try:
                self.adopt(rec, fds, used)
            except Exception as exc:
                log.error("could not re-adopt job %s: %s", rec.get("name"), exc)
        for name, fd in fds.items():
            if name not in used:
                self.host.close_fd(fd)
                self.store.drop(name)
        if self.jobs:
            names = sorted(self.jobs)
            log.info("re-adopted %d job(s): %s%s", len(names), ", ".join(names[:20]),
                     f" and {len(names) - 20} more" if len(names) > 20 else "")
        self.dirty = True

    def adopt(self, record: dict, fds: dict[str, int], used: set[str] | None = None) -> Job:
        """Take over the job a ``persist.job_record`` describes (read back by
        ``persist.job_from_record``, with the kept fds): a recorded attached rank whose
        process is alive is watched by a pidfd until it renews its lease; one that died while
        no daemon ran is a death by its job's policy; a join in progress died with the old
        daemon. The names of the fds it took are added to ``used``."""
        job = persist.job_from_record(record, fds, self.backend, self.fed.node if self.fed is not None else None,
                                      set() if used is None else used, self.host.adopt_control_block,
                                      created_at=self.now)
        seen = job.control.generation
        if seen > L.MAX_GENERATION:
            # no re-arm writes that: a client of the job (its ranks map the block writable) did
            log.error("job %s: its control block's generation %d is past any a re-arm writes; keeping the state "
                      "record's %d", job.name, seen, job.generation)
        elif seen > job.generation and not mutations.active("generation_from_record"):
            # a re-arm the state file did not hold (it could not be written, or the daemon died
            # between the re-arm and the write): its ranks run at the control block's generation,
            # and a re-arm to the record's next one would reuse a generation they ran
            log.warning("job %s: its control block is at generation %d, its state record at %d: a re-arm the "
                        "state file did not hold; taking %d", job.name, seen, job.generation, seen)
            job.generation = seen
            job.needs_rearm = False  # (what it waited for is done; a later need shows in the abort word)
        try:
            for srec, slot in zip(record["slots"], job.slots):
                if slot.node is not None:
                    continue
                state = srec["state"]
                if state == L.RANK_ATTACHED:
                    if not self.leasing.watch_pid(job, slot):
                        # died while no daemon ran: what its job's policy does with a death
                        # (raise: abort the job; degrade: clear its bit, the others serve on)
                        self.policy.rank_lost_while_away(job, slot)
                        continue
                elif state == L.RANK_JOINING:
                    state = L.RANK_EMPTY  # its join request died with the old daemon
                    slot.lease = None
                job.set_rank_state(slot, state)
        except BaseException:
            for slot in job.slots:
                self.leasing.drop_pidfd(slot)
            job.control.close()
            raise
        if job.degrade:
            # a client may have written the published mask while no daemon ran; a failure here
            # must not cost the job its adoption (the timer tick checks again)
            try:
                self.policy.restore_published_mask(job)
            except Exception:
                log.exception("job %s: checking its published active mask failed", job.name)
        if not job.live_ranks():
            job.grace_deadline = self.now + self.limits.grace
        self.jobs[job.name] = job
        return job

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
            rec["pids"] = [p for p in rec["pids"] if self.host.alive(p)]
            if rec["pids"]:
                keep.append(rec)
        self.released = keep
        return {
            "released_mapped_bytes": sum(r["bytes"] for r in keep),
            "released_mapped_processes": len({p for r in keep for p in r["pids"]}),
            "released_mapped_jobs": [{"job": r["job"], "bytes": r["bytes"], "pids": r["pids"]} for r in keep],
        }

