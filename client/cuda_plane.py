"""The CUDA data plane: dispatch / sanitize / combine as CUDA kernels over a mapped workspace.

Same interface as the host data plane (``host_plane.HostPlane``); ``MoeAlltoAll``
checks its inputs, computes the payload layout (``a2ad.layout.payload_layout``) and
calls one of them. Everything here is asynchronous on the current CUDA stream:
no call synchronizes, so dispatch and combine can be captured in CUDA graphs.
The protocol is docs/PROTOCOL.md; the kernels are csrc/dispatch.cu, combine.cu and sanitize.cu.

Failures: a kernel whose wait on a peer gives up (timeout, or the control
block's abort word) writes this rank's status record in the control block
(host memory) and returns. :meth:`CudaPlane.check` reads that record without
synchronizing and raises the typed error; ``MoeAlltoAll`` calls it at the start
of every call. Input the host cannot check without a sync (expert ids out of
range, a peer passing another ``runtime_max_tokens_per_rank``) is found by the
dispatch kernel, which completes the round anyway and writes this rank's input
record; :meth:`CudaPlane.check_input` raises it as InputError.

Everything fixed for this rank (the workspace, aux offsets, control block, timeout,
SM budget) is checked and kept once, as a *plan* (``torch.ops.a2ad.make_plan``
returns its handle); each call passes tensors, the handle and the per-call numbers, to
the extension module's functions of the same names as the ops (no dispatcher on the way).
"""

from __future__ import annotations

import ctypes
import mmap
import struct

import torch

from a2ad import errors, layout as L

from . import _ext
from .plane import Plane

#: True while torch.compile traces (Dynamo folds it to a constant); False when running.
_compiling = torch.compiler.is_compiling


def aux_offsets(aux: L.AuxLayout, lines_tail: int = 0) -> list[int]:
    """The ``aux`` list of the ops (``make_plan``): ``layout.aux_plan``, in the order of
    ``layout.AUX_PLAN_FIELDS``, from which csrc/layout.h's ``AuxOffsets`` is generated.
    ``lines_tail``: the rows' lines tail (0: none; the small combine then takes another path)."""
    return L.aux_plan(aux, lines_tail)


#: Diagnostic bits (csrc/moe_a2a.cuh kDiag*), TIMING ONLY: all but DIAG_DOUBLE_FENCE break
#: the protocol (wrong or stale data). They exist only in the timing build of the extension
#: (``A2AD_KERNEL_TIMING=1`` when it is first loaded, as a2ad.bench.kernel_timing does); a
#: production build refuses a plan with any of them. All act on dispatch.
DIAG_SKIP_COPY = 1  # no payload stores
DIAG_SKIP_FENCE = 2  # no block fence before the arrival (where the build has one)
DIAG_NO_WAIT = 4  # publish the ready words, do not wait for the peers'
DIAG_NO_PUBLISH = 8  # neither publish nor wait
DIAG_NOOP = 16  # the kernel returns at entry (launch / graph-node floor)
DIAG_DOUBLE_FENCE = 32  # one block fence more than the build has (correct; its cost by addition)
DIAG_NO_SPEC_CHECK = 64  # after the wait, no comparison of the peers' payload descriptors
DIAG_GPU_SCOPE_PUBLISH = 128  # the ready words released at gpu scope (wrong across GPUs)
DIAG_BITS = 255


#: BLOCK_COUNTERS slot the kernels use to elect the one writer of a status record.
STATUS_CLAIM_SLOT = L.SLOT_STATUS_CLAIM


def lines_tail_view(workspace: torch.Tensor, rank: int, lines_tail: int) -> torch.Tensor:
    """The ``layout.ROW_TAIL_BYTES`` of ``rank``'s lines tail (past the row, inside its stride)
    as a uint8 tensor."""
    if not workspace.stride(0) >= lines_tail + L.ROW_TAIL_BYTES or lines_tail < workspace.shape[1]:
        raise ValueError(f"no lines tail at {lines_tail} in rows of {workspace.shape[1]} bytes, "
                         f"stride {workspace.stride(0)}")
    return workspace.as_strided((L.ROW_TAIL_BYTES,), (1,), workspace.storage_offset() + rank * workspace.stride(0)
                                + lines_tail)


