"""The host data plane: dispatch / sanitize / combine over a shared-memory workspace.

Same interface as the CUDA data plane (``cuda_plane.CudaPlane``); ``MoeAlltoAll``
checks its inputs, computes the payload layout (``a2ad.layout.payload_layout``) and
calls one of them. The protocol is docs/PROTOCOL.md, step by step; every offset
comes from ``a2ad.layout``. Work is vectorized torch on CPU tensors: Python loops
run over ranks or over top_k, never over tokens.

Ordering: the workspace is shared memory written by torch ops that complete (their
worker threads joined) before the next statement runs, and x86-64 keeps stores in
program order, so payloads and counters are visible before the flag that follows
them; a reader that sees a flag then reads the data it guards (loads are not
reordered with older loads). That is the memory model PROTOCOL.md states for the
host plane.

Waits poll the peers' flags and the control block's abort word with short sleeps
(20 us, doubling up to 1 ms), bounded by ``timeout``. A wait that gives up writes
this rank's status record in the control block and raises
:class:`~a2ad.errors.PeerTimeout` or :class:`~a2ad.errors.PeerLost`;
:meth:`HostPlane.check` raises the same error again at the next call, until the
job is re-armed.

Degraded mode (a job created with ``on_peer_loss="degrade"``; docs/PROTOCOL.md,
"Degraded mode"): a round runs among the ranks of the control block's effective mask,
read at the start of dispatch (:attr:`HostPlane.dispatch_mask`); tokens for the other
ranks are not sent, every wait also ends for a peer whose bit the daemon cleared, and
the combine's own view (:attr:`HostPlane.combine_mask`: the targets whose flags it saw,
every other one having left the mask) decides whose contributions count;
:meth:`HostPlane.degraded_tokens` marks the tokens that lost at least one. A
replacement's first dispatch waits to be let in.
"""

from __future__ import annotations

import platform
import time
import warnings

import torch

from a2ad import control as C, errors, layout as L, planerules as rules
from a2ad.control import NOT_ACTIVE

from .plane import Plane

_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3
#: A long wait's pause grows past _MAX_SLEEP to this, at most 1/_LONG_SHARE of the time
#: already waited (so it adds at most that share to the wait): many ranks waiting out a
#: loss would otherwise take the CPUs the daemons need to count it.
_LONG_SLEEP = 20e-3
_LONG_SHARE = 20


class _Patience:
    """One bounded wait of the host plane: between polls it sleeps with a doubling pause (up
    to 1 ms; in a wait longer than 20 ms, up to 1/20 of the time waited, at most 20 ms),
    and it gives up when the job's abort word is set or the timeout has passed."""

    def __init__(self, timeout: float):
        self.start = self.now = time.monotonic_ns()
        self.deadline = self.start + int(timeout * 1e9)
        self.pause = _FIRST_SLEEP

    def give_up(self, cb) -> int | None:
        """The status code to record (STATUS_ABORTED, STATUS_TIMEOUT), or None after a pause."""
        self.now = time.monotonic_ns()
        if cb.abort_word != L.ABORT_NONE:
            return L.STATUS_ABORTED
        if self.now >= self.deadline:
            return L.STATUS_TIMEOUT
        time.sleep(self.pause)
        cap = max(_MAX_SLEEP, min(_LONG_SLEEP, (self.now - self.start) * 1e-9 / _LONG_SHARE))
        self.pause = min(self.pause * 2, cap)
        return None

    @property
    def waited_ns(self) -> int:
        return self.now - self.start

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i686"}


def route(experts: torch.Tensor, num_experts: int, ep_size: int, active: torch.Tensor | None = None):
    """Vectorized routing of ``[T, top_k]`` expert ids (PROTOCOL.md, "Routing").

    Returns ``(target, slot, sent)``: ``target``/``slot`` ``[T, top_k]`` int32 (-1 for
    repeats), ``sent`` ``[T, ep_size]`` bool (token t goes to rank q). Slots are
    given in token order, so the tokens sent to q are ``sent[:, q].nonzero()`` in slot order.
    With ``active`` (``[ep_size]`` bool, degraded mode), nothing is sent to an inactive
    rank: its (t, k) keep their target and get slot -1 ("dropped").
    """
    base, rem = L.expert_partition(num_experts, ep_size)
    e = experts.long()
    split = rem * (base + 1)
    owner = torch.where(e < split, e // (base + 1), rem + (e - split) // base)
    top_k = owner.shape[1]
    earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=owner.device).tril(-1)  # [k, j]: j < k
    repeat = ((owner.unsqueeze(2) == owner.unsqueeze(1)) & earlier).any(2)
    sent = (owner.unsqueeze(2) == torch.arange(ep_size, device=owner.device)).any(1)  # [T, ep_size]
    if active is not None:
        sent &= active
    slot_of = sent.to(torch.int32).cumsum(0, dtype=torch.int32) - 1  # exclusive count per target
    slot = slot_of.gather(1, owner).masked_fill(repeat, -1)
    if active is not None:
        slot = slot.masked_fill(~active[owner], -1)
    target = owner.to(torch.int32).masked_fill(repeat, -1)
    return target, slot, sent


