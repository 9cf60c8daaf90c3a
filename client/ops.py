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

Finding the rank from the workspace
-----------------------------------
Our kernels need more than FlashInfer's arguments: the control block, the wait
timeout, the job's aux layout and the data plane. They are found from the workspace
tensor and ``ep_rank``: :class:`~a2ad.client.MoeAlltoAll` registers its front end
(``client/frontend.py``) here when it is created (:func:`register_plane`, keyed by the
workspace's device and data_ptr, holding only weak references) and unregisters it when it
closes (:func:`unregister_plane`); :func:`moe_a2a_initialize` registers a caller-owned
workspace's rank (any ``[ep_size, size_per_rank]`` uint8 tensor, CPU or CUDA; several
ranks of one tensor in one process are told apart by ``ep_rank``) until
:func:`moe_a2a_release` or the next initialize of that rank. A workspace with neither
raises :class:`~a2ad.errors.StateError`. Several MoeAlltoAll of one job and rank (one
per layer) share one workspace; any of them serves.

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
(``MoeAlltoAll.get_combine_payload_tensor_in_workspace``) is used in place, and one at
``combine_payload_offset`` of this rank's row is staged into the region (one copy); a
payload anywhere else (outside the workspace, or a copy made by the compiler) is refused
with InputError naming ``payload_in_workspace``, by these functions and by
``MoeAlltoAll.combine`` alike.

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

from .frontend import COMBINE_DTYPES, FUNCTIONAL_OWNER, Front, int_arg as _int_arg, rank_mask_arg, same as _same  # noqa: F401

__all__ = [
    "moe_a2a_initialize",
    "moe_a2a_release",
    "moe_a2a_dispatch",
    "moe_a2a_combine",
    "moe_a2a_sanitize_expert_ids",
    "moe_a2a_active_rank_mask",
    "register_plane",
    "unregister_plane",
    "registered",
]

#: Words of the active-rank mask (FlashInfer's MOE_A2A_RANK_MASK_WORDS): MASK_WORDS uint64 words,
#: up to MAX_EP_SIZE ranks (rank q: bit q & 63 of word q >> 6). FlashInfer's own one-word mask is
#: accepted for ep_size <= 64.
MOE_A2A_RANK_MASK_WORDS = L.MASK_WORDS
#: FlashInfer backend names a2ad honours (its kernels are a2ad's own whichever is named).
BACKENDS = ("trtllm",)


def check_backend(backend) -> None:
    """FlashInfer's ``backend`` argument: "trtllm" (the default) is accepted; "cake" and others are refused."""
    if backend not in BACKENDS:
        raise errors.InputError(
            f"backend={backend!r:.40} is not available in a2ad: its data plane is its own kernels (CUDA) or shared "
            "host memory, with FlashInfer's 'trtllm' semantics; pass backend='trtllm' (the default)",
            argument="backend")


# ---------------------------------------------------------------------------
# The registry: (workspace, ep_rank) -> the rank's front end
# ---------------------------------------------------------------------------
class _Entry:
    __slots__ = ("owner", "front", "_strong", "ep_rank")

    def __init__(self, owner, front: Front, strong: bool):
        self.owner = weakref.ref(owner) if owner is not None else None
        self.front = weakref.ref(front)
        self._strong = front if strong else None  # a caller-owned workspace's front lives in the registry
        self.ep_rank = front.ep_rank

    def live(self) -> Front | None:
        """The front end while its owner is alive and its attachment open, else None."""
        front = self.front()
        if front is None:
            return None
        if self.owner is not None:
            owner = self.owner()
            if owner is None or getattr(owner, "_closed", False):
                return None
        att = front.att
        if att.workspace is None or att.forked:
            return None
        return front


_LOCK = threading.Lock()
_REGISTRY: dict[tuple[str, int], list[_Entry]] = {}


def _key(workspace: torch.Tensor) -> tuple[str, int]:
    return str(workspace.device), int(workspace.data_ptr())


