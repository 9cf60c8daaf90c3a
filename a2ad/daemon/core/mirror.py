"""This daemon's mirror of other nodes' ranks, in the jobs of a domain that span nodes
(federation.py carries the messages; this module is what they do to the registry).

A slot whose ``node`` names another node mirrors that node's reports (``apply_remote``):
its state, held request, pid, device and its row's fabric handle. A state change goes
through the job's loss policy as a local one does (policy.py); a lost node's live ranks
count as dead (``remote_node_lost``). A job's rendezvous and re-arms are decided by its
coordinator in two steps, ``domain_prepare`` (re-arm this daemon's rows) and
``domain_release`` (answer the joins and recovers held here); ``domain_refuse`` and
``domain_refuse_rank`` end joins the domain refused.

``Mirror`` is one of the Registry's parts (registry.py composes them). It owns no state of its
own (a remote rank's mirror lives in its slot); it is given the fd store and the memory
backend (a refused rank's row goes), the shared effects (effects.py), the job's loss policy
(policy.py: what a remote rank's loss does; re-admissions across nodes) and the Registry's
steps it triggers: ``release_join``, ``reset_joining``, ``rearm``, ``start_grace``, ``free``
and ``rendezvous_done`` (a rendezvous counted: its latency).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from a2ad import errors, layout as L, mutations
from a2ad.daemon.core.names import ws_name
from a2ad.daemon.core.policy import LossPolicy, active_mask

if TYPE_CHECKING:
    from a2ad.daemon.backends.base import Backend
    from a2ad.daemon.core.effects import Effects
    from a2ad.daemon.core.jobs import Job, RankSlot
    from a2ad.daemon.core.ports import Store

log = logging.getLogger("a2ad")


class Mirror:
    """The Registry's copy of other nodes' ranks and its steps of a domain rendezvous."""

    def __init__(self, fx: Effects, store: Store, backend: Backend, policy: LossPolicy, *,
                 release_join: Callable[[Job, RankSlot, float], None],
                 reset_joining: Callable[[Job, RankSlot], None],
                 rearm: Callable[[Job, int], None],
                 start_grace: Callable[[Job], None],
                 free: Callable[[Job, str], None],
                 rendezvous_done: Callable[[float], None]):
        self.fx = fx
        self.store = store
        self.backend = backend
        self.policy = policy
        self._release_join = release_join
        self._reset_joining = reset_joining
        self._rearm = rearm
        self._start_grace = start_grace
        self._free = free
        self._rendezvous_done = rendezvous_done

    def apply_remote(self, job: Job, node: str, ranks: dict[int, dict] | None, fields: dict | None = None,
                     why_gone: str = "", known: set[int] | None = None) -> bool:
        """Mirror what ``node`` reports about ``job`` (federation.py): ``ranks`` maps every
        rank whose row that node holds to its record (state, held request, pid, device,
        row); None or a missing rank: the node holds it no more. ``fields``: the node's
        job-wide fields (generation, abort word, needs_rearm), of which an abort word or a
        re-arm need of the same generation is taken over. State changes go through the
        job's policy as local ones do (``_lose``), unless the report is of an older
        generation than this daemon's copy (it reached here after the re-arm that dealt with
        what it says: the mirror follows it, nothing more). ``known``: the ranks of that node's
        previous report (only they can have gone; None: every slot is looked at). Returns
        whether a slot was let go of (another node's report may hold it then)."""
        ranks = ranks or {}
        effects = fields is None or fields.get("generation", 0) >= job.generation
        cleared = False
        maybe_gone = job.slots if known is None else [job.slots[r] for r in known - ranks.keys() if 0 <= r < job.ep_size]
        for slot in maybe_gone:
            if slot.node == node and slot.rank not in ranks:
                if slot.live:
                    slot.remote_waiting = None
                    self._remote_state(job, slot, L.RANK_DEAD, why_gone or f"node {node} no longer holds it")
                slot.clear_remote()
                self.fx.dirty = cleared = True
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
                self.fx.dirty = True
            state = rec["state"]
            readmit = bool(rec.get("readmit")) and effects and state in (L.RANK_JOINING, L.RANK_ATTACHED)
            # a replacement its node let in and answered at once, before any report said
            # readmit: no other node had live ranks of the job to wait for (this one had none
            # then). Reported joining or attached while this node counts the rank gone and
            # the job serves degraded here (a new process or a new attach: not the same one
            # counted gone by mistake), it is let back in here too once attached, or this
            # node's ranks would serve without it when they come back
            # (or the same process joining again after its node itself reported it gone: a
            # replacement whose first handles were not delivered)
            reported_gone = slot.reported in (L.RANK_DEAD, L.RANK_LEFT) \
                and not mutations.active("rejoin_after_undelivered_unseen")
            slot.reported = state
            if effects and job.serving_degraded and slot.state in (L.RANK_DEAD, L.RANK_LEFT) \
                    and state in (L.RANK_JOINING, L.RANK_ATTACHED) \
                    and (slot.pid != before[1] or slot.attaches > before[4] or reported_gone):
                slot.replaced = True
            elif state not in (L.RANK_JOINING, L.RANK_ATTACHED):
                slot.replaced = False
            came_back = slot.replaced and state == L.RANK_ATTACHED \
                and not mutations.active("readmit_unseen_by_rankless_node")
            if came_back:
                slot.replaced = False
            if slot.readmit_wait and not rec.get("readmit") and state == L.RANK_JOINING and slot.state == state:
                # its node answered the replacement's held join (every node took it back in): it
                # counts as attached, as a domain release makes it (its attach is no news here)
                state = L.RANK_ATTACHED
                slot.answered = (slot.pid, slot.deaths, slot.attaches)
            elif state == L.RANK_JOINING and slot.state == L.RANK_ATTACHED and not rec.get("readmit") \
                    and slot.remote_waiting is None and slot.answered == (slot.pid, slot.deaths, slot.attaches):
                # the same answered join, still reported joining: its node's report from before
                # the rank took its handles, sent here for news of another rank. It stays
                # attached: the report that says attached is no news here and never comes
                state = L.RANK_ATTACHED
            elif rec["state"] != L.RANK_JOINING:
                slot.answered = None
            slot.readmit_wait = bool(rec.get("readmit"))
            if slot.lost_with_node and readmit:
                slot.lost_with_node = False  # it died with its node; this is its replacement
            # a report that says joining is its node's from before the rank attached (the node
            # stalled before it sent the next one, which its resync sends now): the next decides
            old_bug = mutations.active("rearm_lost_to_joining_report")
            if slot.lost_with_node and (old_bug or not (state == L.RANK_JOINING and effects)):
                slot.lost_with_node = False
                if effects and state == L.RANK_ATTACHED and slot.state in (
                        (L.RANK_DEAD,) if old_bug else (L.RANK_DEAD, L.RANK_JOINING)):
                    # counted lost with its node, yet alive: the job's rounds cannot agree any
                    # more (the others dropped or aborted it): everyone goes through a re-arm
                    job.needs_rearm = self.fx.dirty = True
                    if not job.control.abort_word:
                        # (naming no rank: an abort word naming another node's rank is no news
                        # for the other holders, and that node, which never counted itself
                        # lost, must hear it)
                        job.control.set_abort(L.ABORT_REARM, -1)
                    log.warning("job %s: rank %d on node %s, counted lost with its node, is alive: the job re-arms",
                                job.name, r, node)
            if state != slot.state:
                self._remote_state(job, slot, state, f"(as node {node} reports)", effects)
            if readmit or came_back:
                # its node let it back in without a job-wide re-arm: here too
                self.policy.apply_readmit(job, slot, slot.deaths)
            elif slot.admit_ack is not None and not slot.live:
                # that replacement is gone (a later one comes with its own): a death cleared its
                # bit already, a held join that timed out takes it away here
                slot.admit_ack = None
                if job.serving_degraded:
                    self.policy.set_mask(job, active_mask(job) & ~(1 << r))
                self.fx.dirty = True
        if fields is not None and fields.get("admits"):
            self.policy.take_readmit_acks(job, node, fields["admits"])
        self.policy.check_readmits(job)
        if fields is not None and fields.get("generation") == job.generation:
            word = fields.get("abort", 0)
            if word and word != L.ABORT_DESTROYED and not job.control.abort_word:
                job.control.set_abort(word, fields.get("abort_rank", -1))
                job.needs_rearm = True
                self.fx.dirty = True
                log.warning("job %s: %s on node %s (rank %s): this node's ranks are told too", job.name,
                            L.ABORT_NAMES.get(word, f"abort {word}"), node, fields.get("abort_rank"))
            if fields.get("needs_rearm") and not job.needs_rearm and job.rendezvous_count > 0:
                job.needs_rearm = True
                self.fx.dirty = True
        if job.grace_deadline is not None:
            if job.live_ranks():
                job.grace_deadline = None
                self.fx.dirty = True
        elif not any(s.live for s in job.slots):
            self._start_grace(job)
        return cleared

    def _remote_state(self, job: Job, slot: RankSlot, state: int, why: str, effects: bool = True) -> None:
        old = slot.state
        job.set_rank_state(slot, state)
        self.fx.dirty = True
        if state == L.RANK_JOINING:
            job.last_join_seen = self.fx.now
            job.grace_deadline = None
        elif effects and state in (L.RANK_DEAD, L.RANK_LEFT) and old in (L.RANK_JOINING, L.RANK_ATTACHED):
            self.policy.lose(job, slot, state, old == L.RANK_ATTACHED,
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
        self.fx.dirty = True

    def domain_release(self, job: Job, generation: int, rendezvous_count: int, table: list[dict]) -> None:
        """The second step: every node has prepared; release this daemon's held joins (with
        every row's handle) and recovers together."""
        for rec in table:
            r, node = rec.get("rank"), rec.get("node")
            if not (isinstance(r, int) and 0 <= r < job.ep_size) or node == job.this_node:
                continue
            slot = job.slots[r]
            if slot.node is None and slot.alloc is None and not slot.live:
                slot.node = node  # the release came before that node's report of the rank
                job.set_rank_state(slot, L.RANK_JOINING)
            if slot.node == node:
                slot.remote = dict(slot.remote or {}, size=rec.get("size"), handle=rec.get("handle"),
                                   handle_type=rec.get("handle_type"))
                slot.device = rec.get("device")
                if rec.get("pid") is not None:
                    slot.pid = rec["pid"]
                # released with the others by its own daemon: its node reports it only when that
                # is news for every holder (federation.Federation._peer_key)
                slot.remote_waiting = None
                slot.replaced = False  # let in with every rank of the job
                if slot.state == L.RANK_JOINING:
                    slot.answered = (slot.pid, slot.deaths, slot.attaches)
                    job.set_rank_state(slot, L.RANK_ATTACHED)
                    slot.attaches += 1
        now = self.fx.now
        for slot in job.recovering():
            self.fx.reply(slot.recovering, {"generation": job.generation})
            slot.recovering = None
        self.fx.dirty = True
        pending = job.pending()
        if not pending:
            log.info("job %s: all %d ranks resumed at generation %d", job.name, job.ep_size, job.generation)
            return
        latency = now - (job.last_join_seen or now)
        for slot in pending:
            try:
                self._release_join(job, slot, now)
            except errors.A2ADError as exc:
                self.fx.fail(slot.pending, exc)
                slot.pending = None
                self._reset_joining(job, slot)
        job.rendezvous_started = None
        job.rendezvous_count = max(job.rendezvous_count + 1, rendezvous_count)
        self._rendezvous_done(latency)
        log.info("job %s: domain rendezvous done (%d ranks, %d here, generation %d, %.3f ms after the last join "
                 "this daemon saw)", job.name, job.ep_size, len(pending), generation, latency * 1e3)

    def domain_refuse(self, job: Job, exc: errors.A2ADError, drop: bool) -> None:
        """The domain refused the job (a spec mismatch, rows without fabric handles): every join
        of it held here hears ``exc``; with ``drop`` (this daemon's tentative job lost to
        another spec) the job goes once no local rank holds it."""
        for slot in job.pending():
            self.fx.fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
            log.warning("job %s: rank %d's join refused by the domain: %s", job.name, slot.rank, exc.message)
        if drop and not any(s.live for s in job.slots if s.node is None):
            self._free(job, "its spec lost to the domain's")
        elif not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)

    def domain_refuse_rank(self, job: Job, rank: int, exc: errors.A2ADError) -> None:
        """Another node holds ``rank``: this daemon's join of it is refused and its row freed."""
        slot = job.slots[rank]
        if slot.node is not None:
            return
        if slot.pending is not None:
            self.fx.fail(slot.pending, exc)
            slot.pending = None
            self._reset_joining(job, slot)
        if not slot.live and slot.alloc is not None:
            self.store.drop(ws_name(job.name, rank))
            self.backend.release(slot.alloc)
            slot.alloc = None
            job.set_rank_state(slot, L.RANK_EMPTY)
        self.fx.dirty = True
        if not job.live_ranks() and job.grace_deadline is None:
            self._start_grace(job)
