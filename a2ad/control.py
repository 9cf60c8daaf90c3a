"""Typed access to a job's control block (layout in a2ad/layout.py).

The block is shared host memory: the daemon maps it read-write to publish the
generation, abort word and rank states; every client maps it to read those and
to write its own status record. On the CUDA backend the clients also register
it for GPU access so that kernels read the abort word and write status records.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from dataclasses import dataclass

from . import errors, layout as L

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_MASK = struct.Struct(f"<{L.MASK_WORDS}Q")


@dataclass(frozen=True)
class StatusRecord:
    code: int
    peer: int
    round: int
    phase: int
    waited_ns: int

    @property
    def phase_name(self) -> str:
        return L.PHASE_NAMES.get(self.phase, f"phase{self.phase}")


_ABORT_WORD = L.CB_ABORT >> 2
_STATUS_WORD = [(L.status_offset(r) + L.STATUS_CODE) >> 2 for r in range(L.MAX_EP_SIZE)]
_INPUT_WORD = [(L.input_offset(r) + L.INPUT_CODE) >> 2 for r in range(L.MAX_EP_SIZE)]


class ControlBlock:
    """A view of one job's control block over any writable buffer of CONTROL_BLOCK_SIZE bytes."""

    def __init__(self, buf, owner=None):
        self._mv = memoryview(buf).cast("B")
        if len(self._mv) < L.CONTROL_BLOCK_SIZE:
            raise ValueError(f"control block needs {L.CONTROL_BLOCK_SIZE} bytes, got {len(self._mv)}")
        #: the block as u32 words, for the cheap checks made on every data-plane call
        self._words = self._mv[: L.CONTROL_BLOCK_SIZE].cast("I")
        self._owner = owner  # keeps the mmap alive

    @classmethod
    def map_fd(cls, fd: int) -> "ControlBlock":
        mm = mmap.mmap(fd, L.CONTROL_BLOCK_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(mm, owner=mm)

    def address(self) -> int:
        """Host address of the block (for cudaHostRegister and kernel arguments)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mv))

    def close(self) -> None:
        words, self._words = getattr(self, "_words", None), None
        if words is not None:
            words.release()
        mv, self._mv = self._mv, None
        if mv is not None:
            mv.release()
        if self._owner is not None:
            try:
                self._owner.close()
            except BufferError:
                pass  # another view (e.g. a registered pointer's buffer) still holds it
            self._owner = None

    def quiet(self, rank: int) -> bool:
        """True when nothing is to be raised for ``rank``: no abort, no failed wait, no input
        error. Three word reads: what every data-plane call checks first."""
        w = self._words
        return w[_ABORT_WORD] == 0 and w[_STATUS_WORD[rank]] == 0 and w[_INPUT_WORD[rank]] == 0

    def failed(self, rank: int) -> bool:
        """True when the job was aborted or ``rank``'s last wait failed (raise_for raises)."""
        w = self._words
        return w[L.CB_ABORT >> 2] != 0 or w[(L.status_offset(rank) + L.STATUS_CODE) >> 2] != 0

    # --- raw fields ---------------------------------------------------------
    def _get(self, st: struct.Struct, off: int) -> int:
        return st.unpack_from(self._mv, off)[0]

    def _set(self, st: struct.Struct, off: int, value: int) -> None:
        st.pack_into(self._mv, off, value)

    def initialize(self, ep_size: int, policy: int = L.POLICY_RAISE) -> None:
        self._mv[:L.CONTROL_BLOCK_SIZE] = bytes(L.CONTROL_BLOCK_SIZE)
        self._set(_U32, L.CB_VERSION, L.CONTROL_VERSION)
        self._set(_U32, L.CB_EP_SIZE, ep_size)
        self._set(_I32, L.CB_ABORT_RANK, -1)
        self._set(_U32, L.CB_POLICY, policy)
        _MASK.pack_into(self._mv, L.CB_ACTIVE_MASK, *L.mask_words(L.full_mask(ep_size)))
        self._set(_U32, L.CB_MAGIC, L.CONTROL_MAGIC)

    @property
    def valid(self) -> bool:
        return self._get(_U32, L.CB_MAGIC) == L.CONTROL_MAGIC and self._get(_U32, L.CB_VERSION) == L.CONTROL_VERSION

    @property
    def version(self) -> int:
        """The layout version the block was written with (CB_VERSION)."""
        return self._get(_U32, L.CB_VERSION)

    @property
    def ep_size(self) -> int:
        return self._get(_U32, L.CB_EP_SIZE)

    @property
    def generation(self) -> int:
        return self._get(_U64, L.CB_GENERATION)

    @generation.setter
    def generation(self, value: int) -> None:
        self._set(_U64, L.CB_GENERATION, value)

    @property
    def abort_word(self) -> int:
        return self._get(_U32, L.CB_ABORT)

    @property
    def abort_rank(self) -> int:
        return self._get(_I32, L.CB_ABORT_RANK)

    def set_abort(self, reason: int, rank: int = -1) -> None:
        # rank first, so a reader that sees the abort word sees its rank (x86-64 TSO)
        self._set(_I32, L.CB_ABORT_RANK, rank)
        self._set(_U32, L.CB_ABORT, reason)

    def clear_abort(self) -> None:
        self._set(_U32, L.CB_ABORT, L.ABORT_NONE)
        self._set(_I32, L.CB_ABORT_RANK, -1)

    # --- degraded mode (layout.py, "Control block"; docs/PROTOCOL.md, "Degraded mode") ----
    @property
    def policy(self) -> int:
        """POLICY_RAISE or POLICY_DEGRADE (the job's on_peer_loss)."""
        return self._get(_U32, L.CB_POLICY)

    @property
    def degrade(self) -> bool:
        return self._get(_U32, L.CB_POLICY) == L.POLICY_DEGRADE

    @property
    def active_mask(self) -> int:
        """Bit q set: the daemon counts rank q as a live member of the job (all MASK_WORDS
        words read, least significant first)."""
        return L.mask_from_words(_MASK.unpack_from(self._mv, L.CB_ACTIVE_MASK))

    def active_word(self, word: int) -> int:
        """Word ``word`` of the active mask alone (ranks 64 * word .. 64 * word + 63): what a
        reader needing one rank's bit reads."""
        if not 0 <= word < L.MASK_WORDS:
            raise ValueError(f"mask word must be in [0, {L.MASK_WORDS}), got {word}")
        return self._get(_U64, L.CB_ACTIVE_MASK + 8 * word)

    def rank_active(self, rank: int) -> bool:
        """Whether bit ``rank`` of the active mask is set (reads word rank >> 6 only)."""
        return bool(self.active_word(rank >> 6) >> (rank & 63) & 1)

    @property
    def mask_generation(self) -> int:
        return self._get(_U64, L.CB_MASK_GENERATION)

    @property
    def degraded_since_ns(self) -> int:
        """CLOCK_MONOTONIC ns at which the mask lost its first bit; 0 while it is full."""
        return self._get(_U64, L.CB_DEGRADED_SINCE_NS)

    def set_active_mask(self, mask: int, ep_size: int, now_ns: int) -> bool:
        """Publish a new active mask (the daemon): the mask first, then its generation, so a
        reader that sees the new generation sees the new mask; the degraded-since time starts
        when the mask loses its first bit and is 0 again once it is full. Only the words that
        change are written (a reader may see them torn, which equals seeing the bits change
        one at a time). Returns whether the mask changed."""
        new_words = L.mask_words(mask)
        old = self.active_mask
        if mask == old:
            return False
        full = L.full_mask(ep_size)
        if mask == full:
            self._set(_U64, L.CB_DEGRADED_SINCE_NS, 0)
        elif old == full or self.degraded_since_ns == 0:
            self._set(_U64, L.CB_DEGRADED_SINCE_NS, max(1, now_ns))
        for i, (w_old, w_new) in enumerate(zip(L.mask_words(old), new_words)):
            if w_old != w_new:
                self._set(_U64, L.CB_ACTIVE_MASK + 8 * i, w_new)
        self._set(_U64, L.CB_MASK_GENERATION, self.mask_generation + 1)
        return True

    def admit_round(self, rank: int) -> int:
        return self._get(_I32, L.admit_offset(rank))

    def set_admit_round(self, rank: int, value: int) -> None:
        self._set(_I32, L.admit_offset(rank), value)

    def admit_rounds(self, ep_size: int) -> tuple[int, ...]:
        return struct.unpack_from(f"<{ep_size}i", self._mv, L.CB_ADMIT_ROUND)

    def effective_mask(self, ep_size: int, round: int, rows=None) -> int:
        """The ranks that take part in round ``round`` (layout.effective_mask): the active mask
        read first, then the admit rounds (x86-64 keeps the two loads in that order, and the
        daemon writes a replacement's admit round before its bit). ``rows``: indexable by
        rank, each rank's row admit word (``SLOT_ADMIT_ROUND``), which an ADMIT_ROW entry
        stands for; without it (the daemon) such a rank takes part in no round."""
        mask = self.active_mask
        return L.effective_mask(mask, self.admit_rounds(ep_size), round, rows)

    def admit_of(self, rank: int, rows=None) -> int:
        """Rank ``rank``'s admit round: its entry here, or its row's word (``rows[rank]``) where
        the entry is ADMIT_ROW and ``rows`` is given."""
        a = self.admit_round(rank)
        if a == L.ADMIT_ROW and rows is not None:
            a = int(rows[rank])
        return a

    def first_effective(self, mask: int, round: int, rows=None) -> int:
        """The lowest rank of ``mask`` that takes part in round ``round`` (its bit set, then
        its admit round in ``[0, round]``, read in that order as :meth:`effective_mask`
        reads them), or -1: what a wait needs, reading only the words of the ranks it checks."""
        while mask:
            low = mask & -mask
            q = low.bit_length() - 1
            if self.rank_active(q) and 0 <= self.admit_of(q, rows) <= round:
                return q
            mask ^= low
        return -1

    def admitted_mask(self, ep_size: int, mask: int | None = None, rows=None) -> int:
        """The ranks active now and admitted to some round (a replacement that waits for its
        first round is not counted; nor, without ``rows``, a rank whose admit round is in its
        row). ``mask``: the active mask to start from (the daemon passes its own record;
        default: the published copy)."""
        if mask is None:
            mask = self.active_mask
        rounds = self.admit_rounds(ep_size)
        out = 0
        for q in L.mask_ranks(mask):
            if q >= ep_size:
                continue
            a = rounds[q]
            if a == L.ADMIT_ROW and rows is not None:
                a = int(rows[q])
            if a >= 0:
                out |= 1 << q
        return out

    def row_admit_mask(self, ep_size: int, mask: int | None = None) -> int:
        """The ranks of ``mask`` (default: the published active mask) whose admit round is in
        their rows (ADMIT_ROW: let into a job that spans nodes without a job-wide re-arm)."""
        if mask is None:
            mask = self.active_mask
        rounds = self.admit_rounds(ep_size)
        return sum(1 << q for q in L.mask_ranks(mask) if q < ep_size and rounds[q] == L.ADMIT_ROW)

    def rank_state(self, rank: int) -> int:
        return self._get(_U32, L.CB_RANK_STATE + 4 * rank)

    def set_rank_state(self, rank: int, state: int) -> None:
        self._set(_U32, L.CB_RANK_STATE + 4 * rank, state)

    # --- status records -------------------------------------------------------
    def status(self, rank: int) -> StatusRecord:
        off = L.status_offset(rank)
        return StatusRecord(
            code=self._get(_U32, off + L.STATUS_CODE),
            peer=self._get(_I32, off + L.STATUS_PEER),
            round=self._get(_U32, off + L.STATUS_ROUND),
            phase=self._get(_U32, off + L.STATUS_PHASE),
            waited_ns=self._get(_U64, off + L.STATUS_WAITED_NS),
        )

    def record_status(self, rank: int, code: int, peer: int, round: int, phase: int, waited_ns: int) -> None:
        off = L.status_offset(rank)
        self._set(_I32, off + L.STATUS_PEER, peer)
        self._set(_U32, off + L.STATUS_ROUND, round & 0xFFFFFFFF)
        self._set(_U32, off + L.STATUS_PHASE, phase)
        self._set(_U64, off + L.STATUS_WAITED_NS, waited_ns)
        self._set(_U32, off + L.STATUS_CODE, code)

    def clear_status(self, rank: int) -> None:
        off = L.status_offset(rank)
        self._mv[off : off + L.STATUS_RECORD_SIZE] = bytes(L.STATUS_RECORD_SIZE)

    # --- input records -------------------------------------------------------
    def raise_input_error(self, rank: int, job: str = "?", num_experts: int | None = None) -> None:
        """Raise InputError for what ``rank``'s kernels found wrong in its input (an expert id
        out of range, a runtime_max_tokens_per_rank that differs from a peer's), then clear
        the record: the round it happened in completed for every rank, and the job goes on."""
        off = L.input_offset(rank)
        code = self._get(_U32, off + L.INPUT_CODE)
        if code == L.INPUT_OK:
            return
        index = self._get(_I32, off + L.INPUT_INDEX)
        value = self._get(_I32, off + L.INPUT_VALUE)
        rnd = self._get(_U32, off + L.INPUT_ROUND)
        own = self._get(_I32, L.input_own_offset(rank))
        self.clear_input_error(rank)
        if code == L.INPUT_BAD_EXPERT:
            bound = f"[0, num_experts={num_experts})" if num_experts is not None else "[0, num_experts)"
            raise errors.InputError(
                f"job {job} rank {rank}: token_selected_experts held expert id {value} (token {index}) in round "
                f"{rnd}, outside {bound}; that (token, k) was routed nowhere, the round completed",
                argument="token_selected_experts", token=index, expert_id=value, round=rnd,
            )
        if code == L.INPUT_RT_MISMATCH:
            raise errors.InputError(
                f"job {job} rank {rank}: rank {index} passed runtime_max_tokens_per_rank={value} in round {rnd}, "
                "this rank another value; every rank must pass the same: that round moved no data (its combine "
                "returned zeros) on every rank",
                argument="runtime_max_tokens_per_rank", peer=index, peer_value=value, round=rnd,
            )
        if code in (L.INPUT_SPEC_MISMATCH, L.INPUT_COMBINE_MISMATCH):
            raise spec_mismatch_error(job, rank, index & 0xFF, index >> 8, own, value, rnd)
        raise errors.InternalError(f"rank {rank}: unknown input error code {code} in the control block")

    def clear_input_error(self, rank: int) -> None:
        off = L.input_offset(rank)
        self._mv[off : off + L.INPUT_RECORD_SIZE] = bytes(L.INPUT_RECORD_SIZE)
        own = L.input_own_offset(rank)
        self._mv[own : own + 4] = bytes(4)

    @property
    def destroyed(self) -> bool:
        """Whether the job is gone for good: the daemon destroyed (or freed) it, or a rank
        found that no daemon and no fd store holds it any more. Nothing can resume it."""
        return self.abort_word in (L.ABORT_DESTROYED, L.ABORT_ORPHANED)

    def raise_for(self, rank: int, job: str = "?") -> None:
        """Raise what this block says about ``rank``: the abort word first, then its status record.

        JobDestroyed when the job was destroyed (nothing resumes it: attach again);
        PeerLeft when a rank left the running job cleanly; PeerLost when the job was
        otherwise aborted (naming the rank whose loss caused it, else, for a peer's loss, the
        peer the wait was on; an operator's abort or a re-arm names no rank: -1;
        ``details['waited_for']`` is the peer a wait the abort ended was on) or the rank's
        last wait was aborted; PeerTimeout when its last wait ran out. ``details['reason']`` is the ABORT_* reason (a number, where the abort word caused it)
        and ``details['reason_name']`` says it in words (``ABORT_NAMES``; for a rank's own
        aborted wait "wait aborted", for a rank the daemon no longer counts "not an active
        rank"). Both data planes use it.
        """
        abort = self.abort_word
        if abort == L.ABORT_DESTROYED:
            raise errors.JobDestroyed(destroyed_message(job), job=job, reason=abort, reason_name=abort_name(abort))
        if abort == L.ABORT_ORPHANED:
            raise errors.JobDestroyed(orphaned_message(job), job=job, reason=abort, reason_name=abort_name(abort))
        rec = self.status(rank)
        if abort != L.ABORT_NONE:
            lost = self.abort_rank
            if lost < 0 and rec.code != L.STATUS_OK and abort in (L.ABORT_PEER_LOST, L.ABORT_PEER_LEFT):
                # a peer's loss whose rank the word does not carry: the peer this rank waited on.
                # An abort no rank caused (operator, re-arm) names none: rank stays -1.
                lost = rec.peer
            if abort == L.ABORT_PEER_LEFT:
                who = f"rank {lost}" if lost >= 0 else "a rank"
                raise errors.PeerLeft(
                    f"job {job}: {who} left the job (it closed its attachment) while the job ran; "
                    f"call recover() once a replacement joined as {who}",
                    rank=lost,
                    generation=self.generation,
                    reason=abort,
                    reason_name=abort_name(abort),
                )
            waited = {"waited_for": rec.peer} if rec.code != L.STATUS_OK else {}
            raise errors.PeerLost(
                f"job {job}: {abort_name(abort)}"
                + (f" (rank {lost})" if lost >= 0 else "")
                + "; call recover() to resume once every rank is back",
                rank=lost,
                generation=self.generation,
                reason=abort,
                reason_name=abort_name(abort),
                **waited,
            )
        if rec.code == L.STATUS_TIMEOUT:
            raise errors.PeerTimeout(
                f"rank {rank}: waited {rec.waited_ns / 1e9:.3f} s for rank {rec.peer} in "
                f"{rec.phase_name} of round {rec.round}",
                peer=rec.peer,
                phase=rec.phase_name,
                round=rec.round,
                waited_ns=rec.waited_ns,
            )
        if rec.code == L.STATUS_ABORTED:
            raise errors.PeerLost(
                f"rank {rank}: {rec.phase_name} of round {rec.round} was aborted while waiting for rank {rec.peer}",
                rank=rec.peer,
                generation=self.generation,
                reason_name=WAIT_ABORTED,
            )
        if rec.code == L.STATUS_NOT_ACTIVE:
            raise errors.PeerLost(
                f"job {job} rank {rank}: this rank is no longer one of the job's active ranks (the daemon counted "
                f"it as gone before round {rec.round}); close this object and attach again",
                rank=rank,
                generation=self.generation,
                reason_name=NOT_ACTIVE,
            )
        if rec.code == L.STATUS_LEFT_BEHIND:
            raise errors.PeerLost(
                f"job {job} rank {rank}: rank {rec.peer} went on to round {rec.round + 1} without this rank (its node "
                f"counted this rank lost) while this rank pulled its outputs of round {rec.round}: they may be "
                "overwritten, so that combine's output is void; call recover(): the job re-arms once this rank's "
                "node is heard again",
                rank=rec.peer,
                generation=self.generation,
                reason_name=LEFT_BEHIND,
            )
        if rec.code != L.STATUS_OK:
            raise errors.InternalError(f"rank {rank}: unknown status code {rec.code} in the control block")


#: ``PeerLost.details['reason_name']`` where no abort word gave the reason: this rank's wait was
#: aborted, or the daemon no longer counts this rank as one of the job's active ranks.
WAIT_ABORTED = "wait aborted"
NOT_ACTIVE = "not an active rank"
#: A rank whose outputs a combine pulled went on to its next round without this rank (the
#: round's output is void): this rank was counted lost while it ran.
LEFT_BEHIND = "left behind"


def abort_name(abort: int) -> str:
    """An abort word's reason in words (``details['reason_name']`` of PeerLost and JobDestroyed)."""
    return L.ABORT_NAMES.get(abort, f"aborted ({abort})")


def destroyed_message(job) -> str:
    """What a client is told about a destroyed job (JobDestroyed): no recover advice, since
    nothing resumes it."""
    return (
        f"job {job} was destroyed (a2ad-ctl destroy, or freed by the daemon) and its memory is gone; "
        "it cannot be resumed: close this object and attach again, which creates a new job"
    )


def orphaned_message(job) -> str:
    """What a client is told when no daemon and no fd store holds its job any more."""
    return (
        f"job {job} is held by no daemon and no fd store any more (the daemon stopped or died and its fd keeper "
        "is gone or freed the job): nobody can join, re-arm or watch it. Its memory stays mapped in the processes "
        "that attached it until they close it (or exit), then it is freed; close this object and attach again"
    )


# ---------------------------------------------------------------- holder and rank locks
# Two open-file-description locks on a job's control-block memfd tell the parties apart
# without any message (both live in the kernel and end with the last reference to the open
# file description that took them, a mapping included):
#
# - the holder lock, a write lock on byte HOLDER_BYTE, is taken by the daemon on the
#   description it creates. That description travels with the fd: to the fd store (the keeper
#   or systemd) and to an upgrade's successor, so the lock stands as long as any daemon or
#   fd store holds the job. A client maps its own description (opened anew through
#   /proc/self/fd) and tests the lock (F_OFD_GETLK, taking nothing); a free lock means the
#   job has no holder left.
# - the rank lock, a read lock on byte RANK_BYTE, is taken by every attached client on its
#   own description. The fd keeper, holding the daemon's description, tests it to learn
#   whether any rank still maps the job.
HOLDER_BYTE = 0
RANK_BYTE = 1
#: struct flock on Linux (64-bit off_t): l_type, l_whence, l_start, l_len, l_pid (+ padding)
_FLOCK = struct.Struct("hhqqi4x")


def _ofd(fd: int, cmd: int, ltype: int, byte: int) -> int:
    raw = fcntl.fcntl(fd, cmd, _FLOCK.pack(ltype, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(raw)[0]


def hold_job(fd: int) -> bool:
    """Take the holder lock on the daemon's control-block description (idempotent).
    False when it cannot be taken (another description holds it, or no OFD locks here)."""
    try:
        _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, HOLDER_BYTE)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EINVAL, errno.ENOLCK):
            return False
        raise


def job_held(fd: int) -> bool | None:
    """Whether a daemon or an fd store holds the job (its holder lock stands), tested from
    a client's own description; None when it cannot be told."""
    try:
        return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_RDLCK, HOLDER_BYTE) != fcntl.F_UNLCK
    except OSError:
        return None


