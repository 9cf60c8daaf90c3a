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

import math
import operator
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

__all__ = [
    "MoeAlltoAll",
    "moe_a2a_get_workspace_size_per_rank",
    "moe_a2a_wrap_payload_tensor_in_workspace",
    *METAINFO_INDEX,
]

COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def moe_a2a_get_workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
) -> int:
    """Bytes per rank for payloads of the given per-token sizes (aux region included)."""
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


# ---------------------------------------------------------------------------
# Argument checks (every one raises InputError naming the argument)
# ---------------------------------------------------------------------------
def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool):
        raise errors.InputError(f"{name} must be an integer, got bool", argument=name)
    try:
        value = operator.index(value)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        raise errors.InputError(f"{name} must be an integer, got {type(value).__name__}", argument=name) from None
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise errors.InputError(f"{name} must be {bound}, got {value}", argument=name)
    return value


def _tensor_arg(name: str, value, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise errors.InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}", argument=name)
    if value.device != device:
        raise errors.InputError(f"{name} is on {value.device}; this rank's workspace is on {device}", argument=name)
    return value


class _Round:
    """What a dispatch leaves for its combine."""

    __slots__ = ("rt", "local_num_tokens", "layout")

    def __init__(self, rt: int, local_num_tokens: int, layout: L.PayloadLayout):
        self.rt = rt
        self.local_num_tokens = local_num_tokens
        self.layout = layout