def initialize_row(workspace: torch.Tensor, rank: int, aux: L.AuxLayout, initial_round: int = L.INITIAL_ROUND,
                   lines_tail: int = 0) -> None:
    """Zero ``rank``'s aux region (and its lines tail, if ``lines_tail``) and set its FLAG_VAL
    (on the current stream).

    The daemon initializes rows itself; this is for tests that build a job in
    one process. Every rank of a job must be initialized to the same round.
    """
    _ext.load().initialize(workspace, rank, aux.aux_bytes, aux.flag_val, initial_round)
    if lines_tail:
        lines_tail_view(workspace, rank, lines_tail).zero_()


def sm_count(device: torch.device | int | None = None) -> int:
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
    return int(_ext.load().sm_count(index))


_LOADED_DEVICES: set[int] = set()


def _load_kernels(direct, device: torch.device) -> None:
    """Every kernel of the extension loaded on ``device`` once per process, before the first
    launch: under CUDA's lazy loading a kernel's first launch loads it, and that load can wait
    for a running kernel, so a rank's first sanitize would wait behind a peer rank's dispatch
    of the same process that is waiting for it (several ranks on one caller-owned workspace)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _LOADED_DEVICES:
        direct.load_kernels(index)
        _LOADED_DEVICES.add(index)


class CudaPlane(Plane):
    """Dispatch/combine kernels for one rank of an attached job.

    ``att`` is an :class:`a2ad.client.Attachment` (or any object with its
    attributes) whose ``workspace`` is a CUDA tensor. ``timeout`` (seconds)
    bounds every wait on a peer inside a kernel. ``sm_budget`` caps the SMs one
    launch assumes it may occupy (0: all of them); ranks that share one GPU
    (in-process tests) must split the SMs between them, since combine's blocks
    wait for each other and its grid is sized to be co-resident.
    """

    checks_ids_on_host = False
    supports_degraded_mode = True

    def __init__(self, att, timeout: float, *, sm_budget: int = 0):
        if not isinstance(att.workspace, torch.Tensor) or att.workspace.device.type != "cuda":
            raise errors.BackendError("CudaPlane needs a CUDA workspace (the job runs on the host backend?)")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._ops = _ext.load()
        self.att = att
        self.ep_rank = int(att.ep_rank)
        self.ep_size = int(att.ep_size)
        self.top_k = int(att.spec["top_k"])
        self.num_experts = int(att.spec["num_experts"])
        self.timeout = float(timeout)
        self.timeout_ns = max(1, int(self.timeout * 1e9))
        self._sm_budget = int(sm_budget)
        self._diag = 0  # timing build only
        #: Whether the job keeps serving without a lost rank (spec on_peer_loss="degrade"):
        #: the kernels then run each round among its view of the active mask (a prologue
        #: kernel before dispatch), and combine writes the per-token indicator and the
        #: ranks it counted (docs/PROTOCOL.md, "Degraded mode").
        self.degrade = att.spec.get("on_peer_loss") == "degrade"
        self._degraded: torch.Tensor | None = None
        self._combined = False
        self._seen_page: mmap.mmap | None = None
        self._seen_host: int | None = None
        self._seen_dev = 0
        #: degraded mode: the ranks the last combine counted, on the device (int64 [MASK_WORDS])
        self._seen_tensor: torch.Tensor | None = None
        self.plan: int | None = None
        host = att.control.address()
        with torch.cuda.device(att.workspace.device):
            # reference counted: several planes of one process may register the same block
            self.control_ptr = int(self._ops.host_register(host, L.CONTROL_BLOCK_SIZE))
        self._registered: int | None = host
        try:
            if self.degrade:
                # MASK_WORDS host-mapped words: the ranks the last combine counted, read without a sync
                self._seen_page = mmap.mmap(-1, mmap.PAGESIZE)
                self._seen_host = ctypes.addressof(ctypes.c_char.from_buffer(self._seen_page))
                with torch.cuda.device(att.workspace.device):
                    self._seen_dev = int(self._ops.host_register(self._seen_host, mmap.PAGESIZE))
                self._seen_tensor = torch.zeros(L.MASK_WORDS, dtype=torch.int64, device=att.workspace.device)
            self._make_plan()
        except BaseException:
            self.close()
            raise
        # the eager hot path: the extension's own functions (the ops' code without the
        # dispatcher); torch.compile, which cannot trace them, gets the ops
        direct = _ext.direct()
        _load_kernels(direct, att.workspace.device)
        self._ops_direct = direct
        self._dispatch_op = direct.dispatch
        self._combine_op = direct.combine
        self._sanitize_op = direct.sanitize

    def _make_plan(self) -> None:
        old, self.plan = self.plan, None
        if old is not None:
            self._ops.free_plan(old)
        self.plan = self._ops.make_plan(
            self.att.workspace, self.ep_rank, self.ep_size, self.top_k, self.num_experts,
            aux_offsets(self.att.aux, getattr(self.att, "lines_tail", 0)),
            self.control_ptr, self.timeout_ns, self._sm_budget, self._diag, self.degrade, self._seen_dev,
            self._seen_tensor.data_ptr() if self._seen_tensor is not None else 0,
        )

    @property
    def diag(self) -> int:
        """Diagnostic bits (timing build only, see DIAG_*); setting them makes a new plan."""
        return self._diag

    @diag.setter
    def diag(self, value: int) -> None:
        value = int(value)
        if not 0 <= value <= DIAG_BITS:
            raise ValueError(f"diag must be in [0, {DIAG_BITS}], got {value}")
        old, self._diag = self._diag, value
        try:
            self._make_plan()
        except BaseException:
            self._diag = old
            self._make_plan()
            raise

    @property
    def sm_budget(self) -> int:
        return self._sm_budget

    @sm_budget.setter
    def sm_budget(self, value: int) -> None:
        self._sm_budget = int(value)
        self._make_plan()

    # --- data plane ---------------------------------------------------------------
    def dispatch(self, experts: torch.Tensor, payloads: list[torch.Tensor], rt: int, pl: L.PayloadLayout,
                 num_experts: int, *, eplb_local_stats: torch.Tensor | None = None,
                 eplb_gathered: torch.Tensor | None = None, caller_mask: torch.Tensor | None = None) -> None:
        """Route and send this rank's tokens; returns once every peer's tokens are here (on the stream).

        experts: ``[T, top_k]`` int32, contiguous, on the workspace's device; an id outside
        ``[0, num_experts)`` is routed nowhere and reported by :meth:`check_input`.
        payloads: ``[T, ...]`` contiguous tensors of any dtype (``pl.dispatch_bytes_per_token[i]``
        bytes per token). The received payload i is ``workspace[ep_rank]`` at
        ``pl.dispatch_offsets[i]``, ``[ep_size, rt, bytes_i]``. The kernel publishes
        ``pl.spec`` with the data and compares every peer's with it (a difference: the round
        moves no data and :meth:`check_input` raises InputError on every rank).
        ``eplb_local_stats`` (int32 ``[pl.eplb_stats_num_experts]``, device) goes to every
        rank; ``eplb_gathered`` (int32 ``[ep_size, E]``, device) is filled on the stream.
        ``caller_mask``: a contiguous int64 tensor of n words, ``ceil(ep_size / 64) <= n <=
        MASK_WORDS`` (rank r: bit r & 63 of word r >> 6; words past n count as zero), read by
        the kernel when it is on the device (graphs replay its current value), its value now
        when on the CPU.
        """
        if num_experts != self.num_experts:
            raise errors.InputError(f"num_experts {num_experts} differs from the job's {self.num_experts}")
        op = self._dispatch_op if not _compiling() else self._ops.dispatch.default
        spec = list(pl.spec) if pl.spec else []
        if not pl.eplb_stats_num_experts and caller_mask is None:
            op(experts, payloads, self.att.workspace, self.plan, rt, pl.dispatch_offsets, spec)
            return
        op(experts, payloads, self.att.workspace, self.plan, rt, pl.dispatch_offsets, spec,
           eplb_local_stats, eplb_gathered, pl.eplb_offset, caller_mask, -1)

    def dispatch_pairs(self, x: torch.Tensor, topk_idx: torch.Tensor, rt: int, pl: L.PayloadLayout, *,
                       caller_mask: torch.Tensor | None = None) -> None:
        """Dispatch a round whose tokens are the (token, k) pairs of ``topk_idx`` ``[T, K]``
        (int64 or int32, contiguous; a2ad.deep_ep's; the job's top_k is 1): each pair with an
        expert (id >= 0) sends row ``t`` of ``x`` (contiguous ``[T, hidden]``) and its metadata
        ``(t, id)`` (two int32, written by the kernel) to the owner of its expert; a pair with
        id < 0 sends nothing. ``pl`` is the layout of the payloads ``x``-rows and ``[2]``
        int32; an id >= num_experts is routed nowhere and reported as :meth:`dispatch`'s are.
        One kernel: no per-pair copy of the rows is made first."""
        self._ops_direct.dispatch_pairs(x, topk_idx, self.att.workspace, self.plan, rt, pl.dispatch_offsets,
                                        list(pl.spec), caller_mask, -1)

    def sanitize(self, recv_ids: torch.Tensor, rt: int, invalid_id: int) -> None:
        """Set every id of every slot that received no token to ``invalid_id``.

        recv_ids: ``[ep_size, rt, top_k]`` int32 view of this rank's received expert ids.
        """
        op = self._sanitize_op if not _compiling() else self._ops.sanitize.default
        op(recv_ids, self.att.workspace, self.plan, rt, invalid_id)

    def combine(self, payload: torch.Tensor, local_num_tokens: int, rt: int, pl: L.PayloadLayout,
                payload_in_workspace: bool, *, output: torch.Tensor | None = None, low_precision: bool = False,
                caller_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sum every token's expert outputs from the ranks it was sent to.

        payload: ``[ep_size, rt, hidden]`` bfloat16/float16/float32, the expert outputs
        for the tokens this rank received (row (s, j): source s, slot j); when
        ``payload_in_workspace`` it must be this rank's combine region.
        Returns ``[local_num_tokens, hidden]`` of the payload's dtype (written into ``output``
        when given). ``low_precision`` (bfloat16, hidden % FP8_BLOCK == 0): the rows peers
        pull are FP8 e4m3 with one power-of-two scale per FP8_BLOCK elements, quantized
        while staging (host_plane.quantize_fp8 has the same bits); this rank's own rows are
        summed unquantized. The combine descriptor travels with the flag: a target that
        published another one contributes nothing and :meth:`check_input` raises.
        """
        op = self._combine_op if not _compiling() else self._ops.combine.default
        hidden = payload.shape[-1]
        spec = L.combine_spec(hidden, payload.dtype, low_precision, payload_in_workspace)
        offset = pl.combine_offset
        if low_precision:
            from .host_plane import check_fp8_combine

            check_fp8_combine(payload)
            if payload_in_workspace:
                expect = self.att.workspace[self.ep_rank, pl.combine_offset:]
                if payload.data_ptr() != expect.data_ptr():
                    raise errors.InputError("payload_in_workspace=True but payload is not this rank's combine region",
                                            argument="payload")
            offset = L.fp8_combine_offset(pl, self.ep_size, hidden, payload_in_workspace)
        # under torch.compile the op returns a fresh tensor (no aliasing of an input)
        out_arg = output if not _compiling() else None
        degraded = None
        if self.degrade:
            degraded = torch.empty(local_num_tokens, dtype=torch.bool, device=payload.device)
        if out_arg is None and not low_precision and caller_mask is None:
            if degraded is None:
                out = op(payload, self.att.workspace, self.plan, local_num_tokens, rt, offset, payload_in_workspace,
                         None, None, False, spec)
            else:
                out = op(payload, self.att.workspace, self.plan, local_num_tokens, rt, offset, payload_in_workspace,
                         degraded, None, False, spec)
        else:
            out = op(payload, self.att.workspace, self.plan, local_num_tokens, rt, offset, payload_in_workspace,
                     degraded, out_arg, low_precision, spec, caller_mask, -1)
        if degraded is not None:
            self._degraded = degraded
            self._combined = True
        if output is not None and out_arg is None:
            output.copy_(out)
            return output
        return out

    def combine_pairs(self, x: torch.Tensor, stage_index: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                      output: torch.Tensor, rt: int, pl: L.PayloadLayout, *, caller_mask=None) -> None:
        """Combine a round whose tokens are the (token, k) pairs of ``topk_idx`` ``[T, K]``
        (a2ad.deep_ep; the job's top_k is 1): ``x`` holds the expert outputs (contiguous bf16
        rows), slot (s, j)'s being row ``stage_index[s * rt + j]``; ``output`` bf16 ``[T,
        hidden]`` gets each token's sum over k of ``weights[t, k]`` times its pair's row, in
        float32 in k order, rounded once (pairs with a negative id left out). One kernel: the
        staging reads x through stage_index, and the pull sums the weighted pairs."""
        hidden = x.shape[-1]
        spec = L.combine_spec(hidden, x.dtype, False, False)
        degraded = None
        if self.degrade:
            degraded = torch.empty(topk_idx.shape[0], dtype=torch.bool, device=x.device)
        self._ops_direct.combine_pairs(x, self.att.workspace, self.plan, rt, pl.combine_offset, stage_index, topk_idx,
                                       weights, output, degraded, spec, caller_mask, -1)
        if degraded is not None:
            self._degraded = degraded
            self._combined = True

    def degraded_tokens(self) -> torch.Tensor | None:
        """``[local_num_tokens]`` bool on the device, of the last combine (degrade jobs): True for
        a token that lost at least one expert's contribution. Written by the kernel: read it
        on the stream, or after it ran."""
        return self._degraded

    def round_mask(self) -> int | None:
        """The ranks whose contributions the last combine counted (degrade jobs), from
        host-mapped memory without a sync: the value of the last combine that ran on the
        stream (read it after synchronizing for the one just queued)."""
        if not self._combined or self._seen_page is None:
            return None
        return L.mask_from_words(struct.unpack_from(f"<{L.MASK_WORDS}Q", self._seen_page, 0))

    def round_mask_tensor(self) -> torch.Tensor | None:
        """The same mask as :meth:`round_mask`, as an int64 ``[MASK_WORDS]`` tensor on the device
        (rank q: bit q & 63 of word q >> 6) that the last combine wrote on the stream: a model may
        use it without a sync."""
        return self._seen_tensor if self._combined else None

    # --- failures -----------------------------------------------------------------
    def check(self) -> None:
        """Raise if a peer was lost or an earlier kernel's wait gave up. Never synchronizes.

        Reads the abort word and this rank's status record from host memory. A
        kernel still in flight may write its record later; the next call sees it.
        """
        self.att.control.raise_for(self.ep_rank, self.att.job)

    def check_input(self) -> None:
        """Raise InputError for what a dispatch kernel found wrong in this rank's input (and
        clear it). Never synchronizes: a kernel still in flight reports at a later call."""
        self.att.control.raise_input_error(self.ep_rank, self.att.job, self.num_experts)

    def reset_status(self) -> None:
        """Clear this rank's status record and the kernels' record claim (call only when the job is re-armed).

        The claim is cleared on the current stream, so kernels queued after this
        call can record a new failure.
        """
        self.att.control.clear_status(self.ep_rank)
        self.att.control.clear_input_error(self.ep_rank)
        off = self.att.aux.block_counters + 4 * STATUS_CLAIM_SLOT
        self.att.workspace[self.ep_rank, off : off + 4].zero_()

    def close(self) -> None:
        """Unregister the control block (reference counted). Idempotent.

        Call it before the attachment closes (the control block must still be
        mapped), and only once no kernel of this plane is in flight.
        """
        if self.plan is not None:
            plan, self.plan = self.plan, None
            self._ops.free_plan(plan)
        if self._registered is not None:
            host, self._registered = self._registered, None
            self._ops.host_unregister(host)
        if self._seen_host is not None:
            host, self._seen_host = self._seen_host, None
            self._ops.host_unregister(host)
        if self._seen_page is not None:
            page, self._seen_page = self._seen_page, None
            try:
                page.close()
            except BufferError:  # a view of it is still alive somewhere: the GC frees it
                pass

    def __repr__(self) -> str:
        return (
            f"CudaPlane(rank={self.ep_rank}/{self.ep_size}, top_k={self.top_k}, timeout={self.timeout}s, "
            f"sm_budget={self.sm_budget or 'all'}"
            + (f", diag={self.diag} (timing only)" if self.diag else "")
            + ")"
        )