def mark_rank(fd: int) -> bool:
    """Take the rank lock on a client's own description (released when it closes and unmaps)."""
    try:
        _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, RANK_BYTE)
        return True
    except OSError:
        return False


def ranks_present(fd: int) -> bool | None:
    """Whether any client description holds the rank lock (some rank still maps the job),
    tested from the daemon's description; None when it cannot be told."""
    try:
        return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, RANK_BYTE) != fcntl.F_UNLCK
    except OSError:
        return None


def reopen(fd: int) -> int:
    """A new open file description of the file behind ``fd`` (O_RDWR, close-on-exec), so
    that this process's locks and mapping do not keep the sender's description alive.
    Raises OSError where /proc is not mounted."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def spec_mismatch_error(job: str, rank: int, peer: int, field: int, own: int, theirs: int, rnd: int):
    """The InputError of a payload (or combine) descriptor that differs between two ranks."""
    name = L.spec_field_name(field)
    if field == L.SPEC_FIELD_COMBINE:
        own, theirs = own & 0xFFFFFFFF, theirs & 0xFFFFFFFF
        what = ("nothing was pulled from that rank in that combine (its contributions are zeros), on every rank")
        argument = "payload"
    else:
        what = "that round moved no data (its combine returned zeros) on every rank"
        argument = "input_payloads" if field != L.SPEC_FIELD_EPLB else "eplb_stats_num_experts"
    return errors.InputError(
        f"job {job} rank {rank}: {name} differs between ranks in round {rnd}: this rank "
        f"{L.spec_value_text(field, own)}, rank {peer} {L.spec_value_text(field, theirs)}; every rank must pass the "
        f"same payloads: {what}",
        argument=argument, peer=peer, field=name, value=own, peer_value=theirs, round=rnd,
    )