class MoeAlltoAll:
    """One rank's MoE all-to-all over a workspace owned by the a2ad daemon.

    ``mapping``: any object with ``moe_ep_rank`` and ``moe_ep_size``.
    ``max_num_tokens``: the most tokens any rank passes to one dispatch.
    ``top_k``: experts per token (at most 22). ``num_experts``: experts in the model,
    partitioned contiguously over the ranks (at least ``ep_size``).
    ``workspace_size_per_rank``: bytes per rank; when None it is
    :meth:`get_moe_workspace_size_per_rank` for ``hidden_size`` (bf16 hidden states,
    int32 expert ids and float32 scales per token, bf16 combine).
    ``mnnvl_config``: accepted so that FlashInfer code runs unchanged, and ignored: the
    daemon allocates the workspace and picks the handle type.
    ``job``: the job name every rank of the group uses. ``runtime_dir``: the daemon's
    runtime folder (default: the daemon's default). ``device``: this rank's device
    (cuda backend: a CUDA device; default the current one). ``timeout``: seconds for
    the rendezvous and for every wait on a peer.

    The constructor joins the job and returns once every rank has joined. Call
    :meth:`close` (or use it as a context manager) to leave.

    Several objects for one job and rank in one process (one per layer, say) share one
    attachment (:func:`a2ad.client.attach`): the same workspace, lease and round counter;
    the first joins, the others attach at once (their ``max_num_tokens``, ``top_k``,
    ``num_experts``, workspace size and device must be identical: SpecMismatch), and the
    job is left when the last of them closes. The rank's workspace holds one round at a
    time, so their rounds must not overlap: dispatch on one, combine on it, then the next
    (a dispatch while another object's round is open raises StateError). Every rank
    must run the same sequence of rounds (the objects' order is free, but a round's
    payload shapes must match across ranks), issue them in order (on CUDA: on one stream,
    or synchronized), and not from several threads at once. After a failure, recover()
    on any one of them re-arms the rank for all.

    ``on_peer_loss``: what the job does when a rank dies or leaves while it runs; part of
    the job's spec, so every rank must pass the same (else SpecMismatch). ``"raise"`` (the
    default): every rank raises PeerLost and calls :meth:`recover` once a replacement
    joined. ``"degrade"``: the others keep serving; tokens routed to the lost rank's
    experts get no contribution from it, :attr:`last_round_degraded` says which tokens
    lost one, :attr:`active_ranks` which ranks serve, and a replacement that joins as the
    lost rank is let back in at a round boundary without the others calling anything
    (README, "Degraded mode"; docs/PROTOCOL.md).
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
        *,
        job: str,
        runtime_dir=None,
        device=None,
        timeout: float = 60.0,
        on_peer_loss: str = "raise",
    ):
        # mnnvl_config: accepted for FlashInfer compatibility and ignored (the daemon owns
        # the workspace and chooses its memory handles)
        self._att = None
        self._plane = None
        self._token = None
        self._closed = True  # until attached: nothing to close or warn about
        try:
            ep_rank, ep_size = int(mapping.moe_ep_rank), int(mapping.moe_ep_size)
        except AttributeError:
            raise errors.InputError("mapping must have moe_ep_rank and moe_ep_size") from None
        ep_size = _int_arg("moe_ep_size", ep_size, 1, L.MAX_EP_SIZE)
        ep_rank = _int_arg("moe_ep_rank", ep_rank, 0, ep_size - 1)
        max_num_tokens = _int_arg("max_num_tokens", max_num_tokens, 1)
        top_k = _int_arg("top_k", top_k, 1, L.MAX_TOP_K)
        num_experts = _int_arg("num_experts", num_experts, ep_size)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise errors.InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if on_peer_loss not in protocol.PEER_LOSS_POLICIES:
            raise errors.InputError(f"on_peer_loss must be 'raise' or 'degrade', got {on_peer_loss!r:.40}",
                                    argument="on_peer_loss")
        if workspace_size_per_rank is None:
            if hidden_size is None:
                raise errors.InputError("give workspace_size_per_rank or hidden_size")
            hidden_size = _int_arg("hidden_size", hidden_size, 1)
            workspace_size_per_rank = self.get_moe_workspace_size_per_rank(ep_size, top_k, max_num_tokens, hidden_size)
        workspace_size_per_rank = _int_arg("workspace_size_per_rank", workspace_size_per_rank, 1)

        from .attach import attach

        self.max_num_tokens = max_num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.timeout = float(timeout)
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
        self._metainfo = torch.tensor(self._att.aux.metainfo(), dtype=torch.int64)
        # Per-call work that depends only on the round's shape is done once and kept:
        # (rt, bytes per token of each payload) -> PayloadLayout; (that, dtypes, shapes) ->
        # the received views; (dispatch layout, combine bytes) -> the combine layout.
        self._layouts: dict = {}
        self._views: dict = {}
        self._combine_layouts: dict = {}
        self._device = self._att.device
        self._host_ids = self._plane.checks_ids_on_host
        # the functional ops (torch.ops.a2ad.moe_a2a_*) find this rank's plane by its workspace
        from .ops import register_plane

        register_plane(self, self._att, self._plane)

    @staticmethod
    def get_moe_workspace_size_per_rank(
        ep_size: int, top_k: int, max_num_tokens: int, hidden_size: int, extra_payload_bytes_per_token: int = 0
    ) -> int:
        """Bytes per rank for bf16 hidden states, int32 expert ids and float32 scales per token
        (plus ``extra_payload_bytes_per_token``) and a bf16 combine."""
        return L.moe_workspace_size_per_rank(ep_size, top_k, max_num_tokens, hidden_size, extra_payload_bytes_per_token)

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
        """The ranks of :attr:`last_round_active_ranks` as a bit mask in an int64 ``[1]`` tensor
        on this rank's device (bit q: rank q counted), written by the combine in stream order:
        a model can tell which of a token's experts counted without a sync,
        ``(mask >> owner[topk_ids]) & 1``. None before the first combine."""
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
    def _round(self) -> _Round | None:
        """The round this object dispatched and has not combined yet."""
        rounds = self._att.rounds
        return rounds.round if rounds.owner is self._token else None

    def _end_round(self) -> None:
        rounds = self._att.rounds
        if rounds.owner is self._token:
            rounds.owner = rounds.round = None

    # --- dispatch -------------------------------------------------------------------
    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        invalid_token_expert_id: int | None = None,
        expert_id_payload_index: int | None = None,
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

        Returns one workspace-backed tensor per payload, ``[ep_size, runtime_max_tokens_per_rank,
        elements_per_token]`` of the payload's dtype: row (s, j) is the token source rank s
        put in slot j; slots from RECV_COUNTERS[s] on hold no token. They are valid until
        this rank calls :meth:`combine` (from then on peers may write the next round's tokens
        there), so copy what must outlive combine. Afterwards the state is "dispatched":
        call :meth:`combine`.

        Raises InputError (bad shapes, dtypes or devices; nothing was written anywhere, the
        state is unchanged), StateError (not idle, or closed), PeerTimeout / PeerLost (a peer
        did not arrive or was lost; every later call raises it again until the job is re-armed).

        No call synchronizes with the GPU. What only the data can tell is found by the
        dispatch kernel, which completes the round for every rank anyway: an expert id outside
        ``[0, num_experts)`` is routed nowhere, and ranks that passed different
        ``runtime_max_tokens_per_rank`` get a round without data (combine returns zeros). Each
        is raised as InputError by a later call of this rank (the combine of the round or a
        later one, the next dispatch, or :meth:`check`), naming the token and id or the peer
        and its value; the job goes on. On the host backend both raise at once.
        """
        att = self._live()
        self._check_peers(inputs=True)
        rounds = att.rounds
        if rounds.owner is not None:
            if rounds.owner is self._token:
                raise errors.StateError("dispatch called twice: combine the previous dispatch first")
            raise errors.StateError(
                f"another MoeAlltoAll of job {att.job!r} rank {att.ep_rank} in this process has dispatched and not "
                "combined yet: they share this rank's workspace, which holds one round at a time; combine that one first"
            )
        rt = runtime_max_tokens_per_rank
        if type(rt) is not int or not 1 <= rt <= self.max_num_tokens:
            rt = _int_arg("runtime_max_tokens_per_rank", rt, 1, self.max_num_tokens)
        experts = self._check_experts(token_selected_experts, rt)
        num_tokens = experts.shape[0]
        payloads, nbytes = self._check_payloads(input_payloads, num_tokens)
        key = (rt, nbytes)
        layout = self._layouts.get(key)
        if layout is None:
            try:
                layout = L.payload_layout(att.aux, att.size_per_rank, rt, nbytes)
            except L.LayoutError as exc:
                raise errors.InputError(str(exc), argument="input_payloads") from None
            self._layouts[key] = layout
        if layout.dispatch_end > rounds.combine_floor:
            raise errors.InputError(
                f"these payloads need bytes [{att.aux.payload_data}, {layout.dispatch_end}) of every row at "
                f"runtime_max_tokens_per_rank={rt}, which overlap the previous round's combine region (from "
                f"{rounds.combine_floor}) that peers may still be reading; size the workspace for the dispatch "
                f"and combine payloads together (get_moe_workspace_size_per_rank)",
                argument="input_payloads",
            )
        ids_index = None
        if invalid_token_expert_id is not None or expert_id_payload_index is not None:
            ids_index, invalid_id = self._check_sanitize_args(payloads, invalid_token_expert_id, expert_id_payload_index)
        self._plane.dispatch(experts, payloads, rt, layout, self.num_experts)
        rounds.owner, rounds.round = self._token, _Round(rt, num_tokens, layout)
        # the views depend on the bytes per token and the dtypes only (each is [ep, rt, -1])
        vkey = (key, *[p.dtype for p in payloads])
        received = self._views.get(vkey)
        if received is None:
            ep, me = att.ep_size, att.ep_rank
            received = []
            for src, off, nb in zip(payloads, layout.dispatch_offsets, nbytes):
                view = att.workspace[me, off : off + ep * rt * nb].view(src.dtype)
                received.append(view.view(ep, rt, -1))
            if len(self._views) > 256:
                self._views.clear()
            self._views[vkey] = received
        received = list(received)
        if ids_index is not None:
            self._plane.sanitize(received[ids_index], rt, invalid_id)
        return received

    def _check_experts(self, experts, rt: int) -> torch.Tensor:
        if not isinstance(experts, torch.Tensor) or experts.device != self._device:
            _tensor_arg("token_selected_experts", experts, self._device)
        dtype = experts.dtype
        if dtype is not torch.int32 and dtype is not torch.int64:
            raise errors.InputError(
                f"token_selected_experts must be int32 (or int64), got {dtype}", argument="token_selected_experts"
            )
        if experts.dim() != 2 or experts.shape[1] != self.top_k:
            raise errors.InputError(
                f"token_selected_experts must be [local_num_tokens, top_k={self.top_k}], got {list(experts.shape)}",
                argument="token_selected_experts",
            )
        num_tokens = experts.shape[0]
        if num_tokens > rt:
            raise errors.InputError(
                f"local_num_tokens ({num_tokens}) exceeds runtime_max_tokens_per_rank ({rt})", argument="token_selected_experts"
            )
        if self._host_ids and num_tokens:
            # host tensors: checked here, at once. On CUDA the kernel routes a bad id nowhere
            # and reports it (check_input) so that no call reads the ids back (a host sync).
            outside = (experts < 0) | (experts >= self.num_experts)  # before int64 -> int32
            if bool(outside.any()):
                raise errors.InputError(
                    f"token_selected_experts holds expert id {experts[outside][0].item()}, "
                    f"outside [0, num_experts={self.num_experts})",
                    argument="token_selected_experts",
                )
        if dtype is torch.int64:
            if not self._host_ids:  # an id outside int32 must stay outside [0, num_experts) when narrowed
                experts = experts.clamp(-1, self.num_experts)
            experts = experts.to(torch.int32)
        return experts if experts.is_contiguous() else experts.contiguous()

    def _check_payloads(self, payloads, num_tokens: int) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        if not isinstance(payloads, (list, tuple)):
            raise errors.InputError("input_payloads must be a list of tensors", argument="input_payloads")
        if not 1 <= len(payloads) <= L.MAX_PAYLOADS:
            raise errors.InputError(
                f"input_payloads must hold 1 to {L.MAX_PAYLOADS} tensors, got {len(payloads)}", argument="input_payloads"
            )
        nbytes = []
        device = self._device
        copies = None
        for i, p in enumerate(payloads):
            if not isinstance(p, torch.Tensor) or p.device != device:
                _tensor_arg(f"input_payloads[{i}]", p, device)
            if p.dim() < 1 or p.shape[0] != num_tokens:
                raise errors.InputError(
                    f"input_payloads[{i}] must be [local_num_tokens={num_tokens}, ...], got {list(p.shape)}",
                    argument=f"input_payloads[{i}]",
                )
            nb = p.nbytes // num_tokens if num_tokens else math.prod(p.shape[1:]) * p.element_size()
            if nb == 0:
                raise errors.InputError(f"input_payloads[{i}] has no bytes per token (shape {list(p.shape)})",
                                        argument=f"input_payloads[{i}]")
            if not p.is_contiguous():
                if copies is None:
                    copies = list(payloads)
                copies[i] = p.contiguous()
            nbytes.append(nb)
        return (payloads if copies is None else copies), tuple(nbytes)

    def _check_sanitize_args(self, payloads, invalid_id, ids_index) -> tuple[int, int]:
        if (invalid_id is None) != (ids_index is None):
            raise errors.InputError(
                "give both invalid_token_expert_id and expert_id_payload_index, or neither", argument="invalid_token_expert_id"
            )
        ids_index = _int_arg("expert_id_payload_index", ids_index, 0, len(payloads) - 1)
        invalid_id = _int_arg("invalid_token_expert_id", invalid_id, -(1 << 31), (1 << 31) - 1)
        if payloads[ids_index].dtype != torch.int32:
            raise errors.InputError(
                f"the expert-id payload (input_payloads[{ids_index}]) must be int32 to be sanitized, "
                f"got {payloads[ids_index].dtype}",
                argument="expert_id_payload_index",
            )
        return ids_index, invalid_id

    # --- combine --------------------------------------------------------------------
    def get_combine_payload_tensor_in_workspace(
        self, runtime_max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's combine region as ``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` of ``dtype``.

        Write the expert outputs there, then ``combine(..., payload_in_workspace=True)``
        skips the staging copy. Only between dispatch and combine; it lies at the end of
        the row and does not overlap the dispatch results.
        """
        att = self._live()
        rnd = self._require_dispatched("get_combine_payload_tensor_in_workspace")
        rt = self._check_rt(runtime_max_tokens_per_rank, rnd)
        hidden = _int_arg("hidden_size", hidden_size, 1)
        if dtype not in COMBINE_DTYPES:
            raise errors.InputError(f"dtype must be bfloat16, float16 or float32, got {dtype}", argument="dtype")
        bytes_per_token = hidden * torch.empty((), dtype=dtype).element_size()
        off = self._combine_layout(att, rnd, bytes_per_token).combine_offset
        region = att.workspace[att.ep_rank, off : off + att.ep_size * rt * bytes_per_token]
        return region.view(dtype).view(att.ep_size, rt, hidden)

    def combine(
        self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool = False
    ) -> torch.Tensor:
        """Return every local token's expert outputs, summed over the ranks it was sent to.

        payload: ``[ep_size, runtime_max_tokens_per_rank, hidden]`` bfloat16, float16 or
        float32: row (s, j) is the output for the token source s put in slot j (rows of
        empty slots are ignored). With ``payload_in_workspace`` it must be the tensor
        :meth:`get_combine_payload_tensor_in_workspace` returned.
        runtime_max_tokens_per_rank: the value the dispatch of this round used.

        Returns ``[local_num_tokens, hidden]`` of the payload's dtype, summed in float32.
        Afterwards the state is "idle" (also when a wait on a peer failed).
        """
        att = self._live()
        self._check_peers(inputs=False)
        rnd = self._require_dispatched("combine")
        rt = rnd.rt
        if type(runtime_max_tokens_per_rank) is not int or runtime_max_tokens_per_rank != rt:
            rt = self._check_rt(runtime_max_tokens_per_rank, rnd)
        if not isinstance(payload, torch.Tensor) or payload.device != self._device:
            _tensor_arg("payload", payload, self._device)
        if payload.dtype not in COMBINE_DTYPES:
            raise errors.InputError(f"payload must be bfloat16, float16 or float32, got {payload.dtype}", argument="payload")
        shape = payload.shape
        if len(shape) != 3 or shape[0] != att.ep_size or shape[1] != rt or shape[2] < 1:
            raise errors.InputError(
                f"payload must be [ep_size={att.ep_size}, runtime_max_tokens_per_rank={rt}, hidden], "
                f"got {list(shape)}",
                argument="payload",
            )
        layout = self._combine_layout(att, rnd, shape[2] * payload.element_size())
        if payload_in_workspace is True:
            expected = att.workspace[att.ep_rank, layout.combine_offset :]
            if not payload.is_contiguous() or payload.data_ptr() != expected.data_ptr():
                raise errors.InputError(
                    "payload_in_workspace=True but payload is not this rank's combine region "
                    "(use get_combine_payload_tensor_in_workspace)",
                    argument="payload",
                )
        elif payload_in_workspace is False:
            if not payload.is_contiguous():
                payload = payload.contiguous()
        else:
            raise errors.InputError("payload_in_workspace must be a bool", argument="payload_in_workspace")
        att.rounds.combine_floor = layout.combine_offset
        try:
            out = self._plane.combine(payload, rnd.local_num_tokens, rt, layout, payload_in_workspace)
        finally:
            self._end_round()
        # the round is complete on every rank: now input errors the kernels found may surface
        if not att.control.quiet(att.ep_rank):
            self._plane.check_input()
        return out

    def _check_peers(self, inputs: bool) -> None:
        """Raise what the plane knows about a lost or silent peer (the round is then over),
        and with ``inputs``, what the kernels found wrong in an earlier call's input (raised
        only where no round is open, so that every rank completes its rounds). Never syncs."""
        att = self._att
        att.maintain()  # reconnect the lease if the daemon restarted (rate-limited, never raises)
        if att.control.quiet(att.ep_rank):
            return
        try:
            self._plane.check()
        except (errors.PeerTimeout, errors.PeerLost, errors.JobDestroyed):
            # the rank's round is over, whichever object sharing the attachment dispatched it
            rounds = att.rounds
            rounds.owner = rounds.round = None
            raise
        if inputs:
            self._plane.check_input()

    def _require_dispatched(self, what: str) -> _Round:
        if self._round is None:
            raise errors.StateError(f"{what} called before dispatch: the state is idle")
        return self._round

    def _check_rt(self, rt, rnd: _Round) -> int:
        rt = _int_arg("runtime_max_tokens_per_rank", rt, 1, self.max_num_tokens)
        if rt != rnd.rt:
            raise errors.InputError(
                f"runtime_max_tokens_per_rank ({rt}) differs from this round's dispatch ({rnd.rt})",
                argument="runtime_max_tokens_per_rank",
            )
        return rt

    def _combine_layout(self, att, rnd: _Round, bytes_per_token: int) -> L.PayloadLayout:
        """The round's layout with its combine region at the end of the row (see the module doc)."""
        key = (rnd.rt, rnd.layout.dispatch_bytes_per_token, bytes_per_token)
        layout = self._combine_layouts.get(key)
        if layout is None:
            try:
                layout = L.payload_layout(
                    att.aux, att.size_per_rank, rnd.rt, rnd.layout.dispatch_bytes_per_token, bytes_per_token
                )
            except L.LayoutError as exc:
                raise errors.InputError(str(exc), argument="payload") from None
            if len(self._combine_layouts) > 256:
                self._combine_layouts.clear()
            self._combine_layouts[key] = layout
        return layout

    # --- failures -------------------------------------------------------------------
    def check(self) -> None:
        """Raise PeerLost or PeerTimeout if a wait of this rank failed, or the job was aborted.

        Every call checks this first. On CUDA a wait fails inside a kernel, after the
        call that launched it returned: synchronize the stream, then call check() to learn
        about it at once rather than at the next dispatch."""
        self._live()
        if self._round is None and self._att.rounds.owner is None:
            self._check_peers(inputs=True)
        else:
            self._check_peers(inputs=False)

    def recover(self, timeout: float | None = None) -> int:
        """After PeerLost or PeerTimeout: quiesce, then wait for the job-wide re-arm.

        Waits for this rank's queued GPU work (the kernels leave their waits at once
        when the job is aborted), then blocks until every rank is present (a dead rank
        replaced by a new process) and has called recover; the daemon then resets every
        rank's flags and counters and bumps the generation. Returns the new generation;
        the state is idle and traffic can resume. ``timeout`` (default: the constructor's)
        bounds the wait: RendezvousTimeout names the ranks still missing.

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