def _prune_locked() -> None:
    for key in [k for k, entries in _REGISTRY.items() if not any(e.live() for e in entries)]:
        del _REGISTRY[key]


def register_plane(owner, attachment, plane, front: Front | None = None) -> None:
    """Make ``attachment.workspace`` usable by the functional ops through ``owner``'s front end.

    ``owner`` (the MoeAlltoAll) and its front end are held weakly: the entry lapses when
    either is collected, when the attachment closes, or at :func:`unregister_plane`.
    Registering the same owner again is a no-op. ``front``: the owner's front end (default:
    ``owner._front``, else a new one over ``attachment`` and ``plane``)."""
    ws = attachment.workspace
    if not isinstance(ws, torch.Tensor):
        raise errors.StateError("register_plane: the attachment has no workspace (closed?)")
    if front is None:
        front = getattr(owner, "_front", None)
        if front is None:
            front = Front(attachment, plane)
            try:
                owner._front = front
            except AttributeError:
                pass
    key = _key(ws)
    with _LOCK:
        _prune_locked()
        entries = _REGISTRY.setdefault(key, [])
        if not any(e.owner is not None and e.owner() is owner for e in entries):
            entries.append(_Entry(owner, front, strong=False))


def unregister_plane(owner) -> None:
    """Drop every registry entry of ``owner``. Idempotent."""
    with _LOCK:
        for entries in _REGISTRY.values():
            entries[:] = [e for e in entries if e.owner is None or (e.owner() is not None and e.owner() is not owner)]
        _prune_locked()


def registered(owner) -> bool:
    """Whether ``owner`` has a live registry entry."""
    with _LOCK:
        return any(e.owner is not None and e.owner() is owner and e.live()
                   for entries in _REGISTRY.values() for e in entries)


def _no_workspace_error() -> errors.StateError:
    return errors.StateError(
        "this workspace has no live MoeAlltoAll in this process: the a2ad functional ops find the job "
        "(control block, timeouts, layout) through the MoeAlltoAll that owns the workspace. Create "
        "MoeAlltoAll(mapping, max_num_tokens, top_k, num_experts, ...) on this rank, pass its "
        ".workspace and .metainfo, and keep it open while you use the ops; or, for a workspace tensor you "
        "allocated, call moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens) first."
    )


