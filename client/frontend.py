"""One rank's front end: the validation boundary and the round object that ``MoeAlltoAll``
and the functional ops (``client/ops.py``) both call.

Everything a caller passes is checked here, once, before anything is written to a peer:
a bad argument raises :class:`~a2ad.errors.InputError` naming the argument and the reason,
a call out of order :class:`~a2ad.errors.StateError`. The planes below (``HostPlane``,
``CudaPlane``) receive checked, contiguous tensors and a payload layout.

A :class:`Front` belongs to one rank of one workspace: a daemon attachment
(:class:`a2ad.client.Attachment`) with its plane, or a caller-owned workspace tensor
(:mod:`a2ad.client.local`), whose planes are made per ``(top_k, num_experts)`` on first
use. The rank's round (the round in flight and where the last combine region starts)
lives in the attachment's :class:`~a2ad.client.attach.RoundState`, which every front end
object of that rank shares: whoever dispatched owns the round until its combine.

Per-call work that depends only on the round's shape (payload layouts, the received
views) is computed once and kept, so that the eager path adds no host time per call
and never synchronizes with the GPU.
"""

from __future__ import annotations

import inspect
import math
import operator

import torch

from a2ad import errors, layout as L

#: Whether a2ad.layout.payload_layout takes the payload dtypes and the EPLB region (the
#: agreement check between ranks and the EPLB gather); checked once.
_LAYOUT_KW = {"dtypes", "eplb_stats_num_experts"} <= set(inspect.signature(L.payload_layout).parameters)

#: Combine payload dtypes (the combine sums in float32 and returns the payload's dtype).
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The owner of a round dispatched through the functional ops (MoeAlltoAll objects use their own tokens).
FUNCTIONAL_OWNER = object()
#: The round owner while the rank's workspace is unmapped (checkpoint_prepare .. checkpoint_restore).
UNMAPPED = object()


# ---------------------------------------------------------------------------
# Argument checks (every one raises InputError naming the argument)
# ---------------------------------------------------------------------------
def int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
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


def tensor_arg(name: str, value, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise errors.InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}", argument=name)
    if value.device != device:
        raise errors.InputError(f"{name} is on {value.device}; this rank's workspace is on {device}", argument=name)
    return value


def same(name: str, value, expected: int, what: str) -> None:
    if int_arg(name, value, -(1 << 62)) != expected:
        raise errors.InputError(f"{name} is {value}, but {what} is {expected}", argument=name)


def bool_arg(name: str, value) -> bool:
    if value is not True and value is not False:
        raise errors.InputError(f"{name} must be a bool, got {type(value).__name__}", argument=name)
    return value


def rank_mask_arg(name: str, mask, ep_rank: int, ep_size: int, device: torch.device) -> torch.Tensor:
    """The caller's active-rank mask as the int64 words the planes take.

    A mask is n u64 words, rank q being bit ``q & 63`` of word ``q >> 6``, with
    ``ceil(ep_size / 64) <= n <= MASK_WORDS``: FlashInfer's CPU uint64 ``[1]`` tensor for
    ep_size <= 64, :func:`moe_a2a_active_rank_mask`'s ``[MASK_WORDS]`` one, or an int64
    tensor of such words, on the CPU or on this rank's device (a device mask can change
    between CUDA graph replays). A host mask must keep this rank's own bit and name no rank
    outside ``[0, ep_size)``; it goes to the plane as it is (its value is taken at the call,
    also while a CUDA graph is captured), an int64 view of the caller's words (no copy); a
    device mask is not read back (no sync). The plane reads the words it is given, the
    others count as zero."""
    if not isinstance(mask, torch.Tensor):
        raise errors.InputError(f"{name} must be a torch.Tensor (moe_a2a_active_rank_mask), got "
                                f"{type(mask).__name__}", argument=name)
    need = (ep_size + 63) // 64
    if mask.dtype not in (torch.uint64, torch.int64) or mask.dim() != 1 or not need <= mask.shape[0] <= L.MASK_WORDS:
        shapes = f"[{need}]" if need == L.MASK_WORDS else f"[{need}] to [{L.MASK_WORDS}]"
        raise errors.InputError(
            f"{name} must be a uint64 (or int64) tensor of shape {shapes} for ep_size={ep_size} (rank q: bit q & 63 "
            f"of word q >> 6), got {list(mask.shape)} {mask.dtype}", argument=name)
    if mask.device.type != "cpu" and mask.device != device:
        raise errors.InputError(f"{name} is on {mask.device}; give it on the CPU or on {device}", argument=name)
    if mask.dtype is torch.uint64:
        mask = mask.view(torch.int64)
    if mask.device.type == "cpu":
        bits = L.mask_from_words(mask.tolist())
        if not bits >> ep_rank & 1:
            raise errors.InputError(f"{name} must keep this rank's own bit ({ep_rank}) set, got {bits:#x}",
                                    argument=name)
        if bits >> ep_size:
            raise errors.InputError(f"{name} sets bits of ranks outside [0, ep_size={ep_size}): "
                                    f"{L.format_ranks(bits & ~L.full_mask(ep_size))} ({bits:#x})", argument=name)
    return mask if mask.is_contiguous() else mask.contiguous()


