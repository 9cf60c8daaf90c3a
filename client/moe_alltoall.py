"""``MoeAlltoAll``: MoE expert-parallel dispatch and combine over a daemon-owned workspace.

The API mirrors FlashInfer's ``MoeAlltoAll`` throughput backend
(``flashinfer.comm.trtllm_moe_alltoall``): construct it on every rank of an
expert-parallel group, then per round ``dispatch`` the tokens to the ranks that own
their experts, run the local experts on what arrived, and ``combine`` the outputs
back. Unlike FlashInfer's MoeAlltoAll, the workspace is allocated by the a2ad daemon and mapped
through :func:`a2ad.client.attach`, every input is checked before anything is
written to a peer (:class:`~a2ad.errors.InputError`), calls out of order raise
:class:`~a2ad.errors.StateError`, and every wait on a peer is bounded
(:class:`~a2ad.errors.PeerTimeout`, :class:`~a2ad.errors.PeerLost`).

The data movement itself is a *plane* chosen by the job's backend:
``host_plane.HostPlane`` (shared host memory) or ``cuda_plane.CudaPlane`` (CUDA
kernels). The protocol both follow is docs/PROTOCOL.md.

Where the combine region lives
------------------------------
Dispatch regions start at PAYLOAD_DATA and their extent depends on the round's
``runtime_max_tokens_per_rank`` and payload widths. In combine every rank *reads*
its peers' combine regions, and a fast rank that finished combine R starts
dispatch R+1 and writes into the rows that slower ranks are still reading. Were
the combine region placed right after the dispatch regions (``PayloadLayout.
combine_offset``), a round with a larger ``runtime_max_tokens_per_rank`` would
overwrite the previous round's combine data while it is being read. So the combine
region sits at the end of the row (128-byte aligned), the plane receives that
offset in the ``PayloadLayout`` it is given, and a dispatch whose regions would
reach into the previous round's combine region is refused (InputError on every
rank alike); a workspace sized for the dispatch and combine payloads together
(``get_moe_workspace_size_per_rank``) never hits that.
"""

from __future__ import annotations

import warnings

import torch

from a2ad import errors, layout as L, protocol
from a2ad.layout import (  # noqa: F401  (metainfo index names, re-exported)
    BLOCK_COUNTERS_OFFSET_INDEX,
    COMBINE_COMPLETION_FLAGS_OFFSET_INDEX,
    DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX,
    FLAG_VAL_OFFSET_INDEX,
    LOCAL_TOKEN_COUNTER_OFFSET_INDEX,
    METAINFO_INDEX,
    NUM_METAINFO_FIELDS,
    PAYLOAD_DATA_OFFSET_INDEX,
    RECV_COUNTERS_OFFSET_INDEX,
    SEND_COUNTERS_OFFSET_INDEX,
    TOPK_SEND_INDICES_OFFSET_INDEX,
    TOPK_TARGET_RANKS_OFFSET_INDEX,
)

from .frontend import COMBINE_DTYPES, FUNCTIONAL_OWNER, UNMAPPED, Front, int_arg as _int_arg, tensor_arg as _tensor_arg  # noqa: F401,E501

__all__ = [
    "MoeAlltoAll",
    "moe_a2a_get_workspace_size_per_rank",
    "moe_a2a_wrap_payload_tensor_in_workspace",
    *METAINFO_INDEX,
]

#: True while torch.compile traces (Dynamo folds it to a constant); False when running.
_compiling = torch.compiler.is_compiling


def _check_backend(backend) -> None:
    from .ops import check_backend

    check_backend(backend)


def moe_a2a_get_workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    eplb_stats_num_experts: int = 0,
    *,
    backend: str = "trtllm",
) -> int:
    """Bytes per rank for payloads of the given per-token sizes (aux region, and the EPLB
    stats region of ``eplb_stats_num_experts`` experts, included)."""
    _check_backend(backend)
    if eplb_stats_num_experts:
        eplb = _int_arg("eplb_stats_num_experts", eplb_stats_num_experts, 0)
        try:
            return L.workspace_size_per_rank(
                ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token,
                eplb_stats_num_experts=eplb,
            )
        except TypeError:
            raise errors.InputError(
                "eplb_stats_num_experts > 0 needs a layout with an EPLB region, which this build lacks",
                argument="eplb_stats_num_experts") from None
    return L.workspace_size_per_rank(
        ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token
    )