def _resolve(workspace, ep_rank=None) -> Front:
    """The front end of ``(workspace, ep_rank)``; StateError if none. ``ep_rank`` picks among the
    ranks of one caller-owned workspace in this process (a daemon workspace has one)."""
    if not isinstance(workspace, torch.Tensor):
        raise errors.InputError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}", argument="workspace")
    found = None
    with _LOCK:
        for e in _REGISTRY.get(_key(workspace), ()):
            front = e.live()
            if front is not None:
                if found is None or (e.ep_rank == ep_rank and found.ep_rank != ep_rank):
                    found = front
                if found.ep_rank == ep_rank:
                    break
    if found is None:
        raise _no_workspace_error()
    full = found.att.workspace
    if workspace.shape != full.shape or workspace.stride() != full.stride() or workspace.dtype != torch.uint8:
        raise errors.InputError(
            f"workspace must be the whole [ep_size={found.ep_size}, size_per_rank={found.att.size_per_rank}] uint8 "
            f"workspace (MoeAlltoAll.workspace), got {list(workspace.shape)} {workspace.dtype} "
            f"with strides {list(workspace.stride())}",
            argument="workspace",
        )
    return found


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
                front = e.live()
                if front is None:
                    continue
                ws = front.att.workspace
                if (str(ws.device), ws.shape[0], ws.shape[1], ws.stride(0)) == (device, ep_size, size_per_rank, row_stride):
                    found.add(front.att.aux.payload_data)
    if not found:
        raise errors.StateError(
            f"no live MoeAlltoAll (or moe_a2a_initialize) in this process has a [{ep_size}, {size_per_rank}] "
            f"workspace on {device}: create it before tracing the functional ops, and pass its .workspace"
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
def _check_job(front: Front, metainfo, ep_rank, ep_size=None, top_k=None, num_experts=None) -> None:
    att = front.att
    _int_arg("ep_rank", ep_rank, 0, front.ep_size - 1)  # out of range says so, before "not this rank"
    _same("ep_rank", ep_rank, front.ep_rank, "this workspace's rank")
    if ep_size is not None:
        _same("ep_size", ep_size, front.ep_size, "the job's ep_size")
    spec = att.spec
    if top_k is not None and "top_k" in spec:
        _same("top_k", top_k, int(spec["top_k"]), "the job's top_k")
    if num_experts is not None and "num_experts" in spec:
        _same("num_experts", num_experts, int(spec["num_experts"]), "the job's num_experts")
    if not isinstance(metainfo, torch.Tensor) or metainfo.shape != (L.NUM_METAINFO_FIELDS,):
        raise errors.InputError(
            f"metainfo must be the [{L.NUM_METAINFO_FIELDS}] tensor MoeAlltoAll.metainfo (or moe_a2a_initialize) "
            "returns", argument="metainfo"
        )
    if metainfo.device.type == "cpu" and metainfo.tolist() != att.aux.metainfo():
        raise errors.InputError("metainfo does not belong to this workspace's job", argument="metainfo")


def _no_mask_error() -> errors.InputError:
    return errors.InputError(
        "enable_rank_mask=True needs an active_rank_mask (moe_a2a_active_rank_mask(ranks, ep_size)): with none, "
        "a2ad does not assume every rank active", argument="active_rank_mask")


def _rank_mask(front: Front, enable_rank_mask, active_rank_mask):
    if active_rank_mask is None:
        if enable_rank_mask is True:
            raise _no_mask_error()
        return None
    if enable_rank_mask is not True:
        raise errors.InputError(
            "active_rank_mask requires enable_rank_mask=True", argument="active_rank_mask")
    return rank_mask_arg("active_rank_mask", active_rank_mask, front.ep_rank, front.ep_size, front.device)


def _bytes_per_token(p: torch.Tensor) -> int:
    return math.prod(p.shape[1:]) * p.element_size()


# ---------------------------------------------------------------------------
# Real implementations
# ---------------------------------------------------------------------------
def _dispatch_run(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                  ep_rank, ep_size, top_k, num_experts, eplb_local_stats=None, caller_mask=None):
    """Check, dispatch, open the round; returns ``(front, received, layout, eplb_gathered)``."""
    front = _resolve(workspace, ep_rank)
    _check_job(front, metainfo, ep_rank, ep_size, top_k, num_experts)
    top_k = _int_arg("top_k", top_k, 1, L.MAX_TOP_K)
    num_experts = _int_arg("num_experts", num_experts, ep_size)
    received, layout, eplb = front.dispatch(
        FUNCTIONAL_OWNER, token_selected_experts, input_payloads, runtime_max_tokens_per_rank, top_k, num_experts,
        eplb_local_stats=eplb_local_stats, caller_mask=caller_mask,
    )
    return front, received, layout, eplb


def _dispatch_impl(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                   ep_rank, ep_size, top_k, num_experts, caller_mask=None) -> torch.Tensor:
    front, _, layout, _ = _dispatch_run(token_selected_experts, input_payloads, workspace, metainfo,
                                        runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                                        caller_mask=caller_mask)
    # a copy: a torch op may not return a view of its input (see the module doc)
    region = front.att.workspace[front.ep_rank, layout.dispatch_offsets[0] : layout.dispatch_end]
    return region.view(torch.int32).clone()


def _sanitize_impl(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id) -> None:
    front = _resolve(workspace, ep_rank)
    _check_job(front, metainfo, ep_rank)
    front.sanitize(expert_ids, invalid_expert_id)


def _combine_impl(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                  top_k, combine_payload_offset, payload_in_workspace=False, low_precision=False,
                  caller_mask=None) -> torch.Tensor:
    front = _resolve(workspace, ep_rank)
    _check_job(front, metainfo, ep_rank, ep_size, top_k)
    return front.combine(
        FUNCTIONAL_OWNER, payload, runtime_max_tokens_per_rank, payload_in_workspace,
        local_num_tokens=local_num_tokens, combine_payload_offset=combine_payload_offset,
        low_precision=low_precision, caller_mask=caller_mask,
    )


# ---------------------------------------------------------------------------
# The torch ops
# ---------------------------------------------------------------------------
# A fragment: the CUDA extension (csrc/bindings.cpp) owns the a2ad namespace's TORCH_LIBRARY.
_LIB = torch.library.Library("a2ad", "FRAGMENT")
_LIB.define(
    "moe_a2a_dispatch(Tensor token_selected_experts, Tensor[] input_payloads, Tensor workspace, "
    "Tensor(a!) metainfo, SymInt runtime_max_tokens_per_rank, int ep_rank, int ep_size, int top_k, "
    "int num_experts, Tensor? caller_mask=None) -> Tensor"
)
_LIB.define(
    "moe_a2a_sanitize_expert_ids(Tensor(a!) expert_ids, Tensor workspace, Tensor(b!) metainfo, int ep_rank, "
    "int invalid_expert_id) -> ()"
)
_LIB.define(
    "moe_a2a_combine(Tensor payload, SymInt local_num_tokens, Tensor workspace, Tensor(a!) metainfo, "
    "SymInt runtime_max_tokens_per_rank, int ep_rank, int ep_size, int top_k, int combine_payload_offset, "
    "bool payload_in_workspace=False, bool low_precision=False, Tensor? caller_mask=None) -> Tensor"
)
# CompositeExplicitAutograd: one implementation for every device (the plane picks the kernels).
_LIB.impl("moe_a2a_dispatch", _dispatch_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_a2a_sanitize_expert_ids", _sanitize_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_a2a_combine", _combine_impl, "CompositeExplicitAutograd")


def _received_bytes(input_payloads, ep_size, rt):
    """Bytes from the first received payload's start to the end of the last one's region."""
    return sum(L.pad_up(ep_size * rt * _bytes_per_token(p)) for p in input_payloads)


def _dispatch_fake(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                   ep_rank, ep_size, top_k, num_experts, caller_mask=None) -> torch.Tensor:
    return workspace.new_empty(_received_bytes(input_payloads, ep_size, runtime_max_tokens_per_rank) // 4, dtype=torch.int32)


def _sanitize_fake(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id) -> None:
    return None


def _combine_fake(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                  top_k, combine_payload_offset, payload_in_workspace=False, low_precision=False,
                  caller_mask=None) -> torch.Tensor:
    dtype = torch.bfloat16 if low_precision else payload.dtype
    return payload.new_empty((local_num_tokens, payload.shape[2]), dtype=dtype)


torch.library.register_fake("a2ad::moe_a2a_dispatch", _dispatch_fake, lib=_LIB)
torch.library.register_fake("a2ad::moe_a2a_sanitize_expert_ids", _sanitize_fake, lib=_LIB)
torch.library.register_fake("a2ad::moe_a2a_combine", _combine_fake, lib=_LIB)


# ---------------------------------------------------------------------------
# FlashInfer's module functions
# ---------------------------------------------------------------------------
def moe_a2a_initialize(
    workspace: torch.Tensor,
    ep_rank: int,
    ep_size: int,
    max_num_tokens: int,
    eplb_stats_num_experts: int = 0,
    *,
    backend: str = "trtllm",
    timeout: float | None = None,
    sm_budget: int | None = None,
) -> torch.Tensor:
    """Initialize ``ep_rank``'s row of a caller-owned ``[ep_size, size_per_rank]`` uint8 workspace
    (CPU: the host plane; CUDA: the kernels) and return its metainfo.

    Like FlashInfer's: call it once per rank and allocation, on every rank, before any
    dispatch (and let every rank finish it before any dispatches: a late initialize would
    erase a peer's first round); calling it again re-initializes the rank. The functional
    ops then find the rank by ``(workspace, ep_rank)``, also when several ranks of one
    tensor run in one process (threads, or CUDA streams). a2ad's additions, keyword-only:
    ``timeout`` (seconds, default 60) bounds every wait on a peer (PeerTimeout instead of a
    hang); ``sm_budget`` caps the SMs one CUDA launch may occupy (default: the GPU's SMs
    split between the ranks of the tensor initialized in this process).
    Release the rank with :func:`moe_a2a_release`.
    """
    check_backend(backend)
    from . import local

    front, meta = local.initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts,
                                   timeout=local.DEFAULT_TIMEOUT if timeout is None else timeout, sm_budget=sm_budget)
    key = _key(workspace)
    with _LOCK:
        _prune_locked()
        entries = _REGISTRY.setdefault(key, [])
        old = [e for e in entries if e.owner is None and e.ep_rank == front.ep_rank]
        entries[:] = [e for e in entries if e not in old]
        entries.append(_Entry(None, front, strong=True))
    for e in old:
        f = e.front()
        if f is not None:
            f.close()
    return meta


def moe_a2a_release(workspace: torch.Tensor, ep_rank: int | None = None) -> None:
    """Forget the caller-owned workspace's ranks (all, or ``ep_rank``) that :func:`moe_a2a_initialize`
    registered, and release their planes (CUDA: after the work queued on them). a2ad only."""
    if not isinstance(workspace, torch.Tensor):
        raise errors.InputError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}", argument="workspace")
    key = _key(workspace)
    with _LOCK:
        entries = _REGISTRY.get(key, [])
        gone = [e for e in entries if e.owner is None and (ep_rank is None or e.ep_rank == ep_rank)]
        entries[:] = [e for e in entries if e not in gone]
        if not entries:
            _REGISTRY.pop(key, None)
        rest = any(e.owner is None for e in entries)
    if workspace.is_cuda and gone:
        torch.cuda.synchronize(workspace.device)
    for e in gone:
        f = e.front()
        if f is not None:
            f.close()
    if not rest:
        from . import local

        local.forget(workspace)


