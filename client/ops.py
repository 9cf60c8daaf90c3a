"""FlashInfer's functional MoE all-to-all API over a2ad workspaces, as torch ops.

FlashInfer (``flashinfer.comm.trtllm_moe_alltoall``) exposes module functions next to
``MoeAlltoAll``: ``moe_a2a_dispatch``, ``moe_a2a_combine`` and
``moe_a2a_sanitize_expert_ids`` take the workspace, the metainfo and the rank
geometry explicitly. This module provides the same functions (exported from
``a2ad.client``) and the torch ops behind them::

    torch.ops.a2ad.moe_a2a_dispatch(Tensor token_selected_experts, Tensor[] input_payloads,
        Tensor workspace, Tensor(a!) metainfo, SymInt runtime_max_tokens_per_rank,
        int ep_rank, int ep_size, int top_k, int num_experts) -> Tensor
    torch.ops.a2ad.moe_a2a_sanitize_expert_ids(Tensor(a!) expert_ids, Tensor workspace,
        Tensor(b!) metainfo, int ep_rank, int invalid_expert_id) -> ()
    torch.ops.a2ad.moe_a2a_combine(Tensor payload, SymInt local_num_tokens,
        Tensor workspace, Tensor(a!) metainfo, SymInt runtime_max_tokens_per_rank,
        int ep_rank, int ep_size, int top_k, int combine_payload_offset,
        bool payload_in_workspace=False) -> Tensor

Each has a fake (meta) implementation, so they trace under ``FakeTensorMode`` and
``torch.compile(fullgraph=True)`` (tested with the eager, aot_eager and inductor
backends). The dispatch op returns a copy of this rank's received bytes, from the first
received payload's region to the end of the last one's, as int32 (``[sum of 128-byte
padded ep_size * runtime_max_tokens_per_rank * bytes_i / 4]``).

Finding the job from the workspace
----------------------------------
Our kernels need more than FlashInfer's arguments: the control block, the wait
timeout, the job's aux layout and the data plane. They are found from the workspace
tensor: :class:`~a2ad.client.MoeAlltoAll` registers its data plane here when it
creates it (:func:`register_plane`, keyed by the workspace's device and data_ptr,
holding only weak references) and unregisters it when it closes
(:func:`unregister_plane`). A workspace with no live, open MoeAlltoAll in this
process raises :class:`~a2ad.errors.StateError`. Several MoeAlltoAll of one job and
rank (one per layer) share one workspace; any of them serves.

Received payloads and torch.compile (how aliasing is handled)
--------------------------------------------------------------
FlashInfer's dispatch returns tensors that live in the workspace, but a torch op may not
return views of its inputs. So:

* :func:`moe_a2a_dispatch` outside torch.compile (eager, CUDA graph capture) runs the
  dispatch directly and returns views of the workspace, zero-copy, exactly like
  ``MoeAlltoAll.dispatch``;
* while torch.compile traces it, it calls the dispatch op, which returns a copy of the
  received bytes, and cuts the payloads out of that copy with view ops. One extra copy
  of what this rank received, and nothing the compiler can get wrong.

No op declares the workspace as mutated, although dispatch and combine write it (and
peers write it all the time): it is shared memory outside the compiler's model. The
ops are kept alive and in program order by ``metainfo``, declared mutated (``Tensor(a!)``)
though no op writes it: functionalization threads it from op to op, and a mutating op
is never dead code. Cloning it costs 80 bytes. What does not work, on torch 2.13:

* declaring the workspace mutated (FlashInfer's ``mutates_args=("workspace",)``) with
  views cut from the workspace afterwards: aot_eager hands the op a copy of the whole
  workspace and copies it back over every rank's row at the end of the graph (stale
  bytes over what peers wrote); inductor re-inplaces dispatch and combine, but not a
  sanitize of a view of the workspace, and then does the same;
* returning the offsets as ints, as FlashInfer's op does: dynamo cannot put an op that
  returns an int in a graph (a graph break; fullgraph=True fails), and functionalization
  refuses an ``int[]`` return on a mutating op;
* returning the received tensors as undeclared views: torch warns that this is deprecated
  (to become an error), and inductor computes wrong results;
* alias-annotated outputs (``Tensor(a)``), and ``Tensor[]`` outputs of a mutating op:
  functionalization refuses both.

Inside a compiled region, do not write into the workspace yourself (e.g. the combine
payload at ``combine_payload_offset``): functionalization would copy the workspace back
as a whole. Pass the expert outputs with ``payload_in_workspace=False``.

Combine and ``combine_payload_offset``
--------------------------------------
Our combine region lies at the end of every row (see ``moe_alltoall``'s module doc),
not after the dispatch regions, so its place depends on the combine width, which
dispatch does not know. ``combine_payload_offset`` keeps FlashInfer's meaning: the
row-relative offset of the first byte after this round's dispatch regions, where a
FlashInfer caller may put its combine payload
(``moe_a2a_wrap_payload_tensor_in_workspace``, outside torch.compile); combine checks it. With
``payload_in_workspace=True`` a payload that is exactly this rank's combine region
(``MoeAlltoAll.get_combine_payload_tensor_in_workspace``) is used in place; a payload
anywhere else (e.g. at ``combine_payload_offset``, or a copy made by the compiler) is
staged into the region like ``payload_in_workspace=False``: the same result, one copy.

Rounds
------
The functional ops share the rank's round state with every MoeAlltoAll on the same
attachment: one round at a time. A round dispatched with :func:`moe_a2a_dispatch` is
combined with :func:`moe_a2a_combine` (MoeAlltoAll.combine refuses it, and the reverse);
after PeerTimeout/PeerLost call ``recover()`` on a MoeAlltoAll of the rank.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from a2ad import errors, layout as L

from .moe_alltoall import _int_arg

__all__ = [
    "moe_a2a_dispatch",
    "moe_a2a_combine",
    "moe_a2a_sanitize_expert_ids",
    "register_plane",
    "unregister_plane",
    "registered",
]

COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------
# The registry: workspace -> (attachment, plane) of a live MoeAlltoAll
# ---------------------------------------------------------------------------
class _Entry:
    __slots__ = ("owner", "att", "plane")

    def __init__(self, owner, att, plane):
        self.owner = weakref.ref(owner)
        self.att = weakref.ref(att)
        self.plane = weakref.ref(plane)

    def live(self):
        """``(att, plane)`` while the owner is alive and its attachment open, else None."""
        owner, att, plane = self.owner(), self.att(), self.plane()
        if owner is None or att is None or plane is None or getattr(owner, "_closed", False):
            return None
        if att.workspace is None or att.forked:
            return None
        return att, plane


_LOCK = threading.Lock()
_REGISTRY: dict[tuple[str, int], list[_Entry]] = {}


def _key(workspace: torch.Tensor) -> tuple[str, int]:
    return str(workspace.device), int(workspace.data_ptr())


def _prune_locked() -> None:
    for key in [k for k, entries in _REGISTRY.items() if not any(e.live() for e in entries)]:
        del _REGISTRY[key]


def register_plane(owner, attachment, plane) -> None:
    """Make ``attachment.workspace`` usable by the functional ops through ``plane``.

    ``owner`` (the MoeAlltoAll), ``attachment`` and ``plane`` are held weakly: the
    entry lapses when any of them is collected, when the attachment closes, or at
    :func:`unregister_plane`. Registering the same owner again is a no-op.
    """
    ws = attachment.workspace
    if not isinstance(ws, torch.Tensor):
        raise errors.StateError("register_plane: the attachment has no workspace (closed?)")
    key = _key(ws)
    with _LOCK:
        _prune_locked()
        entries = _REGISTRY.setdefault(key, [])
        if not any(e.owner() is owner for e in entries):
            entries.append(_Entry(owner, attachment, plane))


def unregister_plane(owner) -> None:
    """Drop every registry entry of ``owner``. Idempotent."""
    with _LOCK:
        for entries in _REGISTRY.values():
            entries[:] = [e for e in entries if e.owner() is not None and e.owner() is not owner]
        _prune_locked()


def registered(owner) -> bool:
    """Whether ``owner`` has a live registry entry."""
    with _LOCK:
        return any(e.owner() is owner and e.live() for entries in _REGISTRY.values() for e in entries)


def _no_workspace_error() -> errors.StateError:
    return errors.StateError(
        "this workspace has no live MoeAlltoAll in this process: the a2ad functional ops find the job "
        "(control block, timeouts, layout) through the MoeAlltoAll that owns the workspace. Create "
        "MoeAlltoAll(mapping, max_num_tokens, top_k, num_experts, ..., job=...) on this rank, pass its "
        ".workspace and .metainfo, and keep it open while you use the ops."
    )


def _resolve(workspace):
    """``(att, plane)`` of the live MoeAlltoAll that owns ``workspace``; StateError if none."""
    if not isinstance(workspace, torch.Tensor):
        raise errors.InputError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}", argument="workspace")
    with _LOCK:
        for e in _REGISTRY.get(_key(workspace), ()):
            found = e.live()
            if found is not None:
                break
        else:
            found = None
    if found is None:
        raise _no_workspace_error()
    att, plane = found
    full = att.workspace
    if workspace.shape != full.shape or workspace.stride() != full.stride() or workspace.dtype != torch.uint8:
        raise errors.InputError(
            f"workspace must be the whole [ep_size={att.ep_size}, size_per_rank={att.size_per_rank}] uint8 "
            f"workspace (MoeAlltoAll.workspace), got {list(workspace.shape)} {workspace.dtype} "
            f"with strides {list(workspace.stride())}",
            argument="workspace",
        )
    return att, plane


@torch.compiler.assume_constant_result
def _payload_data_for(device: str, ep_size: int, size_per_rank: int, row_stride: int) -> int:
    """PAYLOAD_DATA of the live workspaces of this geometry (while tracing, data_ptr is unknown).

    Evaluated once at trace time. The offset depends only on (ep_size, max_num_tokens),
    so jobs of one geometry agree unless their max_num_tokens differ: then StateError.
    """
    found = set()
    with _LOCK:
        for entries in _REGISTRY.values():
            for e in entries:
                live = e.live()
                if live is None:
                    continue
                ws = live[0].workspace
                if (str(ws.device), ws.shape[0], ws.shape[1], ws.stride(0)) == (device, ep_size, size_per_rank, row_stride):
                    found.add(live[0].aux.payload_data)
    if not found:
        raise errors.StateError(
            f"no live MoeAlltoAll in this process has a [{ep_size}, {size_per_rank}] workspace on {device}: "
            "create the MoeAlltoAll before tracing the functional ops, and pass its .workspace"
        )
    if len(found) > 1:
        raise errors.StateError(
            f"several live jobs with [{ep_size}, {size_per_rank}] workspaces on {device} differ in layout "
            "(max_num_tokens); the compiler cannot tell them apart: give them different workspace sizes"
        )
    return found.pop()


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------
def _same(name: str, value, expected: int, what: str) -> None:
    if _int_arg(name, value, -(1 << 62)) != expected:
        raise errors.InputError(f"{name} is {value}, but {what} is {expected}", argument=name)


def _check_job(att, metainfo, ep_rank, ep_size=None, top_k=None) -> None:
    _same("ep_rank", ep_rank, att.ep_rank, "this workspace's rank")
    if ep_size is not None:
        _same("ep_size", ep_size, att.ep_size, "the job's ep_size")
    if top_k is not None:
        _same("top_k", top_k, int(att.spec["top_k"]), "the job's top_k")
    if not isinstance(metainfo, torch.Tensor) or metainfo.shape != (L.NUM_METAINFO_FIELDS,):
        raise errors.InputError(
            f"metainfo must be the [{L.NUM_METAINFO_FIELDS}] tensor MoeAlltoAll.metainfo returns", argument="metainfo"
        )
    if metainfo.device.type == "cpu" and metainfo.tolist() != att.aux.metainfo():
        raise errors.InputError("metainfo does not belong to this workspace's job", argument="metainfo")


def _check_peers(att, plane, inputs: bool) -> None:
    """Raise what the plane knows about a lost or silent peer (the rank's round is then over)
    and, with ``inputs``, what its kernels found wrong in an earlier call's input. As
    MoeAlltoAll does; never synchronizes."""
    if att.forked:
        raise errors.StateError("this workspace was inherited through fork; create a MoeAlltoAll in this process")
    att.maintain()
    try:
        plane.check()
    except (errors.PeerTimeout, errors.PeerLost, errors.JobDestroyed):
        att.rounds.owner = att.rounds.round = None
        raise
    if inputs:
        plane.check_input()


def _tensor(name: str, value, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise errors.InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}", argument=name)
    if value.device != device:
        raise errors.InputError(f"{name} is on {value.device}; this rank's workspace is on {device}", argument=name)
    return value


def _bytes_per_token(p: torch.Tensor) -> int:
    return math.prod(p.shape[1:]) * p.element_size()


#: The owner of a round dispatched through the functional ops (MoeAlltoAll objects use their own tokens).
FUNCTIONAL_OWNER = object()


class _Round:
    __slots__ = ("rt", "local_num_tokens", "layout", "plane")

    def __init__(self, rt, local_num_tokens, layout, plane):
        self.rt = rt
        self.local_num_tokens = local_num_tokens
        self.layout = layout
        self.plane = plane


# ---------------------------------------------------------------------------
# Real implementations
# ---------------------------------------------------------------------------
def _dispatch_run(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                  ep_rank, ep_size, top_k, num_experts):
    """Check, dispatch, open the round; returns ``(att, layout)``."""
    att, plane = _resolve(workspace)
    _check_job(att, metainfo, ep_rank, ep_size, top_k)
    _same("num_experts", num_experts, int(att.spec["num_experts"]), "the job's num_experts")
    _check_peers(att, plane, inputs=True)
    rounds = att.rounds
    if rounds.owner is not None:
        who = "moe_a2a_dispatch" if rounds.owner is FUNCTIONAL_OWNER else "a MoeAlltoAll"
        raise errors.StateError(
            f"this rank has a round open (dispatched by {who}, not combined yet): the workspace holds one "
            "round at a time; combine it first"
        )
    max_tokens = int(att.spec["max_num_tokens"])
    rt = _int_arg("runtime_max_tokens_per_rank", runtime_max_tokens_per_rank, 1, max_tokens)
    experts = _tensor("token_selected_experts", token_selected_experts, att.device)
    if experts.dtype not in (torch.int32, torch.int64) or experts.dim() != 2 or experts.shape[1] != top_k:
        raise errors.InputError(
            f"token_selected_experts must be [local_num_tokens, top_k={top_k}] int32, got "
            f"{list(experts.shape)} {experts.dtype}",
            argument="token_selected_experts",
        )
    num_tokens = experts.shape[0]
    if num_tokens > rt:
        raise errors.InputError(
            f"local_num_tokens ({num_tokens}) exceeds runtime_max_tokens_per_rank ({rt})",
            argument="token_selected_experts",
        )
    # Host tensors are range-checked here. The CUDA kernels route an id outside
    # [0, num_experts) nowhere and report it later (check_input), so no call reads ids back.
    host_ids = getattr(plane, "checks_ids_on_host", True) and not (
        experts.is_cuda and torch.cuda.is_current_stream_capturing()
    )
    if num_tokens and host_ids:
        outside = (experts < 0) | (experts >= num_experts)
        if bool(outside.any()):
            raise errors.InputError(
                f"token_selected_experts holds expert id {experts[outside][0].item()}, outside "
                f"[0, num_experts={num_experts})",
                argument="token_selected_experts",
            )
    if experts.dtype == torch.int64 and not host_ids:  # an id outside int32 must stay outside when narrowed
        experts = experts.clamp(-1, num_experts)
    experts = experts.to(torch.int32).contiguous()
    if not isinstance(input_payloads, (list, tuple)) or not 1 <= len(input_payloads) <= L.MAX_PAYLOADS:
        raise errors.InputError(f"input_payloads must be a list of 1 to {L.MAX_PAYLOADS} tensors", argument="input_payloads")
    views = []
    for i, p in enumerate(input_payloads):
        name = f"input_payloads[{i}]"
        p = _tensor(name, p, att.device)
        if p.dim() < 1 or p.shape[0] != num_tokens or _bytes_per_token(p) == 0:
            raise errors.InputError(
                f"{name} must be [local_num_tokens={num_tokens}, ...] with bytes per token, got {list(p.shape)}",
                argument=name,
            )
        views.append(p.contiguous().reshape(num_tokens, math.prod(p.shape[1:])).view(torch.uint8))
    try:
        layout = L.payload_layout(att.aux, att.size_per_rank, rt, [v.shape[1] for v in views])
    except L.LayoutError as exc:
        raise errors.InputError(str(exc), argument="input_payloads") from None
    if layout.dispatch_end > rounds.combine_floor:
        raise errors.InputError(
            f"these payloads need bytes up to {layout.dispatch_end} of every row at runtime_max_tokens_per_rank={rt}, "
            f"which overlap the previous round's combine region (from {rounds.combine_floor}) that peers may still "
            "be reading; size the workspace for the dispatch and combine payloads together",
            argument="input_payloads",
        )
    plane.dispatch(experts, views, rt, layout, num_experts)
    rounds.owner, rounds.round = FUNCTIONAL_OWNER, _Round(rt, num_tokens, layout, plane)
    return att, layout


def _dispatch_impl(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                   ep_rank, ep_size, top_k, num_experts) -> torch.Tensor:
    att, layout = _dispatch_run(token_selected_experts, input_payloads, workspace, metainfo,
                                runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts)
    # a copy: a torch op may not return a view of its input (see the module doc)
    region = att.workspace[att.ep_rank, layout.dispatch_offsets[0] : layout.dispatch_end]
    return region.view(torch.int32).clone()


def _open_round(att, what: str):
    rounds = att.rounds
    if rounds.round is None:
        raise errors.StateError(f"{what} called before dispatch: this rank has no round open")
    return rounds.round


def _sanitize_impl(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id) -> None:
    att, plane = _resolve(workspace)
    _check_job(att, metainfo, ep_rank)
    rnd = _open_round(att, "moe_a2a_sanitize_expert_ids")
    ids = _tensor("expert_ids", expert_ids, att.device)
    if ids.dtype != torch.int32 or ids.dim() != 3 or ids.shape[0] != att.ep_size or ids.shape[1] != rnd.rt:
        raise errors.InputError(
            f"expert_ids must be the received int32 [ep_size={att.ep_size}, runtime_max_tokens_per_rank={rnd.rt}, "
            f"top_k] payload, got {list(ids.shape)} {ids.dtype}",
            argument="expert_ids",
        )
    invalid = _int_arg("invalid_expert_id", invalid_expert_id, -(1 << 31), (1 << 31) - 1)
    getattr(rnd, "plane", plane).sanitize(ids, rnd.rt, invalid)


def _combine_impl(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                  top_k, combine_payload_offset, payload_in_workspace=False) -> torch.Tensor:
    att, _ = _resolve(workspace)
    _check_job(att, metainfo, ep_rank, ep_size, top_k)
    rounds = att.rounds
    if rounds.owner is not FUNCTIONAL_OWNER:
        if rounds.owner is None:
            raise errors.StateError("moe_a2a_combine called before moe_a2a_dispatch: this rank has no round open")
        raise errors.StateError("this rank's round was dispatched by a MoeAlltoAll: combine it with its combine()")
    rnd = rounds.round
    _check_peers(att, rnd.plane, inputs=False)
    _same("runtime_max_tokens_per_rank", runtime_max_tokens_per_rank, rnd.rt, "this round's dispatch value")
    rt = rnd.rt
    _same("local_num_tokens", local_num_tokens, rnd.local_num_tokens, "the token count this rank dispatched")
    _same("combine_payload_offset", combine_payload_offset, rnd.layout.dispatch_end, "this round's dispatch returned")
    payload = _tensor("payload", payload, att.device)
    if payload.dtype not in COMBINE_DTYPES:
        raise errors.InputError(f"payload must be bfloat16, float16 or float32, got {payload.dtype}", argument="payload")
    if payload.dim() != 3 or payload.shape[0] != att.ep_size or payload.shape[1] != rt or payload.shape[2] < 1:
        raise errors.InputError(
            f"payload must be [ep_size={att.ep_size}, runtime_max_tokens_per_rank={rt}, hidden], got {list(payload.shape)}",
            argument="payload",
        )
    if not isinstance(payload_in_workspace, bool):
        raise errors.InputError("payload_in_workspace must be a bool", argument="payload_in_workspace")
    nbytes = payload.shape[2] * payload.element_size()
    try:
        layout = L.payload_layout(att.aux, att.size_per_rank, rt, rnd.layout.dispatch_bytes_per_token, nbytes)
    except L.LayoutError as exc:
        raise errors.InputError(str(exc), argument="payload") from None
    region = att.workspace[att.ep_rank, layout.combine_offset : layout.combine_offset + att.ep_size * rt * nbytes]
    in_place = payload_in_workspace and payload.is_contiguous() and payload.data_ptr() == region.data_ptr()
    if not in_place:
        payload = payload.contiguous()
        start, end = payload.data_ptr(), payload.data_ptr() + payload.numel() * payload.element_size()
        if start < region.data_ptr() + region.numel() and region.data_ptr() < end:
            payload = payload.clone()  # lies partly over the combine region: staging would overlap itself
    rounds.combine_floor = layout.combine_offset
    try:
        out = rnd.plane.combine(payload, rnd.local_num_tokens, rt, layout, in_place)
    finally:
        rounds.owner = rounds.round = None
    rnd.plane.check_input()  # the round is complete everywhere: input errors may surface
    return out


# ---------------------------------------------------------------------------
# The torch ops
# ---------------------------------------------------------------------------
# A fragment: the CUDA extension (csrc/bindings.cpp) owns the a2ad namespace's TORCH_LIBRARY.
_LIB = torch.library.Library("a2ad", "FRAGMENT")
_LIB.define(
    "moe_a2a_dispatch(Tensor token_selected_experts, Tensor[] input_payloads, Tensor workspace, "
    "Tensor(a!) metainfo, SymInt runtime_max_tokens_per_rank, int ep_rank, int ep_size, int top_k, "
    "int num_experts) -> Tensor"
)
_LIB.define(
    "moe_a2a_sanitize_expert_ids(Tensor(a!) expert_ids, Tensor workspace, Tensor(b!) metainfo, int ep_rank, "
    "int invalid_expert_id) -> ()"
)
_LIB.define(
    "moe_a2a_combine(Tensor payload, SymInt local_num_tokens, Tensor workspace, Tensor(a!) metainfo, "
    "SymInt runtime_max_tokens_per_rank, int ep_rank, int ep_size, int top_k, int combine_payload_offset, "
    "bool payload_in_workspace=False) -> Tensor"
)
# CompositeExplicitAutograd: one implementation for every device (the plane picks the kernels).
_LIB.impl("moe_a2a_dispatch", _dispatch_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_a2a_sanitize_expert_ids", _sanitize_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_a2a_combine", _combine_impl, "CompositeExplicitAutograd")


def _received_bytes(input_payloads, ep_size, rt):
    """Bytes from the first received payload's start to the end of the last one's region."""
    return sum(L.pad_up(ep_size * rt * _bytes_per_token(p)) for p in input_payloads)


def _dispatch_fake(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                   ep_rank, ep_size, top_k, num_experts) -> torch.Tensor:
    return workspace.new_empty(_received_bytes(input_payloads, ep_size, runtime_max_tokens_per_rank) // 4, dtype=torch.int32)


def _sanitize_fake(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id) -> None:
    return None


def _combine_fake(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                  top_k, combine_payload_offset, payload_in_workspace=False) -> torch.Tensor:
    return payload.new_empty((local_num_tokens, payload.shape[2]))


torch.library.register_fake("a2ad::moe_a2a_dispatch", _dispatch_fake, lib=_LIB)
torch.library.register_fake("a2ad::moe_a2a_sanitize_expert_ids", _sanitize_fake, lib=_LIB)
torch.library.register_fake("a2ad::moe_a2a_combine", _combine_fake, lib=_LIB)


# ---------------------------------------------------------------------------
# FlashInfer's module functions
# ---------------------------------------------------------------------------
def moe_a2a_dispatch(
    token_selected_experts: torch.Tensor,
    input_payloads: list[torch.Tensor],
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
) -> tuple[list[torch.Tensor], int]:
    """Dispatch this rank's tokens; return ``(received payloads, combine_payload_offset)``.

    Like ``MoeAlltoAll.dispatch`` (same checks, same results): each received payload is
    ``[ep_size, runtime_max_tokens_per_rank, elements_per_token]`` of the input's dtype,
    valid until this rank's combine; outside torch.compile it is backed by this rank's
    workspace row (zero-copy), inside it is a copy (see the module doc).
    ``combine_payload_offset``: the row-relative end of this round's dispatch regions;
    pass it to :func:`moe_a2a_combine`. ``workspace``/``metainfo``: a live
    MoeAlltoAll's ``.workspace`` and ``.metainfo``.
    """
    rt = runtime_max_tokens_per_rank
    if torch.compiler.is_compiling():
        region = torch.ops.a2ad.moe_a2a_dispatch(
            token_selected_experts, input_payloads, workspace, metainfo, rt, ep_rank, ep_size, top_k, num_experts
        )
        base = _payload_data_for(str(workspace.device), workspace.shape[0], workspace.shape[1], workspace.stride(0))
    else:
        att, layout = _dispatch_run(
            token_selected_experts, input_payloads, workspace, metainfo, rt, ep_rank, ep_size, top_k, num_experts
        )
        base = layout.dispatch_offsets[0]
        region = workspace[ep_rank, base : layout.dispatch_end]
    # the layout a2ad.layout.payload_layout gives: 128-byte aligned regions one after another
    received, off = [], 0
    for p in input_payloads:
        size = ep_size * rt * _bytes_per_token(p)
        received.append(_cut(region, off, size, p.dtype).view(ep_size, rt, -1))
        off = L.pad_up(off + size)
    return received, base + off


def _cut(region: torch.Tensor, off: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[off, off + size)`` of ``region`` as ``dtype``.

    The compiled path's region is int32 and int32 payloads (the expert ids, which sanitize
    mutates) are cut from it by a plain slice: inductor (torch 2.13) miscompiles a mutation
    through a view whose dtype differs from its base's.
    """
    if region.dtype == dtype:
        step = region.element_size()
        return region[off // step : (off + size) // step]
    return region.view(torch.uint8)[off : off + size].view(dtype)


def moe_a2a_sanitize_expert_ids(
    expert_ids: torch.Tensor, workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int, invalid_expert_id: int
) -> None:
    """In the received expert-id payload, set every id of every slot that received no token to
    ``invalid_expert_id`` (in place)."""
    torch.ops.a2ad.moe_a2a_sanitize_expert_ids(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id)


def moe_a2a_combine(
    payload: torch.Tensor,
    local_num_tokens: int,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    combine_payload_offset: int,
    payload_in_workspace: bool = False,
) -> torch.Tensor:
    """Sum every local token's expert outputs; returns ``[local_num_tokens, hidden]``.

    ``payload``: ``[ep_size, runtime_max_tokens_per_rank, hidden]`` bfloat16/float16/float32.
    ``payload_in_workspace``: see the module doc (a payload outside this rank's combine
    region is staged, so the result is the same either way).
    """
    return torch.ops.a2ad.moe_a2a_combine(
        payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
        combine_payload_offset, payload_in_workspace,
    )
