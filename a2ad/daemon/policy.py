"""What losing a rank does to its job, by the job's policy (spec ``on_peer_loss``), and the
active-rank mask of a degrade job.

- raise: a death sets the abort word (the survivors leave their waits at once) and the job
  needs a job-wide re-arm; a live rank's departure makes it need one too.
- degrade: while the job serves, a lost rank's bit leaves the active mask and the others
  serve on; a replacement is let back in without stopping them (``_readmit``), its bit set
  once it holds its handles.

The active mask has one name, ``active_mask``: ``Job.active_mask`` is the value this daemon
decided (and the state file's ``active_mask``), ``ControlBlock.active_mask`` its published
copy, which the daemon puts back when a client changed it (``restore_published_mask``).
``ControlBlock.admitted_mask`` is another quantity: the ranks of the active mask already
let into the rounds.

``LossPolicy`` is a part of the Registry (registry.py); it uses the registry's ``backend``,
``counters``, ``dirty`` and its rendezvous steps (``_release_join``, ``_reset_joining``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from a2ad import layout as L

if TYPE_CHECKING:
    from a2ad.daemon.jobs import Job, RankSlot

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


class LossPolicy:
    """The Registry's rank losses, re-admissions and active mask."""

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

    def _readmits(self, job: Job, rank: int) -> bool:
        """Whether a join of ``rank`` is let into ``job`` while the others keep serving (a
        degrade job whose admitted ranks run on), instead of waiting for a job-wide re-arm."""
        if not job.serving_degraded or job.control.abort_word or job.recovering() or job.spans:
            return False
        admitted = job.control.admitted_mask(job.ep_size, active_mask(job))
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

    def _set_mask(self, job: Job, mask: int) -> bool:
        """Decide the job's active mask, keep it and publish it; whether it changed."""
        mask &= L.full_mask(job.ep_size)
        changed = mask != job.active_mask
        job.active_mask = mask
        job.control.set_active_mask(mask, job.ep_size, time.monotonic_ns())
        if changed:
            self.dirty = True
        return changed

    def restore_published_mask(self, job: Job) -> None:
        """Put the daemon's mask back when the control block's copy was changed by someone
        else (only the daemon writes it)."""
        if job.active_mask is None or job.freed or job.control is None or getattr(job.control, "_mv", None) is None:
            return
        seen = job.control.active_mask
        if seen == job.active_mask:
            return
        job.control.set_active_mask(job.active_mask, job.ep_size, time.monotonic_ns())
        job.mask_restores += 1
        self.counters["mask_restores"] += 1
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
        slot.readmitting = False
        if self._set_mask(job, active_mask(job) & ~(1 << slot.rank)):
            log.warning("job %s: rank %d (pid %s) %s; the job serves on with ranks %s (mask generation %d)",
                        job.name, slot.rank, slot.pid, why, L.format_ranks(cb.admitted_mask(job.ep_size, job.active_mask)),
                        cb.mask_generation)
        else:
            log.warning("job %s: rank %d (pid %s) %s", job.name, slot.rank, slot.pid, why)
        if not cb.admitted_mask(job.ep_size, job.active_mask):
            job.needs_rearm = True
            if any(s.live for s in job.slots if s is not slot) and not cb.abort_word:
                cb.set_abort(L.ABORT_PEER_LOST, slot.rank)
            log.warning("job %s: no active rank is left; the next rendezvous re-arms every rank", job.name)

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