def moe_a2a_active_rank_mask(active_ranks, ep_size: int) -> torch.Tensor:
    """FlashInfer's helper: a CPU uint64 ``[MOE_A2A_RANK_MASK_WORDS]`` tensor with bit ``i & 63`` of
    word ``i >> 6`` set for each rank i of ``active_ranks`` (a sequence or 1-D tensor of ranks in
    ``[0, ep_size)``)."""
    ep_size = _int_arg("ep_size", ep_size, 1, L.MAX_EP_SIZE)
    mask = 0
    for rank in active_ranks.tolist() if isinstance(active_ranks, torch.Tensor) else active_ranks:
        rank = _int_arg("active_ranks", rank, 0, ep_size - 1)
        mask |= 1 << rank
    signed = [w - (1 << 64) if w >> 63 else w for w in L.mask_words(mask)]
    return torch.tensor(signed, dtype=torch.int64).view(torch.uint64)


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
    enable_pdl: bool | None = None,
    eplb_local_stats: torch.Tensor | None = None,
    enable_rank_mask: bool = False,
    active_rank_mask: torch.Tensor | None = None,
    *,
    backend: str = "trtllm",
    recv_view_cache: dict | None = None,
) -> tuple[list[torch.Tensor], int, torch.Tensor | None]:
    """Dispatch this rank's tokens; return ``(received payloads, combine_payload_offset, eplb_gathered_stats)``.

    Like ``MoeAlltoAll.dispatch`` (same checks, same results): each received payload is
    ``[ep_size, runtime_max_tokens_per_rank, elements_per_token]`` of the input's dtype,
    valid until this rank's combine; outside torch.compile it is backed by this rank's
    workspace row (zero-copy), inside it is a copy (see the module doc).
    ``combine_payload_offset``: the row-relative end of this round's dispatch regions;
    pass it to :func:`moe_a2a_combine`. ``eplb_gathered_stats``: ``[ep_size,
    eplb_stats_num_experts]`` int32 (row r: rank r's ``eplb_local_stats``) when
    ``eplb_local_stats`` was given, else None. ``active_rank_mask`` (with
    ``enable_rank_mask=True``): :func:`moe_a2a_active_rank_mask`'s CPU tensor or an int64 /
    uint64 tensor of ``ceil(ep_size / 64)`` to MASK_WORDS words on the CPU or the device (rank q:
    bit q & 63 of word q >> 6; FlashInfer's one-word tensor for ep_size <= 64), combined with
    the job's own mask; ``enable_rank_mask=True`` without one is refused (InputError naming
    ``active_rank_mask``) before anything is written or waited for, as FlashInfer refuses it.
    ``enable_pdl`` and ``recv_view_cache`` are accepted and have no effect (the views
    are kept by a2ad itself). ``workspace``/``metainfo``: a live MoeAlltoAll's
    ``.workspace`` and ``.metainfo``, or a workspace :func:`moe_a2a_initialize` set up.
    """
    rt = runtime_max_tokens_per_rank
    if enable_rank_mask is True and active_rank_mask is None:
        raise _no_mask_error()
    if torch.compiler.is_compiling():
        if eplb_local_stats is not None:
            raise errors.InputError("eplb_local_stats is not supported inside torch.compile; dispatch it eagerly",
                                    argument="eplb_local_stats")
        mask = None
        if active_rank_mask is not None:
            mask = active_rank_mask.view(torch.int64) if active_rank_mask.dtype == torch.uint64 else active_rank_mask
        region = torch.ops.a2ad.moe_a2a_dispatch(
            token_selected_experts, input_payloads, workspace, metainfo, rt, ep_rank, ep_size, top_k, num_experts, mask
        )
        base = _payload_data_for(str(workspace.device), workspace.shape[0], workspace.shape[1], workspace.stride(0))
        # the layout a2ad.layout.payload_layout gives: 128-byte aligned regions one after another
        received, off = [], 0
        for p in input_payloads:
            size = ep_size * rt * _bytes_per_token(p)
            received.append(_cut(region, off, size, p.dtype).view(ep_size, rt, -1))
            off = L.pad_up(off + size)
        return received, base + off, None
    check_backend(backend)
    front = _resolve(workspace, ep_rank)
    mask = _rank_mask(front, enable_rank_mask, active_rank_mask)
    _, received, layout, eplb = _dispatch_run(
        token_selected_experts, input_payloads, workspace, metainfo, rt, ep_rank, ep_size, top_k, num_experts,
        eplb_local_stats=eplb_local_stats, caller_mask=mask,
    )
    return received, layout.dispatch_end, eplb


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
    expert_ids: torch.Tensor, workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int, invalid_expert_id: int,
    enable_pdl: bool | None = None, *, backend: str = "trtllm",
) -> None:
    """In the received expert-id payload, set every id of every slot that received no token to
    ``invalid_expert_id`` (in place)."""
    if not torch.compiler.is_compiling():
        check_backend(backend)
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
    output_dtype: torch.dtype | None = None,
    output_scales: torch.Tensor | None = None,
    output_scalar_scale: float = 1.0,
    sf_layout=None,
    output: torch.Tensor | None = None,
    *,
    use_low_precision: bool = False,
    enable_pdl: bool | None = None,
    enable_rank_mask: bool = False,
    active_rank_mask: torch.Tensor | None = None,
    backend: str = "trtllm",
) -> torch.Tensor:
    """Sum every local token's expert outputs; returns ``[local_num_tokens, hidden]``.

    ``payload``: ``[ep_size, runtime_max_tokens_per_rank, hidden]`` bfloat16/float16/float32.
    ``payload_in_workspace``: see the module doc. ``output``: write the result there (and
    return it). ``use_low_precision``: FP8 e4m3 rows on the wire, float32 sums, bfloat16
    out. ``output_dtype``/``output_scales``/``output_scalar_scale``/``sf_layout``: the
    result quantized (MXFP8, MXFP4, NVFP4), as FlashInfer's. ``active_rank_mask``: as in
    :func:`moe_a2a_dispatch`.
    """
    if enable_rank_mask is True and active_rank_mask is None:
        raise _no_mask_error()
    if torch.compiler.is_compiling():
        mask = None
        if active_rank_mask is not None:
            mask = active_rank_mask.view(torch.int64) if active_rank_mask.dtype == torch.uint64 else active_rank_mask
        out = torch.ops.a2ad.moe_a2a_combine(
            payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
            combine_payload_offset, payload_in_workspace, use_low_precision, mask,
        )
        return finish_output(out, output_dtype, output_scales, output_scalar_scale, sf_layout, output, copy=True)
    check_backend(backend)
    if output is not None:
        _check_output_early(output, workspace)
    front = _resolve(workspace, ep_rank)
    _check_job(front, metainfo, ep_rank, ep_size, top_k)
    mask = _rank_mask(front, enable_rank_mask, active_rank_mask)
    quantized = _quantized(output_dtype, output_scales)
    out = front.combine(
        FUNCTIONAL_OWNER, payload, runtime_max_tokens_per_rank, payload_in_workspace,
        local_num_tokens=local_num_tokens, combine_payload_offset=combine_payload_offset,
        # (a payload that is not a tensor is refused by front.combine, naming it)
        output=None if quantized or output_dtype not in (None, getattr(payload, "dtype", None)) else output,
        low_precision=use_low_precision, caller_mask=mask,
    )
    return finish_output(out, output_dtype, output_scales, output_scalar_scale, sf_layout, output,
                         copy=output is not None and out is not output)


