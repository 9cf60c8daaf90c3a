"""What losing a rank does to its job, by the job's policy (spec ``on_peer_loss``), and the
active-rank mask of a degrade job.

- raise: a death sets the abort word (the survivors leave their waits at once) and the job
  needs a job-wide re-arm; a live rank's departure makes it need one too.
- degrade: while the job serves, a lost rank's bit leaves the active mask and the others
  serve on; a replacement is let back in without stopping them (``readmit``), its bit set
  once it holds its handles; in a job that spans nodes (``readmit_across``) its admit round
  is agreed in its row and its join answered once every node with live ranks set its bit.

The active mask has one name, ``active_mask``: ``Job.active_mask`` is the value this daemon
decided (and the state file's ``active_mask``), ``ControlBlock.active_mask`` its published
copy, which the daemon puts back when a client changed it (``restore_published_mask``).
``ControlBlock.admitted_mask`` is another quantity: the ranks of the active mask already
let into the rounds.

``LossPolicy`` is one of the Registry's parts (registry.py composes them). It owns no state:
given a job, it decides its mask or its abort word and re-admissions, with the memory
backend (a replacement's row), the shared effects (effects.py) and two callbacks for the
rendezvous steps it triggers (answer a held join, reset a join that ends unanswered).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from a2ad import errors, layout as L

if TYPE_CHECKING:
    from a2ad.daemon.backends.base import Backend
    from a2ad.daemon.core.effects import Effects
    from a2ad.daemon.core.jobs import Job, RankSlot

log = logging.getLogger("a2ad")


def active_mask(job: Job, keep: bool = True) -> int:
    """The job's active mask as this daemon decided it. A job adopted from a state file that
    did not record it takes the control block's copy, bounded to its ranks (``keep``: and
    keeps it from then on)."""
    if job.active_mask is not None:
        return job.active_mask
    mask = job.control.active_mask & L.full_mask(job.ep_size)
    if keep:
        job.active_mask = mask
    return mask


def admitted_ranks(job: Job, mask: int) -> int:
    """The ranks of ``mask`` let into the rounds, as far as the daemon can tell: admit round
    in ``[0, ...]`` in the control block, or (ADMIT_ROW: let in across nodes, the round in
    the rank's row, which the daemon does not read) attached and no longer held for its
    re-admission."""
    cb = job.control
    out = cb.admitted_mask(job.ep_size, mask)
    for q in L.mask_ranks(cb.row_admit_mask(job.ep_size, mask)):
        s = job.slots[q]
        if s.state == L.RANK_ATTACHED and not s.readmit_wait:
            out |= 1 << q
    return out


def readmit_nodes(job: Job) -> set[str]:
    """The other nodes whose ranks must take a replacement back in before it is released:
    those with live ranks of the job."""
    return {s.node for s in job.slots if s.node is not None and s.live}


class LossPolicy:
    """The Registry's rank losses, re-admissions and active mask. It holds no state of its own:
    it decides on the job it is given, writes its control block and its rows (``backend``),
    and triggers two steps of the Registry's rendezvous through the callbacks it is given:
    ``release_join(job, slot, now)`` (answer a held join) and ``reset_joining(job, slot)``
    (a join that ends unanswered frees its slot)."""

    def __init__(self, fx: Effects, backend: Backend, release_join: Callable[[Job, RankSlot, float], None],
                 reset_joining: Callable[[Job, RankSlot], None]):
        self.fx = fx
        self.backend = backend
        self._release_join = release_join
        self._reset_joining = reset_joining

    def lose(self, job: Job, slot: RankSlot, state: int, was_live: bool, why: str) -> None:
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

    def readmits(self, job: Job, rank: int) -> bool:
        """Whether a join of ``rank`` is let into ``job`` while the others keep serving (a
        degrade job whose admitted ranks run on), instead of waiting for a job-wide re-arm."""
        if not job.serving_degraded or job.control.abort_word or job.recovering():
            return False
        admitted = admitted_ranks(job, active_mask(job))
        return any(s.rank != rank and s.state == L.RANK_ATTACHED and admitted >> s.rank & 1 for s in job.slots)

    def _fresh_row(self, job: Job, slot: RankSlot, admit: int) -> None:
        """A replacement's own row re-initialized and its control-block entries reset: its admit
        entry ``admit`` (ADMIT_JOINED; or ADMIT_ROW, the row's admit word then ADMIT_JOINED),
        its status and input records cleared. A failure ends its join (the error is the reply)."""
        words = {job.aux.block_counters + 4 * L.SLOT_ADMIT_ROUND: L.ADMIT_JOINED} if admit == L.ADMIT_ROW else None
        try:
            self.backend.initialize(slot.alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND, fresh=False,
                                    words=words, tail=job.tail_bytes)
        except BaseException:
            slot.pending = None  # the error is this join's reply
            self._reset_joining(job, slot)
            raise
        job.control.set_admit_round(slot.rank, admit)
        job.control.clear_status(slot.rank)
        job.control.clear_input_error(slot.rank)

    def readmit(self, job: Job, slot: RankSlot) -> None:
        """Release a replacement's join at once, without the others (the degrade path of a
        re-arm): only its own row is re-initialized, and its admit round says it has not
        dispatched yet. Its bit is set when it holds its handles (``delivered``); its first
        dispatch asks to be let in and the lowest active rank picks the round
        (docs/PROTOCOL.md, "Degraded mode")."""
        self._fresh_row(job, slot, L.ADMIT_JOINED)
        slot.readmitting = True
        self._release_join(job, slot, self.fx.now)
        self.fx.dirty = True
        log.info("job %s: rank %d let back in without stopping the others (row re-initialized); "
                 "its first dispatch joins the rounds", job.name, slot.rank)

    def readmit_across(self, job: Job, slot: RankSlot) -> None:
        """A replacement let back into a degrade job that spans nodes, without stopping the
        others: its own row re-initialized with its row admit word ADMIT_JOINED, its admit
        entry ADMIT_ROW (every node's ranks then read and write its admit round in its row,
        where all of them reach it) and its bit set here; its join is held until every
        other node with live ranks of the job has done the same for it (their reports list
        it in ``admits``: ``take_readmit_acks``), so that no node's ranks can leave it out of a
        round the lowest active rank lets it into (docs/DOMAIN.md, "Failure")."""
        self._fresh_row(job, slot, L.ADMIT_ROW)
        self.set_mask(job, active_mask(job) | 1 << slot.rank)
        slot.readmitting = slot.readmit_wait = True
        slot.readmit_acks = set()
        self.fx.dirty = True
        log.info("job %s: rank %d let back in without stopping the others (row re-initialized); its join "
                 "is answered once node(s) %s have taken it back in", job.name, slot.rank,
                 ", ".join(sorted(readmit_nodes(job))) or "(none)")
        self.check_readmits(job)

    def take_readmit_acks(self, job: Job, node: str, admits) -> None:
        """``node``'s report lists the re-admissions it applied (``[rank, deaths]`` pairs):
        those of a replacement held here count as that node's answer."""
        for pair in admits or ():
            r, deaths = pair
            if 0 <= r < job.ep_size:
                s = job.slots[r]
                if s.node is None and s.readmit_wait and s.deaths == deaths:
                    s.readmit_acks.add(node)

    def check_readmits(self, job: Job) -> None:
        """Answer the held joins of replacements (``readmit_across``) that every other node
        with live ranks has taken back in."""
        waiting = [s for s in job.slots if s.node is None and s.readmit_wait and s.pending is not None]
        if not waiting:
            return
        need = readmit_nodes(job)
        now = self.fx.now
        for s in waiting:
            if need <= s.readmit_acks:
                s.readmit_wait = False
                self.fx.dirty = True
                try:
                    self._release_join(job, s, now)
                except errors.A2ADError as exc:  # (a row's handle missing): this join fails, nothing else
                    self.fx.fail(s.pending, exc)
                    s.pending = None
                    self._reset_joining(job, s)
                    continue
                log.info("job %s: rank %d's join answered: every node with live ranks took it back in", job.name, s.rank)

    def apply_readmit(self, job: Job, slot: RankSlot, deaths: int) -> None:
        """Another node let ``slot``'s rank back in without a job-wide re-arm (its report says
        ``readmit``): its admit entry ADMIT_ROW, then its bit, here too; this node's reports
        then list it in ``admits``, the answer that node waits for."""
        if slot.admit_ack == deaths:
            return
        if not job.serving_degraded or job.control.abort_word:
            return  # the job goes through a re-arm, which lets that rank in with everyone
        job.control.set_admit_round(slot.rank, L.ADMIT_ROW)
        self.set_mask(job, active_mask(job) | 1 << slot.rank)
        slot.admit_ack = deaths
        self.fx.dirty = True
        log.info("job %s: rank %d on node %s let back in there: taken back in here too (mask generation %d)",
                 job.name, slot.rank, slot.node, job.control.mask_generation)

    def set_mask(self, job: Job, mask: int) -> bool:
        """Decide the job's active mask, keep it and publish it; whether it changed."""
        mask &= L.full_mask(job.ep_size)
        changed = mask != job.active_mask
        job.active_mask = mask
        job.control.set_active_mask(mask, job.ep_size, int(self.fx.now * 1e9))
        if changed:
            self.fx.dirty = True
        return changed

    def restore_published_mask(self, job: Job) -> None:
        """Put the daemon's mask back when the control block's copy was changed by someone
        else (only the daemon writes it)."""
        if job.active_mask is None or job.freed or job.control is None or getattr(job.control, "_mv", None) is None:
            return
        seen = job.control.active_mask
        if seen == job.active_mask:
            return
        job.control.set_active_mask(job.active_mask, job.ep_size, int(self.fx.now * 1e9))
        job.mask_restores += 1
        self.fx.counters["mask_restores"] += 1
        if job.mask_restores == 1 or job.mask_restores % 100 == 0:
            log.warning("job %s: its control block's active mask was changed to %#x by something other than this "
                        "daemon (a client writing the control block); put back %#x (%d time(s) so far)",
                        job.name, seen, job.active_mask, job.mask_restores)

    def _drop_rank(self, job: Job, slot: RankSlot, why: str) -> None:
        """A rank of a degrade job that serves died or left: clear its bit (the others stop
        waiting for it and drop its tokens); no abort. When no admitted rank is left, nobody
        can let a replacement in: the job then needs a job-wide re-arm, and ranks still
        holding it (replacements waiting to be let in) are told through the abort word."""
        cb = job.control
        slot.readmitting = slot.readmit_wait = False
        if self.set_mask(job, active_mask(job) & ~(1 << slot.rank)):
            log.warning("job %s: rank %d (pid %s) %s; the job serves on with ranks %s (mask generation %d)",
                        job.name, slot.rank, slot.pid, why, L.format_ranks(admitted_ranks(job, job.active_mask)),
                        cb.mask_generation)
        else:
            log.warning("job %s: rank %d (pid %s) %s", job.name, slot.rank, slot.pid, why)
        self.check_readmits(job)  # a replacement held for that node's answer needs it no more
        if not admitted_ranks(job, job.active_mask):
            job.needs_rearm = True
            if any(s.live for s in job.slots if s is not slot) and not cb.abort_word:
                cb.set_abort(L.ABORT_PEER_LOST, slot.rank)
            log.warning("job %s: no active rank is left; the next rendezvous re-arms every rank", job.name)

    def attached(self, job: Job, slot: RankSlot) -> None:
        """``slot``'s rank holds its handles now (``Leases.delivered``): a replacement let back
        into a degraded job (``readmit``) gets its bit back (its admit round still keeps it out
        of every round until its first dispatch is let in)."""
        if not slot.readmitting:
            return
        slot.readmitting = False
        if job.serving_degraded and not job.control.abort_word:
            self.set_mask(job, active_mask(job) | 1 << slot.rank)
            job.readmits += 1
            self.fx.counters["readmits"] += 1
            log.info("job %s: rank %d is active again (mask generation %d)", job.name, slot.rank,
                     job.control.mask_generation)

    def rank_lost_while_away(self, job: Job, slot: RankSlot) -> None:
        """A rank found dead when its job is adopted (it died while no daemon ran): marked as
        a death of that job's policy would be (the raise policy aborts the job, the degrade
        policy clears the rank's bit)."""
        slot.deaths += 1
        job.set_rank_state(slot, L.RANK_DEAD)
        if job.serving_degraded:
            self._drop_rank(job, slot, "died while no daemon ran")
        else:
            job.needs_rearm = True
            job.control.set_abort(L.ABORT_PEER_LOST, slot.rank)