def _caller_bits(caller_mask: torch.Tensor | None, ep_size: int) -> int:
    """The ranks a caller's active-rank mask lets take part: int64 words ``[n]``, n <= MASK_WORDS,
    rank q being bit q & 63 of word q >> 6 (``frontend.rank_mask_arg``); absent words are zero."""
    if caller_mask is None:
        return L.full_mask(ep_size)
    if caller_mask.dim() > 1 or not 1 <= caller_mask.numel() <= L.MASK_WORDS or caller_mask.dtype not in (
            torch.int64, torch.int32):
        raise errors.InputError(f"active_rank_mask must be an int64 tensor of 1 to {L.MASK_WORDS} words, got "
                                f"{caller_mask.dtype} {list(caller_mask.shape)}", argument="active_rank_mask")
    return L.mask_from_words(caller_mask.reshape(-1).tolist()) & L.full_mask(ep_size)


def mask_word_tensor(mask: int) -> torch.Tensor:
    """``mask`` as int64 ``[MASK_WORDS]`` (rank q: bit q & 63 of word q >> 6; a word with bit 63
    set is negative, two's complement)."""
    return torch.tensor([w - (1 << 64) if w >> 63 else w for w in L.mask_words(mask)], dtype=torch.int64)


def check_fp8_combine(payload: torch.Tensor) -> None:
    """The low-precision combine's conditions on the payload."""
    if payload.dtype != torch.bfloat16:
        raise errors.InputError(f"low_precision combine needs a bfloat16 payload, got {payload.dtype}",
                                argument="payload")
    if payload.shape[-1] % L.FP8_BLOCK:
        raise errors.InputError(f"low_precision combine needs hidden % {L.FP8_BLOCK} == 0, got hidden "
                                f"{payload.shape[-1]}", argument="payload")


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 rows of the low-precision combine: ``[..., hidden]`` -> uint8 ``[..., fp8_row_bytes]``.

    Per block of FP8_BLOCK elements, k is the smallest exponent with amax * 2^-k <= 448
    (from amax's float32 bits: k = e - 8, plus one when its mantissa exceeds 448's, at least
    -126); the block's values are x * 2^-k rounded to e4m3 (nearest even), its scale byte
    k + 127 (E8M0). The CUDA kernels compute exactly the same bits."""
    hidden = x.shape[-1]
    lead = x.shape[:-1]
    xf = x.float().reshape(*lead, hidden // L.FP8_BLOCK, L.FP8_BLOCK)
    bits = xf.abs().amax(-1).view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k = k.clamp(min=-126)
    inv = ((127 - k) << 23).view(torch.float32)
    q = (xf * inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, hidden)
    out = torch.zeros(*lead, L.fp8_row_bytes(hidden), dtype=torch.uint8)
    out[..., :hidden] = q
    out[..., hidden : hidden + hidden // L.FP8_BLOCK] = (k + 127).to(torch.uint8)
    return out


def dequantize_fp8(rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """float32 ``[..., hidden]`` of FP8 rows (:func:`quantize_fp8`)."""
    q = rows[..., :hidden].contiguous().view(torch.float8_e4m3fn).float()
    k = rows[..., hidden : hidden + hidden // L.FP8_BLOCK].to(torch.int32) - 127
    scale = ((127 + k) << 23).view(torch.float32)
    lead = q.shape[:-1]
    return (q.reshape(*lead, hidden // L.FP8_BLOCK, L.FP8_BLOCK) * scale.unsqueeze(-1)).reshape(*lead, hidden)


def _mask_tensor(mask: int, ep_size: int) -> torch.Tensor:
    """``[ep_size]`` bool: bit q of ``mask``."""
    return torch.tensor([bool(mask >> q & 1) for q in range(ep_size)], dtype=torch.bool)


def _bits(nonzero: torch.Tensor) -> int:
    """The mask of the ranks a ``[n, 1]`` nonzero() result lists."""
    out = 0
    for q in nonzero.flatten().tolist():
        out |= 1 << q
    return out


def _unset(flags: torch.Tensor, rnd: int, view: int, past_ok: bool = False) -> int:
    """The ranks of ``view`` whose flag (one per rank) is not ``rnd`` (with ``past_ok``: is below
    ``rnd``; ``planerules.past_round_is_seen``)."""
    pending = ((flags < rnd) if past_ok else (flags != rnd)).nonzero()
    return _bits(pending) & view if pending.numel() else 0


class HostPlane(Plane):
    """Dispatch/combine for one rank of a job on the host backend.

    ``att`` is an :class:`a2ad.client.Attachment` whose ``workspace`` is the shared
    ``[ep_size, size_per_rank]`` uint8 CPU tensor; ``timeout`` (seconds) bounds every
    wait on a peer.
    """

    checks_ids_on_host = True
    supports_degraded_mode = True

    def __init__(self, att, timeout: float):
        if not isinstance(att.workspace, torch.Tensor) or att.workspace.device.type != "cpu":
            raise errors.BackendError("HostPlane needs a CPU workspace (the job runs on the cuda backend?)")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if platform.machine().lower() not in _TSO_MACHINES:
            warnings.warn(
                f"the host data plane relies on x86-64 store ordering; on {platform.machine()} it is unverified",
                RuntimeWarning,
                stacklevel=2,
            )
        self.att = att
        self.ep_rank = me = int(att.ep_rank)
        self.ep_size = ep = int(att.ep_size)
        self.top_k = int(att.spec["top_k"])
        self.max_num_tokens = int(att.spec["max_num_tokens"])
        self.timeout = float(timeout)
        ws = self.ws = att.workspace
        aux = att.aux

        def field(off: int, n: int) -> torch.Tensor:  # int32 [ep_size (row), n]
            return ws[:, off : off + 4 * n].view(torch.int32)

        self._flag_val = field(aux.flag_val, 1)[me]
        self._local_count = field(aux.local_token_counter, 1)[me]
        self._send_counters = field(aux.send_counters, ep)[me]
        self._recv_counters = field(aux.recv_counters, ep)  # [row q, source s]
        self._recv_rts = field(aux.recv_rts, ep)  # [row q, source s]
        self._recv_specs = field(aux.recv_specs, ep * L.SPEC_WORDS).view(ep, ep, L.SPEC_WORDS)  # [row q, source s]
        self._combine_ready = ws[:, aux.combine_ready : aux.combine_ready + 8 * ep].view(torch.int64)  # [row q, t]
        self._dispatch_flags = field(aux.dispatch_completion_flags, ep)
        self._combine_flags = field(aux.combine_completion_flags, ep)
        topk = self.max_num_tokens * L.MAX_TOP_K
        self._topk_target = field(aux.topk_target_ranks, topk)[me].view(self.max_num_tokens, L.MAX_TOP_K)
        self._topk_send = field(aux.topk_send_indices, topk)[me].view(self.max_num_tokens, L.MAX_TOP_K)
        self._flag_vals = field(aux.flag_val, 1)[:, 0]  # every rank's round (a replacement waits on them)
        # every rank's row admit word: its admit round where its control-block entry is ADMIT_ROW
        self._row_admit = field(aux.block_counters + 4 * L.SLOT_ADMIT_ROUND, 1)[:, 0]
        # degraded mode: every rank's view of its current round (the job's effective mask its
        # dispatch read) and that round, in its row: a rank that pulled from q checks that q
        # did not go on without it (q then restages what it pulled)
        view_off = aux.block_counters + 4 * L.SLOT_VIEW
        self._views = ws[:, view_off : view_off + 8 * L.MASK_WORDS].view(torch.int64)  # [row q, word]
        self._view_rounds = field(aux.block_counters + 4 * L.SLOT_VIEW_ROUND, 1)[:, 0]
        self._round: int | None = None  # the round between a dispatch and its combine
        #: Whether the job keeps serving without a lost rank (spec on_peer_loss="degrade").
        self.degrade = att.spec.get("on_peer_loss") == "degrade"
        self._full = L.full_mask(ep)
        #: The ranks the current (or last) round's dispatch ran among, read at its start.
        self.dispatch_mask: int | None = None
        #: The sources whose tokens the current round's dispatch received (its wait saw their
        #: flag): the combine publishes its outputs to them only.
        self._dispatch_got = self._full
        self._published_view = self._full  # what this rank's row says its view of the round is
        #: The ranks whose contributions the last combine summed (its view of the mask).
        self.combine_mask: int | None = None
        self._degraded: torch.Tensor | None = None
        self._masks: dict[int, tuple[torch.Tensor, torch.Tensor | slice]] = {}

    # --- data plane ---------------------------------------------------------------
    def dispatch(self, experts: torch.Tensor, payloads: list[torch.Tensor], rt: int, pl: L.PayloadLayout,
                 num_experts: int, *, eplb_local_stats: torch.Tensor | None = None,
                 eplb_gathered: torch.Tensor | None = None, caller_mask: torch.Tensor | None = None) -> None:
        """Route and send this rank's tokens; returns once every peer's tokens are here.

        The payload descriptor ``pl.spec`` (count, widths, dtypes, EPLB experts) travels with
        the data; a peer that published another one makes this raise InputError on every
        rank naming the field and both values, after the round completed without data.
        ``eplb_local_stats`` (int32 ``[pl.eplb_stats_num_experts]``) goes to every rank;
        ``eplb_gathered`` (int32 ``[ep_size, E]``) receives every rank's (zeros for a rank
        outside the round). ``caller_mask`` (int64 mask words, rank r: bit r & 63 of word r >> 6)
        is ANDed with the job's mask for this round.

        experts: ``[T, top_k]`` int32, contiguous, ids in ``[0, num_experts)``.
        payloads: ``[T, ...]`` contiguous tensors (``pl.dispatch_bytes_per_token[i]`` bytes
        per token). Every rank must pass the same ``rt``: a peer that passed another one
        makes this raise InputError on every rank, after the round was completed without
        data (so that the next round starts in step).
        The received payload i is ``workspace[ep_rank]`` at ``pl.dispatch_offsets[i]``,
        ``[ep_size, rt, bytes_i]``.
        """
        me, ep = self.ep_rank, self.ep_size
        num_tokens, top_k = experts.shape
        rnd = int(self._flag_val.item())
        view = self._full
        if self.degrade:  # the round's ranks, read once at its start
            rnd, view = self._enter_round(rnd)
            if not view >> me & 1:
                raise errors.PeerLost(
                    f"job {self.att.job} rank {me}: this rank is no longer one of the job's active ranks (the daemon "
                    "counted it as gone); close this object and attach again",
                    rank=me, generation=self.att.control.generation, reason_name=NOT_ACTIVE,
                )
            # the view first, then its round (stores in order): a peer that reads this round
            # then reads at least this view
            self._views[me].copy_(mask_word_tensor(view))
            self._view_rounds[me] = rnd
            self._published_view = view
        view &= _caller_bits(caller_mask, ep)
        self.dispatch_mask = view
        active, rows = self._mask(view)
        # 2. counters and routing scratch of this rank's own row
        self._local_count.fill_(num_tokens)
        target, slot, sent = route(experts, num_experts, ep, None if view == self._full else active)
        counts = sent.sum(0, dtype=torch.int32)
        self._send_counters.copy_(counts)
        self._topk_target[:num_tokens, :top_k].copy_(target)
        self._topk_send[:num_tokens, :top_k].copy_(slot)
        # 3. payload rows to every target, slots in token order
        if num_tokens:  # byte views [T, bytes_per_token] (a reshape of 0 elements has no width)
            # (a flat view first: torch calls a tensor with a size-1 dimension contiguous whatever
            # that dimension's stride, e.g. [T, 1] transposed from [1, T], which a byte view refuses)
            payloads = [p if p.dtype == torch.uint8 and p.dim() == 2
                        else p.reshape(-1).view(num_tokens, -1).view(torch.uint8) for p in payloads]
        for q in range(ep):
            tokens = sent[:, q].nonzero().squeeze(1)
            n = tokens.numel()
            if n == 0:
                continue
            for i, payload in enumerate(payloads):
                nbytes = pl.dispatch_bytes_per_token[i]
                start = pl.dispatch_offsets[i] + me * rt * nbytes
                dst = self.ws[q, start : start + n * nbytes].view(n, nbytes)
                torch.index_select(payload, 0, tokens, out=dst)
        # EPLB statistics: this rank's row of every target's region
        n_stats = pl.eplb_stats_num_experts
        if n_stats:
            if eplb_local_stats is None:
                raise errors.InputError("eplb_local_stats is required: the job gathers EPLB statistics",
                                        argument="eplb_local_stats")
            stats = eplb_local_stats.reshape(-1).to(torch.int32)
            start = pl.eplb_offset + 4 * me * n_stats
            self.ws[rows, start : start + 4 * n_stats] = stats.view(torch.uint8)
        # 4. every target learns how many tokens came from this rank, with which rt and payloads
        spec = torch.tensor(pl.spec if pl.spec else L.payload_spec(pl.dispatch_bytes_per_token), dtype=torch.int32)
        self._recv_specs[rows, me] = spec
        if view == self._full:
            self._recv_counters[:, me].copy_(counts)
            self._recv_rts[:, me].fill_(rt)
            # 5. the copies above have completed; then the flags
            self._dispatch_flags[:, me].fill_(rnd)
        else:  # only the round's ranks: a replacement's row is re-initialized under us
            self._recv_counters[rows, me] = counts[rows]
            self._recv_rts[rows, me] = rt
            self._dispatch_flags[rows, me] = rnd
        # 6. every source's data is here (or the source left the mask: nothing came from it)
        got = self._wait(self._dispatch_flags[me], rnd, L.PHASE_DISPATCH, view)
        self._dispatch_got = got
        if self.degrade and got != view:
            # the sources let go of leave the published view before this rank restages its
            # combine region (its combine, below): one of them, alive, may still be pulling it
            # for the round before, and its left-behind check must find itself outside
            self._published_view = rules.published_view(self._published_view, view, got)
            self._views[me].copy_(mask_word_tensor(self._published_view))
        if got != self._full:
            _, gone = self._mask(self._full & ~got)
            self._recv_counters[me, gone] = 0
        rts = self._recv_rts[me]
        wrong = ((rts != rt) & self._mask(got)[0]).nonzero()
        if wrong.numel():
            peer = int(wrong[0, 0])
            peer_rt = int(rts[peer])
            self._round = rnd
            self._skip_round(rnd)
            raise errors.InputError(
                f"job {self.att.job} rank {me}: rank {peer} passed runtime_max_tokens_per_rank={peer_rt} in round "
                f"{rnd}, this rank {rt}; every rank must pass the same: the round moved no data on every rank",
                argument="runtime_max_tokens_per_rank", peer=peer, peer_value=peer_rt, round=rnd,
            )
        specs = self._recv_specs[me]
        differ = ((specs != spec).any(1) & self._mask(got)[0]).nonzero()
        if differ.numel():
            peer = int(differ[0, 0])
            field, own, theirs = L.spec_mismatch(spec.tolist(), specs[peer].tolist())
            self._round = rnd
            self._skip_round(rnd)
            raise C.spec_mismatch_error(self.att.job, me, peer, field, own, theirs, rnd)
        if n_stats and eplb_gathered is not None:
            region = self.ws[me, pl.eplb_offset : pl.eplb_offset + 4 * ep * n_stats].view(torch.int32).view(ep, n_stats)
            eplb_gathered.copy_(region)
            if got != self._full:
                eplb_gathered[~self._mask(got)[0]] = 0
        self._round = rnd

    def _mask(self, mask: int) -> tuple[torch.Tensor, torch.Tensor | slice]:
        """(``[ep_size]`` bool, the ranks as an index) of ``mask``, cached."""
        got = self._masks.get(mask)
        if got is None:
            active = _mask_tensor(mask, self.ep_size)
            rows = slice(None) if mask == self._full else active.nonzero().squeeze(1)
            if len(self._masks) > 64:
                self._masks.clear()
            got = self._masks[mask] = (active, rows)
        return got

    def _skip_round(self, rnd: int) -> None:
        """Complete round ``rnd`` without data (every rank does the same when their rts differ):
        the combine flags go round and the round number moves on, so the next round starts
        in step on every rank."""
        me = self.ep_rank
        view = self.dispatch_mask if self.dispatch_mask is not None else self._full
        _, rows = self._mask(view)
        self._combine_flags[rows, me] = rnd
        self.combine_mask = self._wait(self._combine_flags[me], rnd, L.PHASE_COMBINE, view,
                                       rules.past_round_is_seen(self.degrade, True))
        self._degraded = None
        self._flag_val.fill_(rnd + 1)
        self._round = None

    # --- degraded mode: entering rounds -----------------------------------------
    def _enter_round(self, rnd: int) -> tuple[int, int]:
        """(the round this dispatch runs, its view: the effective mask read once). A
        replacement first waits to be let in; the lowest rank of the view then lets in the
        replacements that asked, from the next round on (docs/PROTOCOL.md, "Degraded mode")."""
        cb, me, ep, rows = self.att.control, self.ep_rank, self.ep_size, self._row_admit
        admit = cb.admit_of(me, rows)
        if admit < 0 or admit > rnd:
            rnd = self._admitted(admit)
        eff = cb.effective_mask(ep, rnd, rows)
        if rules.lets_in(me, eff):  # this rank is the lowest of the round's ranks
            waiting = cb.active_mask & ~eff
            if waiting:
                rounds = cb.admit_rounds(ep)
                for q in L.mask_ranks(waiting):
                    # nobody can have started rnd + 1: it needs this rank's combine flag of rnd,
                    # written after this store
                    if rounds[q] == L.ADMIT_READY:
                        cb.set_admit_round(q, rnd + 1)
                    elif rounds[q] == L.ADMIT_ROW and int(rows[q]) == L.ADMIT_READY:
                        rows[q] = rnd + 1  # in q's row, where the ranks of every node read it
        return rnd, eff

    def _admitted(self, admit: int) -> int:
        """A replacement's first dispatch: ask to be let in, wait for the round the lowest
        active rank picks, then for every other rank of that round to have finished the one
        before (its FLAG_VAL reaches it: nobody reads that round's data any more; a rank let
        in at the same round took no part in the one before and is not waited for). Both
        waits are bounded, and abandoned on the abort word, like every wait. (Where this
        rank's control-block entry is ADMIT_ROW, its admit round is in its own row.)"""
        cb, me, ep, rows = self.att.control, self.ep_rank, self.ep_size, self._row_admit
        if admit == L.ADMIT_JOINED:
            if cb.admit_round(me) == L.ADMIT_ROW:
                rows[me] = L.ADMIT_READY
            else:
                cb.set_admit_round(me, L.ADMIT_READY)
        patience = _Patience(self.timeout)
        flag = int(self._flag_val.item())
        while True:
            admit = cb.admit_of(me, rows)
            if admit >= 0:
                lagging = 0
                behind = (self._flag_vals < admit).nonzero()
                if behind.numel():
                    behind = _bits(behind) & ~(1 << me)
                    admit_view = cb.effective_mask(ep, admit, rows)
                    # (a replacement let in at the same round has no round before it to finish)
                    same = 0
                    for q in L.mask_ranks(behind & admit_view):
                        if cb.admit_of(q, rows) == admit:
                            same |= 1 << q
                    lagging = rules.lagging(me, admit_view, behind, same)
                if not lagging:
                    self._flag_val.fill_(admit)
                    return admit
                peer = (lagging & -lagging).bit_length() - 1
            else:
                admitted = cb.admitted_mask(ep, rows=rows)
                peer = (admitted & -admitted).bit_length() - 1 if admitted else me
            code = patience.give_up(cb)
            if code is None:
                continue
            cb.record_status(me, code, peer, max(admit, flag), L.PHASE_DISPATCH, patience.waited_ns)
            cb.raise_for(me, self.att.job)

    def sanitize(self, recv_ids: torch.Tensor, rt: int, invalid_id: int) -> None:
        """Set every id of every slot that received no token to ``invalid_id``.

        recv_ids: ``[ep_size, rt, top_k]`` int32 view of this rank's received expert ids.
        """
        counts = self._recv_counters[self.ep_rank].long()
        empty = torch.arange(rt).unsqueeze(0) >= counts.unsqueeze(1)  # [ep_size, rt]
        recv_ids.masked_fill_(empty.unsqueeze(2), invalid_id)

    def combine(self, payload: torch.Tensor, local_num_tokens: int, rt: int, pl: L.PayloadLayout,
                payload_in_workspace: bool, *, output: torch.Tensor | None = None, low_precision: bool = False,
                caller_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sum every token's expert outputs from the ranks it was sent to.

        payload: ``[ep_size, rt, hidden]`` bfloat16/float16/float32, the expert outputs
        for the tokens this rank received (row (s, j): source s, slot j); when
        ``payload_in_workspace`` it must be this rank's combine region.
        Returns ``[local_num_tokens, hidden]`` of the payload's dtype (float32 sums), written
        into ``output`` when given. ``low_precision`` (bfloat16 payloads, hidden a multiple of
        FP8_BLOCK): the rows peers pull are FP8 e4m3 with one power-of-two scale per
        FP8_BLOCK elements (:func:`quantize_fp8`); this rank's own rows are summed unquantized.
        The combine descriptor (hidden, dtype, low precision) travels with the flag; a target
        that published another one contributes nothing and this raises InputError (on every
        rank: each sees the other's) after the round completed.
        """
        if self._round is None:
            raise errors.StateError("combine without a completed dispatch on this plane")
        me, ep = self.ep_rank, self.ep_size
        rnd = self._round
        view = self.dispatch_mask if self.dispatch_mask is not None else self._full
        view &= _caller_bits(caller_mask, ep)
        dtype, hidden = payload.dtype, payload.shape[2]
        spec = L.combine_spec(hidden, dtype, low_precision, payload_in_workspace)
        if low_precision:
            check_fp8_combine(payload)
            wbytes = L.fp8_row_bytes(hidden)
            off = L.fp8_combine_offset(pl, ep, hidden, payload_in_workspace)
            regions = self.ws[:, off : off + ep * rt * wbytes].unflatten(1, (ep, rt, wbytes))
        else:
            nbytes = ep * rt * hidden * payload.element_size()
            # [row q, source s, slot, hidden]: every rank's combine region
            regions = (
                self.ws[:, pl.combine_offset : pl.combine_offset + nbytes].view(dtype).unflatten(1, (ep, rt, hidden))
            )
        # 1. stage
        if low_precision:
            others = [s for s in range(ep) if s != me]
            if others:
                regions[me, others] = quantize_fp8(payload[others])
        elif not payload_in_workspace:
            regions[me].copy_(payload)
        # 2. the staged outputs are in place; then the flags, the descriptor with them
        ready = spec << 32 | rnd
        ready = ready - (1 << 64) if ready >= 1 << 63 else ready
        # the sources whose tokens the dispatch received get the staged outputs; a source it
        # let go of (it left the mask meanwhile) may still be alive (its node was counted
        # lost, or its bit came back), and the rows staged for it were computed from whatever
        # its slots held: it gets its flag with the void descriptor, so it counts nothing from
        # this rank instead of waiting for a flag that would never come
        publish, void = rules.combine_publish(view, self._dispatch_got)
        if publish:
            rows = slice(None) if publish == self._full else self._mask(publish)[1]
            self._combine_ready[rows, me] = ready
            self._combine_flags[rows, me] = rnd
        if void:
            rows = self._mask(void)[1]
            self._combine_ready[rows, me] = L.COMBINE_SPEC_VOID << 32 | rnd
            self._combine_flags[rows, me] = rnd
        # 3. every target's outputs for this rank are ready (or the target left the mask, or
        # let this rank go in its dispatch: a void descriptor)
        past_ok = rules.past_round_is_seen(self.degrade, True)
        got = self._wait(self._combine_flags[me], rnd, L.PHASE_COMBINE, view, past_ok)
        descriptors = (self._combine_ready[me] >> 32) & 0xFFFFFFFF
        seen = self._mask(got)[0]
        # a flag past the round: the target let this rank go in its next dispatch and restaged
        ahead = (self._combine_flags[me] > rnd) & seen if past_ok else None
        ahead = _bits(ahead.nonzero()) if ahead is not None and bool(ahead.any()) else 0
        voided = (descriptors == L.COMBINE_SPEC_VOID) & seen
        voided = _bits(voided.nonzero()) if bool(voided.any()) else 0
        disagree = (descriptors != spec) & (descriptors != L.COMBINE_SPEC_VOID) & seen
        disagree = _bits(disagree.nonzero()) & ~ahead if bool(disagree.any()) else 0
        got, counted_mask = rules.combine_counted(got, voided, disagree, ahead)
        if voided or ahead:
            seen = self._mask(got)[0]
        bad = disagree
        self.combine_mask = got
        # 4. pull and sum in float32, over k in ascending order; the combine's view (got: the
        # targets whose flag it saw) decides whose contributions count
        top_k = self.top_k
        target = self._topk_target[:local_num_tokens, :top_k].long()
        slot = self._topk_send[:local_num_tokens, :top_k].long()
        mine = regions[:, me]  # [target q, slot, ...]: what q computed for this rank's tokens
        acc = torch.zeros(local_num_tokens, hidden, dtype=torch.float32)

        def rows_of(tokens, k):
            tq, sq = target[tokens, k], slot[tokens, k]
            if not low_precision:
                return mine[tq, sq].float()
            vals = dequantize_fp8(mine[tq, sq], hidden)
            own = tq == me
            if bool(own.any()):
                vals[own] = payload[me, sq[own]].float()
            return vals

        if counted_mask == self._full:
            for k in range(top_k):
                tokens = (target[:, k] >= 0).nonzero().squeeze(1)
                if tokens.numel():
                    acc.index_add_(0, tokens, rows_of(tokens, k))
            self._degraded = torch.zeros(local_num_tokens, dtype=torch.bool)
        else:
            counted = self._mask(counted_mask)[0]
            routed = target >= 0  # every (t, k) that is not a repeat, dropped ones included
            present = routed & counted[target.clamp(min=0)]
            for k in range(top_k):
                tokens = (present[:, k] & (slot[:, k] >= 0)).nonzero().squeeze(1)
                if tokens.numel():
                    acc.index_add_(0, tokens, rows_of(tokens, k))
            self._degraded = (routed & ~seen[target.clamp(min=0)]).any(1)
        out = acc.to(dtype)
        # 5. next round
        self._flag_val.fill_(rnd + 1)
        self._round = None
        if self.degrade:
            gone_on = self._gone_on_without_me(rnd, counted_mask)
            if gone_on >= 0:
                # (the control block's record says it: the CUDA kernels report the same case so)
                self.att.control.record_status(me, L.STATUS_LEFT_BEHIND, gone_on, rnd, L.PHASE_COMBINE, 0)
                self.att.control.raise_for(me, self.att.job)
        if bad:
            peer = (bad & -bad).bit_length() - 1
            theirs = int(descriptors[peer])
            raise C.spec_mismatch_error(self.att.job, me, peer, L.SPEC_FIELD_COMBINE, spec, theirs, rnd)
        if output is not None:
            output.copy_(out)
            return output
        return out

    def _gone_on_without_me(self, rnd: int, counted: int) -> int:
        """A rank whose outputs this combine (round ``rnd``) summed but that went on without
        this rank, or -1. A rank q restages its combine region in round rnd + 1 only after
        every rank of its view of that round finished round rnd; a rank outside that view
        (counted lost while it ran: its node stalled or was cut off) may still be pulling
        from it. q publishes its view and then its round before it restages, so a round of
        q past rnd + 1, or rnd + 1 with this rank outside the view, read after the pull,
        means the rows pulled may hold round rnd + 1's. (The view word read after a round of
        rnd + 1 is that round's: q cannot finish rnd + 1 with this rank in its view before
        this rank's next dispatch.) The CUDA prologue applies the same rule."""
        me = self.ep_rank
        others = rules.left_behind_candidates(me, counted)
        ahead = (self._view_rounds > rnd).nonzero()
        ahead_bits = _bits(ahead) & others if ahead.numel() else 0
        for q in L.mask_ranks(ahead_bits):
            vr = int(self._view_rounds[q])
            view = L.mask_from_words(self._views[q].tolist()) if rules.view_needed(rnd, vr) else None
            if rules.went_on_without(rnd, me, vr, view):
                return q
        return -1

    def degraded_tokens(self) -> torch.Tensor | None:
        """``[local_num_tokens]`` bool of the last combine: True for a token that lost at least
        one expert's contribution (an expert on a rank outside ``combine_mask``)."""
        return self._degraded

    def round_mask(self) -> int | None:
        """The ranks whose contributions the last combine summed (``combine_mask``)."""
        return self.combine_mask

    def round_mask_tensor(self) -> torch.Tensor | None:
        """``combine_mask`` as int64 ``[MASK_WORDS]`` words (:func:`mask_word_tensor`)."""
        m = self.combine_mask
        if m is None:
            return None
        return mask_word_tensor(m)

    # --- waits and failures ---------------------------------------------------------
    def _wait(self, flags: torch.Tensor, rnd: int, phase: int, view: int, past_ok: bool = False) -> int:
        """Until ``flags[q]`` (this rank's, one per peer) equals ``rnd`` for every q of the
        round (``view``; with ``past_ok``, or is past it: ``planerules.past_round_is_seen``);
        in a degrade job a peer whose bit the daemon cleared is no longer waited for. Returns the ranks whose flag was seen: what came from them is complete
        (written before the flag), whatever became of them since; nothing counts from the
        others. Bounded by the timeout and abandoned when the abort word is set."""
        cb = self.att.control
        patience = _Patience(self.timeout)
        degrade = self.degrade
        while True:
            waiting = _unset(flags, rnd, view, past_ok)  # only the round's ranks
            if not waiting:
                return view
            if degrade:
                peer = cb.first_effective(waiting, rnd, self._row_admit)  # the lowest still in the mask: wait on it
                if peer < 0:
                    # every rank still waited for left the mask; one may have published its flag,
                    # finished the round and left between the two reads above: what it published
                    # is complete, so a second look counts it
                    return rules.all_left(view, waiting, _unset(flags, rnd, view, past_ok))
            else:
                peer = rules.lowest(waiting)
            code = patience.give_up(cb)
            if code is None:
                continue
            # the flags were read before the abort word: a peer may have published its flag,
            # finished its round and left (setting the abort word) between the two reads;
            # what it published is complete, so one more look decides
            if rules.completes_after_give_up(view, _unset(flags, rnd, view, past_ok)):
                return view
            cb.record_status(self.ep_rank, code, peer, rnd, phase, patience.waited_ns)
            self.att.control.raise_for(self.ep_rank, self.att.job)

    def check(self) -> None:
        """Raise PeerLost/PeerTimeout if the abort word or this rank's status record says so."""
        self.att.control.raise_for(self.ep_rank, self.att.job)

    def check_input(self) -> None:
        """Nothing to report later: the host plane raises InputError in the call itself."""

    def reset_status(self) -> None:
        """Clear this rank's status record (call only when the job is re-armed)."""
        self.att.control.clear_status(self.ep_rank)
        self._round = None
        self.dispatch_mask = None

    def close(self) -> None:
        """Nothing to release (the attachment owns the mapping). Idempotent."""

    def __repr__(self) -> str:
        return f"HostPlane(rank={self.ep_rank}/{self.ep_size}, top_k={self.top_k}, timeout={self.timeout}s)"