def moe_a2a_wrap_payload_tensor_in_workspace(
    workspace: torch.Tensor,
    leading_shape: list[int] | tuple[int, ...],
    slice_start: int,
    slice_end: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A typed view ``[*leading_shape, -1]`` of the bytes ``[slice_start, slice_end)`` of one row.

    ``workspace``: ``[ep_size, size_per_rank]`` uint8 (then ``slice_start`` counts from
    the start of row 0 in units of ``stride(0)``, so it picks the row too) or one row
    ``[size_per_rank]``. The slice must lie inside one row and be aligned to ``dtype``.
    """
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or workspace.dim() not in (1, 2):
        raise errors.InputError("workspace must be a [ep_size, size_per_rank] or [size_per_rank] uint8 tensor")
    rows = workspace.unsqueeze(0) if workspace.dim() == 1 else workspace
    if not 0 <= slice_start <= slice_end:
        raise errors.InputError(f"slice [{slice_start}, {slice_end}) is not a valid byte range")
    row, start = divmod(slice_start, rows.stride(0)) if rows.shape[0] > 1 else (0, slice_start)
    end = start + (slice_end - slice_start)
    if row >= rows.shape[0] or end > rows.shape[1]:
        raise errors.InputError(
            f"slice [{slice_start}, {slice_end}) does not lie inside one row of {rows.shape[1]} bytes"
        )
    try:
        return rows[row, start:end].view(dtype).view(*leading_shape, -1)
    except RuntimeError as exc:
        raise errors.InputError(
            f"bytes [{start}, {end}) of row {row} do not make a [{', '.join(map(str, leading_shape))}, -1] "
            f"tensor of {dtype}: {exc}"
        ) from None


class MoeAlltoAll:
    """One rank's MoE all-to-all over a workspace owned by the a2ad daemon.

    FlashInfer's arguments, with its names and defaults:

    ``mapping``: any object with ``moe_ep_rank`` and ``moe_ep_size``.
    ``max_num_tokens``: the most tokens any rank passes to one dispatch.
    ``top_k``: experts per token (at most 22). ``num_experts``: experts in the model,
    partitioned contiguously over the ranks (at least ``ep_size``).
    ``workspace_size_per_rank``: bytes per rank; when None it is
    :meth:`get_moe_workspace_size_per_rank` for ``hidden_size`` (bf16 hidden states,
    int32 expert ids and float32 scales per token, bf16 combine).
    ``mnnvl_config``: the daemon allocates the workspace and picks the handle type, so
    only its ``comm_backend`` is used: to agree on a job name when ``job`` is not given.
    ``eplb_stats_num_experts``: experts of the EPLB statistics gathered in every dispatch
    that passes ``eplb_local_stats`` (0: none). ``enable_rank_mask``: whether dispatch and
    combine take an ``active_rank_mask`` (combined with the job's own mask); when True, every
    dispatch and combine must pass one (as in FlashInfer, a call without one is refused with
    InputError rather than taken to mean every rank).
    ``backend``: "trtllm" (the default) is accepted; a2ad's planes are its own, and any
    other value ("cake") is refused with InputError.

    a2ad's own, keyword-only: ``job``: the job name every rank of the group uses (unique
    on the machine). When None the ranks agree on a new one through the communicator
    FlashInfer callers already have (``client/jobname.py``: ``mnnvl_config.comm_backend``,
    FlashInfer's ``MnnvlMemory.comm``, the default torch.distributed group, or mpi4py's
    COMM_WORLD under MPI); without
    any, InputError says to pass ``job=``. With ``moe_ep_size == 1`` neither is needed: the
    rank takes a name of its own, unique on the machine. ``runtime_dir``: the daemon's runtime folder
    (default: the daemon's default). ``device``: this rank's device (cuda backend: a CUDA
    device; default the current one). ``timeout``: seconds for the rendezvous and for
    every wait on a peer.

    The constructor joins the job and returns once every rank has joined. A daemon restart
    while it waits is ridden out: the join is sent again to the next daemon within the same
    ``timeout`` (DaemonUnavailable when none listened again in time). Call
    :meth:`close` (or use it as a context manager) to leave.

    Several objects of one geometry and rank in one process (one per layer, say) share one
    attachment (:func:`a2ad.client.attach`), as FlashInfer's instances share a workspace:
    the same workspace, lease and round counter; the first joins, the others attach at
    once (with ``job=``: their ``max_num_tokens``, ``top_k``, ``num_experts``, workspace
    size and device must be identical, else SpecMismatch; without it, another geometry is
    another job), and the job is left when the last of them closes. The rank's workspace
    holds one round at a time, so their rounds must not overlap: dispatch on one, combine
    on it, then the next (a dispatch while another object's round is open raises
    StateError). Every rank must run the same sequence of rounds (the objects' order is
    free, but a round's payload shapes must match across ranks), issue them in order (on
    CUDA: on one stream, or synchronized), and not from several threads at once. After a
    failure, recover() on any one of them re-arms the rank for all.

    ``on_peer_loss``: what the job does when a rank dies or leaves while it runs; part of
    the job's spec, so every rank must pass the same (else SpecMismatch). ``"raise"`` (the
    default): every rank raises PeerLost and calls :meth:`recover` once a replacement
    joined. ``"degrade"``: the others keep serving; tokens routed to the lost rank's
    experts get no contribution from it, :attr:`last_round_degraded` says which tokens
    lost one, :attr:`active_ranks` which ranks serve, and a replacement that joins as the
    lost rank is let back in at a round boundary without the others calling anything
    (README, "Degraded mode"; docs/PROTOCOL.md).

    Under ``torch.compile(fullgraph=True)`` :meth:`dispatch` and :meth:`combine` run the
    functional ops (``client/ops.py``); compile the round's dispatch and combine together.
    """

    def __init__(
        self,
        mapping,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        workspace_size_per_rank: int | None = None,
        hidden_size: int | None = None,
        mnnvl_config=None,
        eplb_stats_num_experts: int = 0,
        enable_rank_mask: bool = False,
        *,
        backend: str = "trtllm",
        job: str | None = None,
        runtime_dir=None,
        device=None,
        timeout: float = 60.0,
        on_peer_loss: str = "raise",
    ):
        self._att = None
        self._plane = None
        self._front = None
        self._token = None
        self._closed = True  # until attached: nothing to close or warn about
        _check_backend(backend)
        try:
            ep_rank, ep_size = int(mapping.moe_ep_rank), int(mapping.moe_ep_size)
        except AttributeError:
            raise errors.InputError("mapping must have moe_ep_rank and moe_ep_size", argument="mapping") from None
        ep_size = _int_arg("moe_ep_size", ep_size, 1, L.MAX_EP_SIZE)
        ep_rank = _int_arg("moe_ep_rank", ep_rank, 0, ep_size - 1)
        max_num_tokens = _int_arg("max_num_tokens", max_num_tokens, 1)
        top_k = _int_arg("top_k", top_k, 1, L.MAX_TOP_K)
        num_experts = _int_arg("num_experts", num_experts, ep_size)
        eplb_stats_num_experts = _int_arg("eplb_stats_num_experts", eplb_stats_num_experts, 0)
        if enable_rank_mask is not True and enable_rank_mask is not False:
            raise errors.InputError("enable_rank_mask must be a bool", argument="enable_rank_mask")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise errors.InputError(f"timeout must be a positive number of seconds, got {timeout!r}", argument="timeout")
        if on_peer_loss not in protocol.PEER_LOSS_POLICIES:
            raise errors.InputError(f"on_peer_loss must be 'raise' or 'degrade', got {on_peer_loss!r:.40}",
                                    argument="on_peer_loss")
        if workspace_size_per_rank is None:
            if hidden_size is None:
                raise errors.InputError("give workspace_size_per_rank or hidden_size", argument="hidden_size")
            hidden_size = _int_arg("hidden_size", hidden_size, 1)
            workspace_size_per_rank = self.get_moe_workspace_size_per_rank(
                ep_size, top_k, max_num_tokens, hidden_size, eplb_stats_num_experts=eplb_stats_num_experts)
        workspace_size_per_rank = _int_arg("workspace_size_per_rank", workspace_size_per_rank, 1)

        from . import jobname
        from .attach import attach, held

        self.max_num_tokens = max_num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.workspace_size_per_rank = workspace_size_per_rank
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self.enable_eplb = eplb_stats_num_experts > 0
        self.enable_rank_mask = enable_rank_mask
        self.timeout = float(timeout)
        self._backend = backend
        self.mnnvl_mem = None  # FlashInfer's MNNVL allocation: the daemon's here
        if job is None:
            key = (str(runtime_dir), ep_rank, ep_size, max_num_tokens, top_k, num_experts, workspace_size_per_rank,
                   eplb_stats_num_experts, on_peer_loss, str(device))
            job = jobname.agree(key, ep_rank, ep_size, mnnvl_config, lambda name: held(runtime_dir, name, ep_rank),
                                label=f"{ep_size}x{max_num_tokens}")
        self._att = attach(
            job,
            ep_rank,
            ep_size,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            num_experts=num_experts,
            workspace_size_per_rank=workspace_size_per_rank,
            runtime_dir=runtime_dir,
            device=device,
            timeout=float(timeout),
            on_peer_loss=on_peer_loss,
        )
        try:
            if self._att.backend == "cuda":
                from .cuda_plane import CudaPlane as plane_cls
            else:
                from .host_plane import HostPlane as plane_cls
            if on_peer_loss == "degrade" and not getattr(plane_cls, "supports_degraded_mode", False):
                raise errors.BackendError(
                    f"on_peer_loss='degrade' needs a data plane that honours the active-rank mask; the "
                    f"{self._att.backend} backend's plane does not yet: use on_peer_loss='raise' there"
                )
            self._plane = plane_cls(self._att, self.timeout)
        except BaseException:
            self._att.close()
            raise
        self._closed = False
        #: This rank's rounds (the round in flight and where the last combine region starts)
        #: belong to the attachment, which other MoeAlltoAll objects may share; this token
        #: marks the round this object dispatched.
        self._token = object()
        #: the validation boundary and round object, shared with the functional ops
        self._front = Front(self._att, self._plane, eplb_stats_num_experts=eplb_stats_num_experts)
        self._metainfo = self._front.metainfo
        self._device = self._att.device
        self._ws = self._att.workspace
        self._eplb_gathered = None
        self._traced = None
        # the functional ops (torch.ops.a2ad.moe_a2a_*) find this rank's front end by its workspace
        from .ops import register_plane

        register_plane(self, self._att, self._plane, self._front)

    @staticmethod
    def get_moe_workspace_size_per_rank(
        ep_size: int, top_k: int, max_num_tokens: int, hidden_size: int, extra_payload_bytes_per_token: int = 0,
        eplb_stats_num_experts: int = 0, *, backend: str = "trtllm",
    ) -> int:
        """Bytes per rank for bf16 hidden states, int32 expert ids and float32 scales per token
        (plus ``extra_payload_bytes_per_token``) and a bf16 combine (and the EPLB stats region)."""
        dispatch = 2 * hidden_size + 4 * top_k + 4 * top_k + extra_payload_bytes_per_token
        return moe_a2a_get_workspace_size_per_rank(
            ep_size, max_num_tokens, dispatch, 2 * hidden_size, eplb_stats_num_experts, backend=backend)

    # --- properties -----------------------------------------------------------------
    @property
    def workspace(self) -> torch.Tensor:
        """``[ep_size, size_per_rank]`` uint8, row q is rank q's memory (stride(0) is the row stride)."""
        return self._live().workspace

    @property
    def ep_rank(self) -> int:
        return self._att.ep_rank

    @property
    def ep_size(self) -> int:
        return self._att.ep_size

    @property
    def backend(self) -> str:
        """FlashInfer's backend name this object was made with ("trtllm")."""
        return self._backend

    @property
    def eplb_gathered_stats(self) -> torch.Tensor | None:
        """``[ep_size, eplb_stats_num_experts]`` int32 of this object's open round (row r: rank r's
        ``eplb_local_stats``), or None (no EPLB, no stats passed, or no round open). Valid
        between :meth:`dispatch` and :meth:`combine`, as FlashInfer's."""
        return self._eplb_gathered if self._round is not None else None

    @property
    def metainfo(self) -> torch.Tensor:
        """``[NUM_METAINFO_FIELDS]`` int64 (CPU): byte offsets of the aux fields in every row,
        indexed by the ``*_OFFSET_INDEX`` names."""
        return self._metainfo

    @property
    def attachment(self):
        """The :class:`a2ad.client.Attachment` this object runs on."""
        return self._att

    @property
    def on_peer_loss(self) -> str:
        """The job's peer-loss policy: "raise" or "degrade"."""
        return self._att.on_peer_loss

    @property
    def active_ranks(self) -> list[int]:
        """The ranks that serve now: a host read of the control block, no sync (the daemon
        updates it when a rank dies, leaves, or a replacement attached). A round in flight
        may still run among the ranks read at its dispatch; see :attr:`last_round_active_ranks`
        for what a combine counted. Raise jobs: every rank."""
        return self._live().active_ranks

    @property
    def last_round_degraded(self) -> torch.Tensor | None:
        """``[local_num_tokens]`` bool of this object's last combine: True for each token that
        lost at least one expert's contribution (one of its top_k experts lives on a rank
        outside :attr:`last_round_active_ranks`); its output holds only the other experts'
        sum, zeros when all were lost. A model may renormalise such tokens' router weights
        over the experts that remain (README, "Degraded mode"). All False in a round that lost
        nothing; None before the first combine (and on a backend whose plane has no degraded
        mode: its rounds never lose a contribution, they raise)."""
        return self._plane.degraded_tokens() if self._plane is not None else None

    @property
    def last_round_active_mask(self) -> torch.Tensor | None:
        """The ranks of :attr:`last_round_active_ranks` as a bit mask in int64 ``[MASK_WORDS]``
        words on this rank's device (rank q counted: bit q & 63 of word q >> 6), written by the
        combine in stream order: a model can tell which of a token's experts counted without a
        sync, ``(mask[owner >> 6] >> (owner & 63)) & 1`` with ``owner = owner_of[topk_ids]``
        (int64). None before the first combine."""
        return self._plane.round_mask_tensor() if self._plane is not None else None

    @property
    def last_round_active_ranks(self) -> list[int] | None:
        """The ranks whose contributions this object's last combine summed (the combine's view
        of the active mask, which decides a round that a rank's loss straddled); None before
        the first combine."""
        mask = self._plane.round_mask() if self._plane is not None else None
        return None if mask is None else L.mask_ranks(mask)

    @property
    def phase(self) -> str:
        """``"idle"``, ``"dispatched"`` or ``"closed"``."""
        if self._closed:
            return "closed"
        return "idle" if self._round is None else "dispatched"

    def _live(self):
        if self._closed:
            raise errors.StateError("this MoeAlltoAll is closed")
        if self._att.forked:
            raise errors.StateError(
                "this MoeAlltoAll was inherited through fork: its attachment is the parent's; create one in this process"
            )
        return self._att

    @property
    def _round(self):
        """The round this object dispatched and has not combined yet."""
        rounds = self._att.rounds
        return rounds.round if rounds.owner is self._token else None

    def _end_round(self) -> None:
        rounds = self._att.rounds
        if rounds.owner is self._token:
            rounds.owner = rounds.round = None
        self._eplb_gathered = None

    def _caller_mask(self, active_rank_mask):
        if active_rank_mask is None:
            if self.enable_rank_mask:
                from .ops import _no_mask_error

                raise _no_mask_error()
            return None
        if not self.enable_rank_mask:
            raise errors.InputError(
                "active_rank_mask requires the instance to have been constructed with enable_rank_mask=True",
                argument="active_rank_mask")
        from .frontend import rank_mask_arg

        return rank_mask_arg("active_rank_mask", active_rank_mask, self._front.ep_rank, self._front.ep_size,
                             self._device)

    # --- dispatch -------------------------------------------------------------------
    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        invalid_token_expert_id: int | None = None,
        expert_id_payload_index: int | None = None,
        eplb_local_stats: torch.Tensor | None = None,
        active_rank_mask: torch.Tensor | None = None,
        *,
        enable_pdl: bool | None = None,
    ) -> list[torch.Tensor]:
        """Send every local token to the ranks owning its experts; return what this rank received.

        token_selected_experts: ``[local_num_tokens, top_k]`` int32 (int64 is converted),
        ids in ``[0, num_experts)``.
        input_payloads: 1 to 6 tensors ``[local_num_tokens, ...]`` of any dtype, on this
        rank's device.
        runtime_max_tokens_per_rank: the most tokens any rank passes in this round
        (``local_num_tokens <= it <= max_num_tokens``); every rank must pass the same value.
        invalid_token_expert_id, expert_id_payload_index: give both to overwrite, in the
        received int32 payload ``expert_id_payload_index``, every id of every slot that
        received no token with ``invalid_token_expert_id``.
        eplb_local_stats: ``[eplb_stats_num_experts]`` int32, this rank's EPLB statistics,
        gathered from every rank in this round into :attr:`eplb_gathered_stats`.
        active_rank_mask: with ``enable_rank_mask=True``, the ranks to run among
        (:func:`moe_a2a_active_rank_mask`'s CPU uint64 tensor, or an int64/uint64 tensor of
        ``ceil(ep_size / 64)`` to MASK_WORDS words, rank q being bit q & 63 of word q >> 6, on
        the CPU or on this rank's device, where it may change between CUDA graph replays),
        combined with the job's own mask; this rank's bit must be set. Required (InputError,
        before anything is written or waited for) when ``enable_rank_mask=True``.
        enable_pdl: accepted, no effect.

        Returns one workspace-backed tensor per payload, ``[ep_size, runtime_max_tokens_per_rank,
        elements_per_token]`` of the payload's dtype: row (s, j) is the token source rank s
        put in slot j; slots from RECV_COUNTERS[s] on hold no token. They are valid until
        this rank calls :meth:`combine` (from then on peers may write the next round's tokens
        there), so copy what must outlive combine. Afterwards the state is "dispatched":
        call :meth:`combine`.

        Raises InputError (bad shapes, dtypes or devices; nothing was written anywhere, the
        state is unchanged), StateError (not idle, closed, or unmapped by
        :meth:`checkpoint_prepare`), PeerTimeout / PeerLost (a peer did not arrive or was
        lost; every later call raises it again until the job is re-armed).

        No call synchronizes with the GPU. What only the data can tell is found by the
        dispatch kernel, which completes the round for every rank anyway: an expert id outside
        ``[0, num_experts)`` is routed nowhere, and ranks that passed different
        ``runtime_max_tokens_per_rank`` get a round without data (combine returns zeros). Each
        is raised as InputError by a later call of this rank (the combine of the round or a
        later one, the next dispatch, or :meth:`check`), naming the token and id or the peer
        and its value; the job goes on. On the host backend both raise at once.
        """
        if _compiling():
            return self._dispatch_traced(token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                                         invalid_token_expert_id, expert_id_payload_index, eplb_local_stats,
                                         active_rank_mask)
        if self._closed or self._att.forked:
            self._live()
        mask = self._caller_mask(active_rank_mask) if active_rank_mask is not None or self.enable_rank_mask else None
        received, _, eplb = self._front.dispatch(
            self._token, token_selected_experts, input_payloads, runtime_max_tokens_per_rank, self.top_k,
            self.num_experts, invalid_id=invalid_token_expert_id, ids_index=expert_id_payload_index,
            eplb_local_stats=eplb_local_stats, caller_mask=mask,
        )
        self._eplb_gathered = eplb
        return received

    def _dispatch_traced(self, experts, payloads, rt, invalid_id, ids_index, eplb_local_stats, active_rank_mask):
        """Under torch.compile: the functional ops (their fake implementations trace)."""
        from . import ops

        if eplb_local_stats is not None:
            raise errors.InputError("eplb_local_stats is not supported inside torch.compile; dispatch it eagerly",
                                    argument="eplb_local_stats")
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise errors.InputError(
                "active_rank_mask requires the instance to have been constructed with enable_rank_mask=True",
                argument="active_rank_mask")
        ep_rank, ep_size = self._front.ep_rank, self._front.ep_size
        received, cpo, _ = ops.moe_a2a_dispatch(
            experts, payloads, self._ws, self._metainfo, rt, ep_rank, ep_size, self.top_k, self.num_experts,
            enable_rank_mask=self.enable_rank_mask, active_rank_mask=active_rank_mask,
        )
        if invalid_id is not None:
            ops.moe_a2a_sanitize_expert_ids(received[ids_index], self._ws, self._metainfo, ep_rank, invalid_id)
        self._traced = (experts.shape[0], cpo)
        return received

    # --- combine --------------------------------------------------------------------
    def get_combine_payload_tensor_in_workspace(
        self, runtime_max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's combine region as ``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` of ``dtype``.

        Write the expert outputs there, then ``combine(..., payload_in_workspace=True)``
        skips the staging copy. Only between dispatch and combine; it lies at the end of
        the row and does not overlap the dispatch results.
        """
        self._live()
        rnd = self._round
        if rnd is None:
            raise errors.StateError("get_combine_payload_tensor_in_workspace called before dispatch: the state is idle")
        rt = _int_arg("runtime_max_tokens_per_rank", runtime_max_tokens_per_rank, 1, self.max_num_tokens)
        if rt != rnd.rt:
            raise errors.InputError(
                f"runtime_max_tokens_per_rank ({rt}) differs from this round's dispatch ({rnd.rt})",
                argument="runtime_max_tokens_per_rank")
        hidden = _int_arg("hidden_size", hidden_size, 1)
        return self._front.combine_region(rnd, hidden, dtype)

    def combine(
        self,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        payload_in_workspace: bool = False,
        output_dtype: torch.dtype | None = None,
        output_scales: torch.Tensor | None = None,
        output_scalar_scale: float = 1.0,
        sf_layout=None,
        output: torch.Tensor | None = None,
        *,
        use_low_precision: bool = False,
        active_rank_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return every local token's expert outputs, summed over the ranks it was sent to.

        payload: ``[ep_size, runtime_max_tokens_per_rank, hidden]`` bfloat16, float16 or
        float32: row (s, j) is the output for the token source s put in slot j (rows of
        empty slots are ignored). With ``payload_in_workspace`` it must be the tensor
        :meth:`get_combine_payload_tensor_in_workspace` returned (or FlashInfer's placement
        at the round's combine_payload_offset); anything else is refused with InputError.
        runtime_max_tokens_per_rank: the value the dispatch of this round used.
        output: ``[local_num_tokens, hidden]``, contiguous, of the result's dtype: written and
        returned. use_low_precision: FP8 e4m3 rows with their scales on the wire, float32
        sums, bfloat16 out. output_dtype / output_scales / output_scalar_scale / sf_layout:
        the result quantized to MXFP8, MXFP4 or NVFP4 (FlashInfer's values), the scales
        written to ``output_scales``. active_rank_mask: as in :meth:`dispatch`.

        Returns ``[local_num_tokens, hidden]`` of the payload's dtype, summed in float32.
        Afterwards the state is "idle" (also when a wait on a peer failed).
        """
        if _compiling():
            return self._combine_traced(payload, runtime_max_tokens_per_rank, payload_in_workspace, output_dtype,
                                        output_scales, output_scalar_scale, sf_layout, output, use_low_precision,
                                        active_rank_mask)
        if self._closed or self._att.forked:
            self._live()
        mask = self._caller_mask(active_rank_mask) if active_rank_mask is not None or self.enable_rank_mask else None
        plain = output_dtype is None and output_scales is None
        if not plain:
            from .ops import _quantized

            dtype = getattr(payload, "dtype", None)  # (front.combine refuses a payload that is no tensor)
            plain = not _quantized(output_dtype, output_scales) and output_dtype in (None, dtype)
        out = self._front.combine(
            self._token, payload, runtime_max_tokens_per_rank, payload_in_workspace,
            output=output if plain else None, low_precision=use_low_precision, caller_mask=mask,
        )
        if plain:
            return out
        from .ops import finish_output

        return finish_output(out, output_dtype, output_scales, output_scalar_scale, sf_layout, output, copy=True)

    def _dispatch_pairs(self, x: torch.Tensor, topk_idx: torch.Tensor, runtime_max_tokens_per_rank: int, *,
                        active_rank_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Dispatch a round whose tokens are the (token, k) pairs of ``topk_idx`` (a top_k = 1
        job's, on the CUDA backend; a2ad.deep_ep's): ``Front.dispatch_pairs`` says what.
        Returns the received rows and metadata, as :meth:`dispatch` returns payloads."""
        if self._closed or self._att.forked:
            self._live()
        if self.top_k != 1:
            raise errors.StateError(f"dispatching (token, k) pairs needs a job of top_k 1, this one has {self.top_k}")
        mask = self._caller_mask(active_rank_mask) if active_rank_mask is not None or self.enable_rank_mask else None
        received = self._front.dispatch_pairs(self._token, x, topk_idx, runtime_max_tokens_per_rank, self.num_experts,
                                              caller_mask=mask)
        self._eplb_gathered = None
        return received

    def _combine_pairs(self, x: torch.Tensor, runtime_max_tokens_per_rank: int, stage_index: torch.Tensor,
                       topk_idx: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, *,
                       active_rank_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Combine a round whose tokens are the (token, k) pairs of ``topk_idx`` (a top_k = 1
        job's, on the CUDA backend; a2ad.deep_ep's): ``Front.combine``'s ``pairs`` says what."""
        if self._closed or self._att.forked:
            self._live()
        mask = self._caller_mask(active_rank_mask) if active_rank_mask is not None or self.enable_rank_mask else None
        return self._front.combine(self._token, x, runtime_max_tokens_per_rank, False, output=output, caller_mask=mask,
                                   pairs=(stage_index, topk_idx, weights))

    def _combine_traced(self, payload, rt, payload_in_workspace, output_dtype, output_scales, output_scalar_scale,
                        sf_layout, output, use_low_precision, active_rank_mask):
        from . import ops

        if self._traced is None:
            raise errors.StateError("combine called before dispatch inside torch.compile: compile the round's "
                                    "dispatch and combine together")
        local_num_tokens, cpo = self._traced
        self._traced = None
        return ops.moe_a2a_combine(
            payload, local_num_tokens, self._ws, self._metainfo, rt, self._front.ep_rank, self._front.ep_size,
            self.top_k, cpo, payload_in_workspace, output_dtype, output_scales, output_scalar_scale, sf_layout,
            output, use_low_precision=use_low_precision, enable_rank_mask=self.enable_rank_mask,
            active_rank_mask=active_rank_mask,
        )

    # --- checkpoints ----------------------------------------------------------------
    def checkpoint_prepare(self) -> None:
        """Quiesce and unmap this rank's workspace (e.g. before a process sleeps); repeated calls
        are no-ops. The job stays in the daemon and the lease open; every instance sharing the
        attachment is unmapped with it. Refused (StateError) while a round is open. After it,
        dispatch raises StateError until :meth:`checkpoint_restore`."""
        att = self._live()
        rounds = att.rounds
        if rounds.owner is UNMAPPED:
            return
        if rounds.owner is not None:
            raise errors.StateError("Cannot unmap the workspace during an active all-to-all phase: combine first")
        if att.backend == "cuda":
            torch.cuda.synchronize(att.device)
        att.suspend()
        rounds.owner = UNMAPPED

    def checkpoint_restore(self, comm_backend=None) -> None:
        """Map the workspace again at the same virtual addresses (captured CUDA graphs stay valid);
        repeated calls are no-ops. ``comm_backend`` (FlashInfer's argument), when given: a
        communicator of exactly the EP group must have this rank's rank, a larger one a
        multiple of ep_size ranks (else StateError), and its ``barrier`` ends the call once
        every member restored."""
        att = self._live()
        rounds = att.rounds
        if rounds.owner is not UNMAPPED:
            return
        if comm_backend is not None:
            size, rank = int(comm_backend.Get_size()), int(comm_backend.Get_rank())
            if size % att.ep_size or (size == att.ep_size and rank != att.ep_rank):
                raise errors.StateError(
                    f"Cannot remap the workspace: the communicator's rank/size {rank}/{size} does not match "
                    f"this rank's {att.ep_rank}/{att.ep_size}")
        att.resume()
        rounds.owner = rounds.round = None
        if comm_backend is not None and hasattr(comm_backend, "barrier"):
            comm_backend.barrier()

    # --- failures -------------------------------------------------------------------
    def check(self) -> None:
        """Raise PeerLost or PeerTimeout if a wait of this rank failed, or the job was aborted.

        Every call checks this first. On CUDA a wait fails inside a kernel, after the
        call that launched it returned: synchronize the stream, then call check() to learn
        about it at once rather than at the next dispatch."""
        self._live()
        self._front.check_peers(self._plane, inputs=self._att.rounds.owner is None)

    def recover(self, timeout: float | None = None) -> int:
        """After PeerLost or PeerTimeout: quiesce, then wait for the job-wide re-arm.

        Waits for this rank's queued GPU work (the kernels leave their waits at once
        when the job is aborted), then blocks until every rank is present (a dead rank
        replaced by a new process) and has called recover; the daemon then resets every
        rank's flags and counters and bumps the generation. Returns the new generation;
        the state is idle and traffic can resume. ``timeout`` (default: the constructor's)
        bounds the wait: RendezvousTimeout names the ranks still missing. A daemon restart
        while it waits is ridden out: the recover is asked again of the next daemon within
        the same ``timeout`` (DaemonUnavailable when none listened again in time).

        A destroyed job cannot be recovered: JobDestroyed at once (attach again). Objects
        that share this rank's attachment (several MoeAlltoAll of one job and rank in one
        process) recover it once: after one of them re-armed the job, recover on another
        returns the new generation without asking the daemon again.
        """
        att = self._live()
        att.raise_if_destroyed()
        if att.backend == "cuda":
            torch.cuda.synchronize(att.device)
        self._end_round()
        generation, rearmed = att._recover(self.timeout if timeout is None else timeout)
        if rearmed:
            att.rounds.reset(att.size_per_rank)
            self._plane.reset_status()
        return generation

    @property
    def generation(self) -> int:
        """The job's generation this rank runs at (bumped by every re-arm)."""
        return self._live().generation

    # --- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Leave the job and unmap the workspace. Idempotent; later calls raise StateError."""
        if self._closed:
            return
        self._closed = True
        self._end_round()
        from .ops import unregister_plane

        unregister_plane(self)
        try:
            if self._plane is not None:
                self._plane.close()
        finally:
            self._att.close()

    def __enter__(self) -> "MoeAlltoAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            att = self._att
            warnings.warn(
                f"MoeAlltoAll for job {att.job!r} rank {att.ep_rank} was never closed",
                ResourceWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        if self._att is None:
            return "MoeAlltoAll(unattached)"
        return (
            f"MoeAlltoAll(job={self._att.job!r}, rank={self._att.ep_rank}/{self._att.ep_size}, "
            f"backend={self._att.backend}, top_k={self.top_k}, num_experts={self.num_experts}, {self.phase})"
        )