class Round:
    """What a dispatch leaves for its combine."""

    __slots__ = ("rt", "local_num_tokens", "layout", "plane", "eplb", "layout_kw")

    def __init__(self, rt: int, local_num_tokens: int, layout: L.PayloadLayout, plane, eplb=None, layout_kw=None):
        self.rt = rt
        self.local_num_tokens = local_num_tokens
        self.layout = layout
        self.plane = plane
        self.eplb = eplb
        self.layout_kw = layout_kw


_TAKES: dict = {}


def _takes(plane, name: str) -> bool:
    """Whether ``plane.combine`` takes the keyword ``name`` (checked once per plane class)."""
    key = (type(plane), name)
    got = _TAKES.get(key)
    if got is None:
        got = _TAKES[key] = name in inspect.signature(type(plane).combine).parameters
    return got


def _owner_name(owner) -> str:
    return "moe_a2a_dispatch" if owner is FUNCTIONAL_OWNER else "a MoeAlltoAll"


class Front:
    """One rank's round object over ``att`` (an Attachment or a caller-owned workspace's
    attachment-like object).

    ``plane``: the plane of a daemon attachment (fixed top_k / num_experts: the job's), or
    None with ``make_plane(top_k, num_experts)`` for a caller-owned workspace (a plane per
    pair, made on first use).
    """

    def __init__(self, att, plane=None, *, make_plane=None, eplb_stats_num_experts: int = 0):
        self.att = att
        # the rank's round bookkeeping: the attachment's one RoundState (reset in place, never
        # replaced), held here so that a call does not go through the attachment's property
        self._rounds = att.rounds
        self.device = att.device
        self.ep_rank = int(att.ep_rank)
        self.ep_size = int(att.ep_size)
        self.max_num_tokens = int(att.spec["max_num_tokens"])
        self.eplb_stats_num_experts = int(eplb_stats_num_experts)
        self._plane = plane
        self._make_plane = make_plane
        self._planes: dict = {}
        self._layouts: dict = {}
        self._views: dict = {}
        self._combine_layouts: dict = {}
        self._eplb_out: torch.Tensor | None = None
        self.metainfo = torch.tensor(att.aux.metainfo(), dtype=torch.int64)

    # --- planes -----------------------------------------------------------------------
    def plane(self, top_k: int, num_experts: int):
        if self._plane is not None:
            return self._plane
        key = (top_k, num_experts)
        plane = self._planes.get(key)
        if plane is None:
            plane = self._planes[key] = self._make_plane(top_k, num_experts)
        return plane

    def planes(self) -> list:
        return [self._plane] if self._plane is not None else list(self._planes.values())

    def close(self) -> None:
        if self._plane is None:
            planes, self._planes = list(self._planes.values()), {}
            for p in planes:
                p.close()

    # --- peers ------------------------------------------------------------------------
    def check_peers(self, plane, inputs: bool) -> None:
        """Raise what the plane knows about a lost or silent peer (the rank's round is then
        over) and, with ``inputs``, what its kernels found wrong in an earlier call's input
        (raised only where no round is open, so that every rank completes its rounds).
        Never synchronizes."""
        att = self.att
        if att.forked:
            raise errors.StateError("this workspace was inherited through fork; attach in this process")
        att.maintain()  # reconnect the lease if the daemon restarted (rate-limited, never raises)
        if att.control.quiet(self.ep_rank):
            return
        if plane is None:
            return
        try:
            plane.check()
        except (errors.PeerTimeout, errors.PeerLost, errors.JobDestroyed):
            rounds = self._rounds
            if rounds.owner is not UNMAPPED:
                rounds.owner = rounds.round = None
            raise
        if inputs:
            plane.check_input()

    def _refuse_open_round(self, owner) -> None:
        rounds = self._rounds
        held = rounds.owner
        if held is UNMAPPED:
            raise errors.StateError(
                "the workspace is unmapped (checkpoint_prepare): call checkpoint_restore before the next dispatch")
        if held is owner and owner is not FUNCTIONAL_OWNER:
            raise errors.StateError("dispatch called twice: combine the previous dispatch first")
        if owner is FUNCTIONAL_OWNER:
            raise errors.StateError(
                f"this rank has a round open (dispatched by {_owner_name(held)}, not combined yet): the workspace "
                "holds one round at a time; combine it first")
        raise errors.StateError(
            f"another MoeAlltoAll of job {self.att.job!r} rank {self.ep_rank} in this process (or moe_a2a_dispatch) has "
            "dispatched and not combined yet: they share this rank's workspace, which holds one round at a time; "
            "combine that one first")

    # --- dispatch ---------------------------------------------------------------------
    def check_experts(self, experts, rt: int, top_k: int, num_experts: int, plane) -> torch.Tensor:
        if not isinstance(experts, torch.Tensor) or experts.device != self.device:
            tensor_arg("token_selected_experts", experts, self.device)
        dtype = experts.dtype
        if dtype is not torch.int32 and dtype is not torch.int64:
            raise errors.InputError(
                f"token_selected_experts must be int32 (or int64), got {dtype}", argument="token_selected_experts")
        if experts.dim() != 2 or experts.shape[1] != top_k:
            raise errors.InputError(
                f"token_selected_experts must be [local_num_tokens, top_k={top_k}], got {list(experts.shape)}",
                argument="token_selected_experts")
        num_tokens = experts.shape[0]
        if num_tokens > rt:
            raise errors.InputError(
                f"local_num_tokens ({num_tokens}) exceeds runtime_max_tokens_per_rank ({rt})",
                argument="token_selected_experts")
        # Host tensors are range-checked here, at once. The CUDA kernels route an id outside
        # [0, num_experts) nowhere and report it (check_input), so that no call reads the ids
        # back (a host sync), and nothing is read back while a CUDA stream is captured.
        host_ids = plane.checks_ids_on_host and not (experts.is_cuda and torch.cuda.is_current_stream_capturing())
        if host_ids and num_tokens:
            outside = (experts < 0) | (experts >= num_experts)  # before int64 -> int32
            if bool(outside.any()):
                token, k = (int(i) for i in outside.nonzero()[0])
                raise errors.InputError(
                    f"token_selected_experts[{token}, {k}] (token {token}) holds expert id {int(experts[token, k])}, "
                    f"outside [0, num_experts={num_experts})",
                    argument="token_selected_experts", token=token, k=k, value=int(experts[token, k]))
        if dtype is torch.int64:
            if not host_ids:  # an id outside int32 must stay outside [0, num_experts) when narrowed
                experts = experts.clamp(-1, num_experts)
            experts = experts.to(torch.int32)
        return experts if experts.is_contiguous() else experts.contiguous()

    def check_payloads(self, payloads, num_tokens: int) -> tuple[list, tuple[int, ...]]:
        if not isinstance(payloads, (list, tuple)):
            raise errors.InputError("input_payloads must be a list of tensors", argument="input_payloads")
        if not 1 <= len(payloads) <= L.MAX_PAYLOADS:
            raise errors.InputError(
                f"input_payloads must hold 1 to {L.MAX_PAYLOADS} tensors, got {len(payloads)}",
                argument="input_payloads")
        nbytes = []
        device = self.device
        copies = None
        for i, p in enumerate(payloads):
            if not isinstance(p, torch.Tensor) or p.device != device:
                tensor_arg(f"input_payloads[{i}]", p, device)
            if p.dim() < 1 or p.shape[0] != num_tokens:
                raise errors.InputError(
                    f"input_payloads[{i}] must be [local_num_tokens={num_tokens}, ...], got {list(p.shape)}",
                    argument=f"input_payloads[{i}]")
            nb = p.nbytes // num_tokens if num_tokens else math.prod(p.shape[1:]) * p.element_size()
            if nb == 0:
                raise errors.InputError(f"input_payloads[{i}] has no bytes per token (shape {list(p.shape)})",
                                        argument=f"input_payloads[{i}]")
            if not p.is_contiguous():
                if copies is None:
                    copies = list(payloads)
                copies[i] = p.contiguous()
            nbytes.append(nb)
        return (payloads if copies is None else list(copies)), tuple(nbytes)

    def _check_sanitize_args(self, payloads, invalid_id, ids_index) -> tuple[int, int]:
        if (invalid_id is None) != (ids_index is None):
            raise errors.InputError(
                "give both invalid_token_expert_id and expert_id_payload_index, or neither",
                argument="invalid_token_expert_id")
        ids_index = int_arg("expert_id_payload_index", ids_index, 0, len(payloads) - 1)
        invalid_id = int_arg("invalid_token_expert_id", invalid_id, -(1 << 31), (1 << 31) - 1)
        if payloads[ids_index].dtype != torch.int32:
            raise errors.InputError(
                f"the expert-id payload (input_payloads[{ids_index}]) must be int32 to be sanitized, "
                f"got {payloads[ids_index].dtype}",
                argument="expert_id_payload_index")
        return ids_index, invalid_id

    def _check_eplb(self, stats) -> torch.Tensor:
        n = self.eplb_stats_num_experts
        if n == 0:
            raise errors.InputError(
                "eplb_local_stats given, but the workspace was set up with eplb_stats_num_experts=0",
                argument="eplb_local_stats")
        if not isinstance(stats, torch.Tensor) or stats.device != self.device:
            tensor_arg("eplb_local_stats", stats, self.device)
        if stats.dtype != torch.int32 or stats.dim() != 1 or stats.shape[0] != n:
            raise errors.InputError(
                f"eplb_local_stats must be [eplb_stats_num_experts={n}] int32, got {list(stats.shape)} {stats.dtype}",
                argument="eplb_local_stats")
        if self._eplb_out is None:
            self._eplb_out = torch.zeros(self.ep_size, n, dtype=torch.int32, device=self.device)
        return stats if stats.is_contiguous() else stats.contiguous()

    def layout(self, rt: int, nbytes: tuple[int, ...], payloads, eplb: int) -> tuple[L.PayloadLayout, dict]:
        """The round's payload layout (cached by shape) and the layout arguments its combine reuses."""
        key = (rt, nbytes, eplb, *[p.dtype for p in payloads]) if _LAYOUT_KW else (rt, nbytes)
        got = self._layouts.get(key)
        if got is None:
            kw = {"dtypes": [p.dtype for p in payloads], "eplb_stats_num_experts": eplb} if _LAYOUT_KW else {}
            try:
                layout = L.payload_layout(self.att.aux, self.att.size_per_rank, rt, nbytes, **kw)
                kw = dict(kw)
            except L.LayoutError as exc:
                raise errors.InputError(str(exc), argument="input_payloads") from None
            if len(self._layouts) > 256:
                self._layouts.clear()
            kw["_key"] = key  # the combine layouts of this round are cached under it
            got = self._layouts[key] = (layout, kw)
        return got

    def _begin_dispatch(self, owner, top_k: int, num_experts: int, rt):
        """What every dispatch checks first: the peers (and earlier rounds' input errors), that
        no round is open, and ``rt``. Returns the plane and ``rt`` as an int."""
        plane = self._plane
        if plane is None:
            plane = self.plane(top_k, num_experts)
        self.check_peers(plane, inputs=True)
        if self._rounds.owner is not None:
            self._refuse_open_round(owner)
        if type(rt) is not int or not 1 <= rt <= self.max_num_tokens:
            rt = int_arg("runtime_max_tokens_per_rank", rt, 1, self.max_num_tokens)
        return plane, rt

    def dispatch(self, owner, experts, payloads, rt, top_k: int, num_experts: int, *, invalid_id=None,
                 ids_index=None, eplb_local_stats=None, caller_mask=None):
        """Check everything, dispatch, open the round for ``owner``.

        Returns ``(received views, layout, eplb_gathered or None)``; the views are
        ``[ep_size, rt, elements_per_token]`` of each payload's dtype, backed by this
        rank's workspace row. ``caller_mask``: int64 mask words (rank_mask_arg)."""
        plane, rt = self._begin_dispatch(owner, top_k, num_experts, rt)
        rounds = self._rounds
        experts = self.check_experts(experts, rt, top_k, num_experts, plane)
        num_tokens = experts.shape[0]
        payloads, nbytes = self.check_payloads(payloads, num_tokens)
        if eplb_local_stats is not None:
            eplb_local_stats = self._check_eplb(eplb_local_stats)
        layout, layout_kw = self.layout(rt, nbytes, payloads,
                                        self.eplb_stats_num_experts if eplb_local_stats is not None else 0)
        if layout.dispatch_end > rounds.combine_floor:
            self._refuse_overlap(layout, rt, "input_payloads")
        if invalid_id is not None or ids_index is not None:
            ids_index, invalid_id = self._check_sanitize_args(payloads, invalid_id, ids_index)
        kw = {}
        eplb = None
        if eplb_local_stats is not None:
            kw["eplb_local_stats"] = eplb_local_stats
            kw["eplb_gathered"] = eplb = self._eplb_out
        if caller_mask is not None:
            kw["caller_mask"] = caller_mask
        if kw:
            plane.dispatch(experts, payloads, rt, layout, num_experts, **kw)
        else:
            plane.dispatch(experts, payloads, rt, layout, num_experts)
        rounds.owner, rounds.round = owner, Round(rt, num_tokens, layout, plane, eplb, layout_kw)
        received = self._received(layout, rt, nbytes, payloads)
        if ids_index is not None:
            plane.sanitize(received[ids_index], rt, invalid_id)
        return received, layout, eplb

    def dispatch_pairs(self, owner, x, topk_idx, rt, num_experts: int, caller_mask=None):
        """:meth:`dispatch` of a round whose tokens are the (token, k) pairs of ``topk_idx``
        (a2ad.deep_ep's, on the CUDA backend; the job's top_k is 1): the payloads are x's rows,
        one per pair with an expert, and each pair's metadata ``(token, expert id)`` (int32
        ``[2]``); CudaPlane.dispatch_pairs says what is sent. Returns the received views
        (rows ``[ep, rt, hidden]`` of x's dtype, metadata ``[ep, rt, 2]`` int32)."""
        plane, rt = self._begin_dispatch(owner, 1, num_experts, rt)
        dispatch_pairs = getattr(plane, "dispatch_pairs", None)
        if dispatch_pairs is None:
            raise errors.BackendError("dispatching (token, k) pairs needs the CUDA backend's kernels")
        rounds = self._rounds
        if not isinstance(x, torch.Tensor) or x.device != self.device:
            tensor_arg("x", x, self.device)
        if x.dim() != 2 or x.shape[1] < 1 or not x.is_contiguous():
            raise errors.InputError(f"x must be a contiguous [num_tokens, hidden] tensor, got {list(x.shape)}",
                                    argument="x")
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.device != self.device or topk_idx.dim() != 2
                or topk_idx.dtype not in (torch.int64, torch.int32) or topk_idx.shape[0] != x.shape[0]
                or not topk_idx.is_contiguous()):
            raise errors.InputError(f"topk_idx must be a contiguous int64 or int32 [{x.shape[0]}, K] tensor on "
                                    f"{self.device}", argument="topk_idx")
        num_pairs = topk_idx.shape[0] * topk_idx.shape[1]
        if num_pairs > rt:
            raise errors.InputError(f"{num_pairs} (token, k) pairs exceed runtime_max_tokens_per_rank ({rt})",
                                    argument="topk_idx")
        kinds = (x, self._pair_meta_kind)
        nbytes = (x.shape[1] * x.element_size(), self._pair_meta_kind.element_size() * 2)
        layout, layout_kw = self.layout(rt, nbytes, kinds, 0)
        if layout.dispatch_end > rounds.combine_floor:
            self._refuse_overlap(layout, rt, "x")
        dispatch_pairs(x, topk_idx, rt, layout, caller_mask=caller_mask)
        rounds.owner, rounds.round = owner, Round(rt, num_pairs, layout, plane, None, layout_kw)
        return self._received(layout, rt, nbytes, kinds)

    #: What the pairs' metadata payload is (int32; only its dtype is read).
    _pair_meta_kind = torch.empty(0, dtype=torch.int32)

    def _refuse_overlap(self, layout, rt: int, argument: str) -> None:
        """Refuse a dispatch whose payloads reach the previous round's combine region (the
        caller compared ``layout.dispatch_end`` with the rounds' ``combine_floor``)."""
        raise errors.InputError(
            f"these payloads need bytes [{self.att.aux.payload_data}, {layout.dispatch_end}) of every row at "
            f"runtime_max_tokens_per_rank={rt}, which overlap the previous round's combine region (from "
            f"{self._rounds.combine_floor}) that peers may still be reading; size the workspace for the dispatch "
            f"and combine payloads together (get_moe_workspace_size_per_rank)",
            argument=argument)

    def _received(self, layout, rt, nbytes, payloads) -> list:
        # the views depend on the bytes per token and the dtypes only (each is [ep, rt, -1])
        vkey = (rt, nbytes, *[p.dtype for p in payloads])
        received = self._views.get(vkey)
        if received is None:
            ws, ep, me = self.att.workspace, self.ep_size, self.ep_rank
            received = []
            for src, off, nb in zip(payloads, layout.dispatch_offsets, nbytes):
                view = ws[me, off : off + ep * rt * nb].view(src.dtype)
                received.append(view.view(ep, rt, -1))
            if len(self._views) > 256:
                self._views.clear()
            self._views[vkey] = received
        return list(received)

    def sanitize(self, expert_ids, invalid_expert_id) -> None:
        rnd = self.open_round("moe_a2a_sanitize_expert_ids")
        ids = tensor_arg("expert_ids", expert_ids, self.device)
        if ids.dtype != torch.int32 or ids.dim() != 3 or ids.shape[0] != self.ep_size or ids.shape[1] != rnd.rt:
            raise errors.InputError(
                f"expert_ids must be the received int32 [ep_size={self.ep_size}, runtime_max_tokens_per_rank="
                f"{rnd.rt}, top_k] payload, got {list(ids.shape)} {ids.dtype}",
                argument="expert_ids")
        invalid = int_arg("invalid_expert_id", invalid_expert_id, -(1 << 31), (1 << 31) - 1)
        rnd.plane.sanitize(ids, rnd.rt, invalid)

    def open_round(self, what: str) -> Round:
        rounds = self._rounds
        if rounds.round is None or rounds.owner is UNMAPPED:
            raise errors.StateError(f"{what} called before dispatch: this rank has no round open")
        return rounds.round

    # --- combine ----------------------------------------------------------------------
    def combine_layout(self, rnd: Round, bytes_per_token: int) -> L.PayloadLayout:
        """The round's layout with its combine region at the end of the row (moe_alltoall's module doc)."""
        lkw = rnd.layout_kw
        key = (bytes_per_token, lkw["_key"])
        layout = self._combine_layouts.get(key)
        if layout is None:
            try:
                layout = L.payload_layout(
                    self.att.aux, self.att.size_per_rank, rnd.rt, rnd.layout.dispatch_bytes_per_token, bytes_per_token,
                    **{k: v for k, v in lkw.items() if k != "_key"})
            except L.LayoutError as exc:
                raise errors.InputError(str(exc), argument="payload") from None
            if len(self._combine_layouts) > 256:
                self._combine_layouts.clear()
            self._combine_layouts[key] = layout
        return layout

    def combine_region(self, rnd: Round, hidden: int, dtype) -> torch.Tensor:
        if dtype not in COMBINE_DTYPES:
            raise errors.InputError(f"dtype must be bfloat16, float16 or float32, got {dtype}", argument="dtype")
        bytes_per_token = hidden * torch.empty((), dtype=dtype).element_size()
        off = self.combine_layout(rnd, bytes_per_token).combine_offset
        region = self.att.workspace[self.ep_rank, off : off + self.ep_size * rnd.rt * bytes_per_token]
        return region.view(dtype).view(self.ep_size, rnd.rt, hidden)

    def combine(self, owner, payload, rt, payload_in_workspace=False, *, local_num_tokens=None,
                combine_payload_offset=None, output=None, low_precision=False, caller_mask=None,
                end_round=None, pairs=None) -> torch.Tensor:
        """Check, combine the round ``owner`` dispatched, close it; returns ``[T, hidden]``.

        ``payload_in_workspace=True`` takes two placements: this rank's combine region
        (used in place) or FlashInfer's place for it, ``combine_payload_offset`` of this
        rank's row (staged into the region); anything else is refused.

        ``pairs`` (CUDA planes; a2ad.deep_ep): ``(stage_index, topk_idx, weights)``, the
        round's tokens being (token, k) pairs of ``topk_idx`` ``[T, K]``: the payload is any
        contiguous bf16 array of expert-output rows, slot (s, j) being its row
        ``stage_index[s * rt + j]``, and ``output`` (required, bf16 ``[T, hidden]``) gets
        each token's sum over k of ``weights[t, k]`` times its pair's row (pairs whose id is
        negative left out)."""
        att = self.att
        rounds = self._rounds
        rnd = rounds.round
        self.check_peers(rnd.plane if rnd is not None else self._plane, inputs=False)
        if rounds.owner is not owner:
            held = rounds.owner
            if held is None or held is UNMAPPED:
                what = "moe_a2a_combine called before moe_a2a_dispatch" if owner is FUNCTIONAL_OWNER else \
                    "combine called before dispatch"
                raise errors.StateError(f"{what}: this rank has no round open (the state is idle)")
            if owner is FUNCTIONAL_OWNER:
                raise errors.StateError("this rank's round was dispatched by a MoeAlltoAll: combine it with its combine()")
            raise errors.StateError(
                f"combine called before dispatch: the state is idle (this rank's open round was dispatched by "
                f"{_owner_name(held)}; combine it there)")
        if type(rt) is not int or rt != rnd.rt:
            rt = int_arg("runtime_max_tokens_per_rank", rt, 1, self.max_num_tokens)
            if rt != rnd.rt:
                raise errors.InputError(
                    f"runtime_max_tokens_per_rank ({rt}) differs from this round's dispatch ({rnd.rt})",
                    argument="runtime_max_tokens_per_rank")
        if local_num_tokens is not None:
            same("local_num_tokens", local_num_tokens, rnd.local_num_tokens, "the token count this rank dispatched")
        if combine_payload_offset is not None:
            same("combine_payload_offset", combine_payload_offset, rnd.layout.dispatch_end,
                 "this round's dispatch returned")
        if not isinstance(payload, torch.Tensor) or payload.device != self.device:
            tensor_arg("payload", payload, self.device)
        if payload.dtype not in COMBINE_DTYPES:
            raise errors.InputError(f"payload must be bfloat16, float16 or float32, got {payload.dtype}",
                                    argument="payload")
        shape = payload.shape
        if pairs is not None:
            return self._combine_pairs(owner, rnd, payload, rt, pairs, output, caller_mask, end_round)
        if len(shape) != 3 or shape[0] != self.ep_size or shape[1] != rt or shape[2] < 1:
            raise errors.InputError(
                f"payload must be [ep_size={self.ep_size}, runtime_max_tokens_per_rank={rt}, hidden], "
                f"got {list(shape)}",
                argument="payload")
        nbytes = shape[2] * payload.element_size()
        layout = self.combine_layout(rnd, nbytes)
        in_place = False
        if payload_in_workspace is True:
            region_ptr = att.workspace[self.ep_rank, layout.combine_offset:].data_ptr()
            contiguous = payload.is_contiguous()
            if contiguous and payload.data_ptr() == region_ptr:
                in_place = True
            else:
                fi_ptr = att.workspace[self.ep_rank, rnd.layout.dispatch_end:].data_ptr()
                if not (contiguous and payload.data_ptr() == fi_ptr):
                    raise errors.InputError(
                        "payload_in_workspace=True but payload is neither this rank's combine region "
                        "(MoeAlltoAll.get_combine_payload_tensor_in_workspace) nor the contiguous tensor at "
                        f"combine_payload_offset={rnd.layout.dispatch_end} of this rank's row "
                        "(moe_a2a_wrap_payload_tensor_in_workspace); pass payload_in_workspace=False",
                        argument="payload_in_workspace")
                payload = self._unaliased(payload, layout, nbytes, rt)
        elif payload_in_workspace is False:
            if not payload.is_contiguous():
                payload = payload.contiguous()
            elif owner is FUNCTIONAL_OWNER:
                payload = self._unaliased(payload, layout, nbytes, rt)
        else:
            raise errors.InputError("payload_in_workspace must be a bool", argument="payload_in_workspace")
        kw = {}
        copy_to = None
        if output is not None:
            output = self._check_output(output, rnd.local_num_tokens, shape[2],
                                        torch.bfloat16 if low_precision else payload.dtype)
            if _takes(rnd.plane, "output"):
                kw["output"] = output
            else:  # a plane that cannot write into the caller's buffer: one copy
                copy_to = output
        if low_precision:
            if payload.dtype is not torch.bfloat16:
                raise errors.InputError(
                    f"use_low_precision=True takes a bfloat16 payload, got {payload.dtype}",
                    argument="use_low_precision")
            kw["low_precision"] = True
        if caller_mask is not None:
            kw["caller_mask"] = caller_mask
        out = self._launch_combine(owner, rnd, layout, end_round, rnd.plane.combine, payload, rnd.local_num_tokens,
                                   rt, layout, in_place, **kw)
        if copy_to is not None:
            copy_to.copy_(out)
            return copy_to
        return out

    def _combine_pairs(self, owner, rnd, x, rt, pairs, output, caller_mask, end_round) -> torch.Tensor:
        """:meth:`combine` of a round of (token, k) pairs (its ``pairs`` argument)."""
        combine_pairs = getattr(rnd.plane, "combine_pairs", None)
        if combine_pairs is None:
            raise errors.BackendError("combining (token, k) pairs needs the CUDA backend's kernels")
        if x.dtype is not torch.bfloat16 or x.dim() < 2 or not x.is_contiguous():
            raise errors.InputError(f"payload must be a contiguous bfloat16 array of rows, got {list(x.shape)} "
                                    f"{x.dtype}", argument="payload")
        hidden = x.shape[-1]
        stage_index, topk_idx, weights = pairs
        if topk_idx.dim() != 2 or topk_idx.shape[0] * topk_idx.shape[1] != rnd.local_num_tokens:
            raise errors.InputError(f"topk_idx must be [T, K] with T * K = the {rnd.local_num_tokens} pairs this rank "
                                    f"dispatched, got {list(topk_idx.shape)}", argument="topk_idx")
        if output is None:
            raise errors.InputError("combining pairs needs output", argument="output")
        output = self._check_output(output, topk_idx.shape[0], hidden, torch.bfloat16)
        layout = self.combine_layout(rnd, hidden * x.element_size())
        self._launch_combine(owner, rnd, layout, end_round, combine_pairs, x, stage_index, topk_idx, weights, output,
                             rt, layout, caller_mask=caller_mask)
        return output

    def _launch_combine(self, owner, rnd, layout, end_round, launch, *args, **kw):
        """``launch(*args, **kw)``: the round's combine; the round ends whatever it does, then
        (the round being complete on every rank) the input errors the kernels found may surface."""
        att = self.att
        rounds = self._rounds
        rounds.combine_floor = layout.combine_offset
        try:
            out = launch(*args, **kw)
        finally:
            if rounds.owner is owner:
                rounds.owner = rounds.round = None
            if end_round is not None:
                end_round()
        if not att.control.quiet(self.ep_rank):
            rnd.plane.check_input()
        return out

    def _unaliased(self, payload, layout, nbytes, rt):
        """A payload that lies partly over the combine region would overlap itself when staged."""
        region = self.att.workspace[self.ep_rank, layout.combine_offset:]
        start = payload.data_ptr()
        end = start + payload.numel() * payload.element_size()
        r0 = region.data_ptr()
        r1 = r0 + self.ep_size * rt * nbytes
        if start < r1 and r0 < end:
            return payload.clone()
        return payload

    def _check_output(self, output, tokens: int, hidden: int, dtype) -> torch.Tensor:
        if not isinstance(output, torch.Tensor) or output.device != self.device:
            tensor_arg("output", output, self.device)
        if output.dtype != dtype or tuple(output.shape) != (tokens, hidden):
            raise errors.InputError(
                f"output must be [local_num_tokens={tokens}, hidden={hidden}] {dtype}, got {list(output.shape)} "
                f"{output.dtype}", argument="output")
        if not output.is_contiguous():
            raise errors.InputError(f"output must be contiguous, got stride={output.stride()}", argument="output")
        return output
