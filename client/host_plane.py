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
"""

from __future__ import annotations

import platform
import time
import warnings

import torch

from a2ad import errors, layout as L

from .plane import Plane

_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i686"}


def route(experts: torch.Tensor, num_experts: int, ep_size: int):
    """Vectorized routing of ``[T, top_k]`` expert ids (PROTOCOL.md, "Routing").

    Returns ``(target, slot, sent)``: ``target``/``slot`` ``[T, top_k]`` int32 (-1 for
    repeats), ``sent`` ``[T, ep_size]`` bool (token t goes to rank q). Slots are
    given in token order, so the tokens sent to q are ``sent[:, q].nonzero()`` in slot order.
    """
    base, rem = L.expert_partition(num_experts, ep_size)
    e = experts.long()
    split = rem * (base + 1)
    owner = torch.where(e < split, e // (base + 1), rem + (e - split) // base)
    top_k = owner.shape[1]
    earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=owner.device).tril(-1)  # [k, j]: j < k
    repeat = ((owner.unsqueeze(2) == owner.unsqueeze(1)) & earlier).any(2)
    sent = (owner.unsqueeze(2) == torch.arange(ep_size, device=owner.device)).any(1)  # [T, ep_size]
    slot_of = sent.to(torch.int32).cumsum(0, dtype=torch.int32) - 1  # exclusive count per target
    slot = slot_of.gather(1, owner).masked_fill(repeat, -1)
    target = owner.to(torch.int32).masked_fill(repeat, -1)
    return target, slot, sent


class HostPlane(Plane):
    """Dispatch/combine for one rank of a job on the host backend.

    ``att`` is an :class:`a2ad.client.Attachment` whose ``workspace`` is the shared
    ``[ep_size, size_per_rank]`` uint8 CPU tensor; ``timeout`` (seconds) bounds every
    wait on a peer.
    """

    checks_ids_on_host = True

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
        self._dispatch_flags = field(aux.dispatch_completion_flags, ep)
        self._combine_flags = field(aux.combine_completion_flags, ep)
        topk = self.max_num_tokens * L.MAX_TOP_K
        self._topk_target = field(aux.topk_target_ranks, topk)[me].view(self.max_num_tokens, L.MAX_TOP_K)
        self._topk_send = field(aux.topk_send_indices, topk)[me].view(self.max_num_tokens, L.MAX_TOP_K)
        self._round: int | None = None  # the round between a dispatch and its combine

    # --- data plane ---------------------------------------------------------------
    def dispatch(self, experts: torch.Tensor, payloads: list[torch.Tensor], rt: int, pl: L.PayloadLayout,
                 num_experts: int) -> None:
        """Route and send this rank's tokens; returns once every peer's tokens are here.

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
        # 2. counters and routing scratch of this rank's own row
        self._local_count.fill_(num_tokens)
        target, slot, sent = route(experts, num_experts, ep)
        counts = sent.sum(0, dtype=torch.int32)
        self._send_counters.copy_(counts)
        self._topk_target[:num_tokens, :top_k].copy_(target)
        self._topk_send[:num_tokens, :top_k].copy_(slot)
        # 3. payload rows to every target, slots in token order
        if num_tokens:  # byte views [T, bytes_per_token] (a reshape of 0 elements has no width)
            payloads = [p if p.dtype == torch.uint8 and p.dim() == 2 else p.reshape(num_tokens, -1).view(torch.uint8)
                        for p in payloads]
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
        # 4. every target learns how many tokens came from this rank, and with which rt
        self._recv_counters[:, me].copy_(counts)
        self._recv_rts[:, me].fill_(rt)
        # 5. the copies above have completed; then the flags
        self._dispatch_flags[:, me].fill_(rnd)
        # 6. every source's data is here
        self._wait(self._dispatch_flags[me], rnd, L.PHASE_DISPATCH)
        rts = self._recv_rts[me]
        wrong = (rts != rt).nonzero()
        if wrong.numel():
            peer = int(wrong[0, 0])
            peer_rt = int(rts[peer])
            self._skip_round(rnd)
            raise errors.InputError(
                f"job {self.att.job} rank {me}: rank {peer} passed runtime_max_tokens_per_rank={peer_rt} in round "
                f"{rnd}, this rank {rt}; every rank must pass the same: the round moved no data on every rank",
                argument="runtime_max_tokens_per_rank", peer=peer, peer_value=peer_rt, round=rnd,
            )
        self._round = rnd

    def _skip_round(self, rnd: int) -> None:
        """Complete round ``rnd`` without data (every rank does the same when their rts differ):
        the combine flags go round and the round number moves on, so the next round starts
        in step on every rank."""
        me = self.ep_rank
        self._combine_flags[:, me].fill_(rnd)
        self._wait(self._combine_flags[me], rnd, L.PHASE_COMBINE)
        self._flag_val.fill_(rnd + 1)
        self._round = None

    def sanitize(self, recv_ids: torch.Tensor, rt: int, invalid_id: int) -> None:
        """Set every id of every slot that received no token to ``invalid_id``.

        recv_ids: ``[ep_size, rt, top_k]`` int32 view of this rank's received expert ids.
        """
        counts = self._recv_counters[self.ep_rank].long()
        empty = torch.arange(rt).unsqueeze(0) >= counts.unsqueeze(1)  # [ep_size, rt]
        recv_ids.masked_fill_(empty.unsqueeze(2), invalid_id)

    def combine(self, payload: torch.Tensor, local_num_tokens: int, rt: int, pl: L.PayloadLayout,
                payload_in_workspace: bool) -> torch.Tensor:
        """Sum every token's expert outputs from the ranks it was sent to.

        payload: ``[ep_size, rt, hidden]`` bfloat16/float16/float32, the expert outputs
        for the tokens this rank received (row (s, j): source s, slot j); when
        ``payload_in_workspace`` it must be this rank's combine region.
        Returns ``[local_num_tokens, hidden]`` of the payload's dtype (float32 sums).
        """
        if self._round is None:
            raise errors.StateError("combine without a completed dispatch on this plane")
        me, ep = self.ep_rank, self.ep_size
        rnd = self._round
        dtype, hidden = payload.dtype, payload.shape[2]
        nbytes = ep * rt * hidden * payload.element_size()
        # [row q, source s, slot, hidden]: every rank's combine region
        regions = (
            self.ws[:, pl.combine_offset : pl.combine_offset + nbytes].view(dtype).unflatten(1, (ep, rt, hidden))
        )
        # 1. stage
        if not payload_in_workspace:
            regions[me].copy_(payload)
        # 2. the staged outputs are in place; then the flags
        self._combine_flags[:, me].fill_(rnd)
        # 3. every target's outputs for this rank are ready
        self._wait(self._combine_flags[me], rnd, L.PHASE_COMBINE)
        # 4. pull and sum in float32, over k in ascending order
        top_k = self.top_k
        target = self._topk_target[:local_num_tokens, :top_k].long()
        slot = self._topk_send[:local_num_tokens, :top_k].long()
        mine = regions[:, me]  # [target q, slot, hidden]: what q computed for this rank's tokens
        acc = torch.zeros(local_num_tokens, hidden, dtype=torch.float32)
        for k in range(top_k):
            tokens = (target[:, k] >= 0).nonzero().squeeze(1)
            if tokens.numel():
                acc.index_add_(0, tokens, mine[target[tokens, k], slot[tokens, k]].float())
        out = acc.to(dtype)
        # 5. next round
        self._flag_val.fill_(rnd + 1)
        self._round = None
        return out

    # --- waits and failures ---------------------------------------------------------
    def _wait(self, flags: torch.Tensor, rnd: int, phase: int) -> None:
        """Until every entry of ``flags`` (this rank's, one per peer) equals ``rnd``;
        bounded by the timeout and abandoned when the abort word is set."""
        cb = self.att.control
        start = time.monotonic_ns()
        deadline = start + int(self.timeout * 1e9)
        pause = _FIRST_SLEEP
        while True:
            pending = (flags != rnd).nonzero()
            if pending.numel() == 0:
                return
            now = time.monotonic_ns()
            if cb.abort_word != L.ABORT_NONE:
                code = L.STATUS_ABORTED
            elif now >= deadline:
                code = L.STATUS_TIMEOUT
            else:
                time.sleep(pause)
                pause = min(pause * 2, _MAX_SLEEP)
                continue
            peer = int(pending[0, 0])
            cb.record_status(self.ep_rank, code, peer, rnd, phase, now - start)
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

    def close(self) -> None:
        """Nothing to release (the attachment owns the mapping). Idempotent."""

    def __repr__(self) -> str:
        return f"HostPlane(rank={self.ep_rank}/{self.ep_size}, top_k={self.top_k}, timeout={self.timeout}s)"