def _check_output_early(output, workspace) -> None:
    """What is wrong with ``output`` whatever the workspace holds, checked first (as FlashInfer
    checks it before loading its kernels): a tensor, contiguous, and on the CUDA device the
    workspace is on, or a CPU tensor for a host workspace this process knows."""
    if not isinstance(output, torch.Tensor):
        raise errors.InputError(f"output must be a torch.Tensor, got {type(output).__name__}", argument="output")
    if output.device.type != "cuda":
        host = isinstance(workspace, torch.Tensor) and workspace.device.type == "cpu"
        if host:
            with _LOCK:
                host = any(e.live() is not None for e in _REGISTRY.get(_key(workspace), ()))
        if not host:
            raise errors.InputError(
                f"output must be a CUDA tensor, got device={output.device} (a CPU output only with a host workspace: "
                "the CPU workspace of a live MoeAlltoAll or of moe_a2a_initialize)", argument="output")
    if not output.is_contiguous():
        raise errors.InputError(f"output must be contiguous, got stride={output.stride()}", argument="output")


_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _quantized(output_dtype, output_scales) -> bool:
    """Whether ``output_dtype`` asks for a quantized result (FP8 / packed FP4), checked."""
    if output_dtype is None or output_dtype in _PLAIN_DTYPES:
        if output_scales is not None and output_dtype is None:
            raise errors.InputError("output_scales given without a quantized output_dtype", argument="output_scales")
        return False
    if not isinstance(output_dtype, torch.dtype):
        raise errors.InputError(f"output_dtype must be a torch.dtype, got {type(output_dtype).__name__}",
                                argument="output_dtype")
    return True


def finish_output(out, output_dtype, output_scales, output_scalar_scale, sf_layout, output, copy: bool):
    """The combine's result as the caller asked: quantized (client.quant), cast, or copied into ``output``."""
    if output_dtype is not None and output_dtype not in _PLAIN_DTYPES:
        from . import quant

        if sf_layout is None:
            sf_layout = quant.SfLayout.layout_linear
        q, _ = quant.quantize(out, output_dtype, sf_layout, scalar_scale=output_scalar_scale, out=output,
                              out_scales=output_scales)
        return q
    if output_dtype is not None and output_dtype != out.dtype:
        if output is not None:
            output.copy_(out)
            return output
        return out.to(output_dtype)
    if copy and output is not None:
        output.copy_(out)
        return output
    return out
