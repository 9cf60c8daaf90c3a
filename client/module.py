"""``get_moe_alltoall_module()``: FlashInfer's low-level module object, over a2ad's planes.

FlashInfer's ``flashinfer.comm.trtllm_moe_alltoall.get_moe_alltoall_module(backend="trtllm")``
returns the object its module-level functions call into (the JIT-built extension wrapped in
custom ops): ``moe_a2a_initialize``, ``moe_a2a_dispatch``, ``moe_a2a_combine``,
``moe_a2a_combine_into``, ``moe_a2a_sanitize_expert_ids``,
``moe_a2a_get_metainfo_index_pairs`` and ``moe_a2a_get_aux_data_size``, with that object's
signatures and results (``moe_a2a_dispatch`` returns offsets, not tensors). Code and tests that
call it, or replace it to see that a check comes before any kernel, work the same against
``a2ad.client``.

The functions here run a2ad's functional ops (``client/ops.py``) and take what they take:
a live MoeAlltoAll's workspace, or a caller-owned one set up by ``moe_a2a_initialize``; they are
eager calls (under ``torch.compile`` use the module-level functions). The object is built once
per process and backend; ``get_moe_alltoall_module.cache_clear()`` forgets it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from a2ad import errors, layout as L

from . import ops

__all__ = ["get_moe_alltoall_module"]


def _initialize(workspace: torch.Tensor, ep_rank: int, ep_size: int, max_num_tokens: int,
                eplb_stats_num_experts: int = 0) -> torch.Tensor:
    """Set up ``ep_rank``'s row of a caller-owned workspace; returns its metainfo."""
    return ops.moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts)


def _dispatch(token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank: int,
              ep_rank: int, ep_size: int, top_k: int, num_experts: int, enable_pdl: bool = False,
              eplb_local_stats=None, enable_rank_mask: bool = False, active_rank_mask=None):
    """Dispatch; returns FlashInfer's ``(recv_offsets, recv_sizes, combine_payload_offset,
    eplb_gathered_stats_offset, eplb_stats_num_experts)``.

    ``recv_offsets`` count bytes from the start of ``workspace`` (row ``ep_rank`` starts at
    ``ep_rank * workspace.stride(0)``), as ``moe_a2a_wrap_payload_tensor_in_workspace`` takes
    them with the leading shape ``[ep_size, runtime_max_tokens_per_rank]``; ``recv_sizes`` are
    the regions' bytes. ``combine_payload_offset`` is row-relative. Without
    ``eplb_local_stats`` the EPLB offset is -1 and the count 0; with it, the offset of the
    ``[ep_size, eplb_stats_num_experts]`` int32 region of this rank's row that holds every
    rank's statistics after the dispatch."""
    front = ops._resolve(workspace, ep_rank)
    mask = ops._rank_mask(front, enable_rank_mask, active_rank_mask)
    _, received, layout, eplb = ops._dispatch_run(
        token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
        top_k, num_experts, eplb_local_stats=eplb_local_stats, caller_mask=mask,
    )
    base = workspace.data_ptr()
    offsets = [t.data_ptr() - base for t in received]
    sizes = [t.numel() * t.element_size() for t in received]
    if eplb is None:
        return offsets, sizes, layout.dispatch_end, -1, 0
    return offsets, sizes, layout.dispatch_end, front.ep_rank * workspace.stride(0) + layout.eplb_offset, \
        layout.eplb_stats_num_experts


def _combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
             combine_payload_offset, payload_in_workspace=False, output_dtype=None, output_scales=None,
             output_scalar_scale=1.0, sf_layout=None, use_low_precision=False, enable_pdl=True,
             enable_rank_mask=False, active_rank_mask=None) -> torch.Tensor:
    """Combine; returns ``[local_num_tokens, hidden]`` (the module-level ``moe_a2a_combine``)."""
    return ops.moe_a2a_combine(
        payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
        combine_payload_offset, payload_in_workspace, output_dtype, output_scales, output_scalar_scale, sf_layout,
        use_low_precision=use_low_precision, enable_rank_mask=enable_rank_mask, active_rank_mask=active_rank_mask,
    )


def _combine_into(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                  top_k, combine_payload_offset, payload_in_workspace, output_dtype, output_scales,
                  output_scalar_scale, sf_layout, use_low_precision, enable_pdl, enable_rank_mask, active_rank_mask,
                  output) -> None:
    """Combine into the caller's ``output`` (every argument positional, as FlashInfer's); returns None."""
    if output is None:
        raise errors.InputError("moe_a2a_combine_into needs an output tensor", argument="output")
    ops.moe_a2a_combine(
        payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
        combine_payload_offset, payload_in_workspace, output_dtype, output_scales, output_scalar_scale, sf_layout,
        output, use_low_precision=use_low_precision, enable_rank_mask=enable_rank_mask,
        active_rank_mask=active_rank_mask,
    )


def _sanitize(expert_ids, workspace, metainfo, ep_rank: int, invalid_expert_id: int, enable_pdl: bool = False) -> None:
    ops.moe_a2a_sanitize_expert_ids(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id)


def _metainfo_index_pairs() -> tuple[list[str], list[int]]:
    """``(names, values)`` of the metainfo indices, named as FlashInfer's C++ names them
    (``MOE_A2A_`` + the name ``a2ad.client`` exports)."""
    names = list(L.METAINFO_INDEX)
    return [f"MOE_A2A_{n}" for n in names], [int(L.METAINFO_INDEX[n]) for n in names]


def _aux_data_size(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> int:
    """Bytes of a row before the payload regions: the aux region and the EPLB region of
    ``eplb_stats_num_experts`` experts, each padded to 128 bytes (so that
    ``moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, 0, 0, e)`` equals it)."""
    from .frontend import int_arg

    ep_size = int_arg("ep_size", ep_size, 1, L.MAX_EP_SIZE)
    max_num_tokens = int_arg("max_num_tokens", max_num_tokens, 1)
    eplb = int_arg("eplb_stats_num_experts", eplb_stats_num_experts, 0)
    return L.workspace_size_per_rank(ep_size, max_num_tokens, 0, 0, eplb)


@functools.cache
def _module(backend: str) -> SimpleNamespace:
    return SimpleNamespace(
        moe_a2a_initialize=_initialize,
        moe_a2a_dispatch=_dispatch,
        moe_a2a_combine=_combine,
        moe_a2a_combine_into=_combine_into,
        moe_a2a_sanitize_expert_ids=_sanitize,
        moe_a2a_get_metainfo_index_pairs=_metainfo_index_pairs,
        moe_a2a_get_aux_data_size=_aux_data_size,
    )


def get_moe_alltoall_module(backend: str = "trtllm") -> SimpleNamespace:
    """FlashInfer's module object (see the module doc): the same object on every call.
    ``backend``: "trtllm" (the default); others are refused with InputError, as everywhere in
    a2ad."""
    ops.check_backend(backend)
    return _module(backend)


get_moe_alltoall_module.cache_clear = _module.cache_clear  # type: ignore[attr-defined]
