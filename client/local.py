"""Caller-owned workspaces: the functional ops over any ``[ep_size, size_per_rank]`` tensor.

FlashInfer's module functions run on a workspace the caller allocated (its own tests put
several ranks on one GPU in one process that way). :func:`moe_a2a_initialize` does the
same here: it initializes one rank's row of the tensor and registers a front end for
that rank, so that :func:`a2ad.client.moe_a2a_dispatch` and the other functional ops
find it by ``(workspace, ep_rank)``.

What a daemon attachment adds is absent here: no peer-loss detection, degraded mode or
daemon restarts. What remains is every check of the front end and bounded waits: a wait
on a rank that never arrives ends after ``timeout`` seconds in
:class:`~a2ad.errors.PeerTimeout` (host: in the call; CUDA: the kernel returns and the
next call raises), never a trap or a hang.

The ranks of one workspace tensor in one process share one control block (in host
memory, created with the first rank); ranks in other processes (an MNNVL allocation the
caller made and exchanged) have their own, so an abort of one process is not seen by the
others: their waits end by timeout.
"""

from __future__ import annotations

import mmap
import threading

import torch

from a2ad import errors, layout as L
from a2ad.control import ControlBlock

from .attach import RoundState
from .frontend import Front, int_arg

#: Seconds every wait on a peer may take on a caller-owned workspace (moe_a2a_initialize's default).
DEFAULT_TIMEOUT = 60.0


class _Shared:
    """What the ranks of one workspace tensor in this process share: its control block."""

    def __init__(self, workspace: torch.Tensor, ep_size: int):
        self.ep_size = ep_size
        self.device = workspace.device
        self._mm = mmap.mmap(-1, L.CONTROL_BLOCK_SIZE)
        self.control = ControlBlock(self._mm, owner=self._mm)
        self.control.initialize(ep_size)
        self.ranks: set[int] = set()


class LocalAttachment:
    """The attachment-like view of one rank of a caller-owned workspace (what the planes read)."""

    backend_kind = "local"
    forked = False
    generation = 0
    #: a caller-owned workspace has no lines tail (layout.ROW_TAIL_BYTES past its rows)
    lines_tail = 0
    on_peer_loss = "raise"

    def __init__(self, workspace: torch.Tensor, ep_rank: int, ep_size: int, max_num_tokens: int, aux, shared: _Shared,
                 eplb_stats_num_experts: int):
        self.job = f"local-{workspace.device}-{workspace.data_ptr():#x}"
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.workspace = workspace
        self.device = workspace.device
        self.backend = "cuda" if workspace.is_cuda else "host"
        self.size_per_rank = int(workspace.shape[1])
        self.row_stride = int(workspace.stride(0))
        self.aux = aux
        self.control = shared.control
        self.shared = shared
        self.spec = {"max_num_tokens": max_num_tokens, "eplb_stats_num_experts": eplb_stats_num_experts}
        self.rounds = RoundState(self.size_per_rank)

    def maintain(self, force: bool = False) -> None:
        """Nothing to maintain: no daemon."""

    def spec_for(self, top_k: int, num_experts: int) -> "LocalAttachment":
        """A shallow copy whose spec names ``top_k`` and ``num_experts`` (what a plane is made for)."""
        view = object.__new__(LocalAttachment)
        view.__dict__.update(self.__dict__)
        view.spec = dict(self.spec, top_k=top_k, num_experts=num_experts)
        return view


_LOCK = threading.Lock()
#: (device, data_ptr) -> the workspace's shared control block and the ranks initialized on it
_SHARED: dict[tuple[str, int], _Shared] = {}


def aux_for(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0):
    """The aux layout of a workspace (the EPLB region, if any, lies in each round's payload layout)."""
    return L.aux_layout(ep_size, max_num_tokens)


def initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts=0, *, timeout=DEFAULT_TIMEOUT,
               sm_budget=None) -> tuple[Front, torch.Tensor]:
    """Initialize ``ep_rank``'s row of ``workspace`` and make its front end; returns ``(front, metainfo)``."""
    if not isinstance(workspace, torch.Tensor):
        raise errors.InputError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}", argument="workspace")
    ep_size = int_arg("ep_size", ep_size, 1, L.MAX_EP_SIZE)
    ep_rank = int_arg("ep_rank", ep_rank, 0, ep_size - 1)
    max_num_tokens = int_arg("max_num_tokens", max_num_tokens, 1)
    eplb = int_arg("eplb_stats_num_experts", eplb_stats_num_experts, 0)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise errors.InputError(f"timeout must be a positive number of seconds, got {timeout!r}", argument="timeout")
    if workspace.dtype != torch.uint8 or workspace.dim() != 2 or workspace.shape[0] != ep_size \
            or workspace.stride(1) != 1 or workspace.shape[1] < 1:
        raise errors.InputError(
            f"workspace must be a [ep_size={ep_size}, size_per_rank] uint8 tensor with contiguous rows, got "
            f"{list(workspace.shape)} {workspace.dtype} with strides {list(workspace.stride())}",
            argument="workspace")
    if workspace.device.type not in ("cpu", "cuda"):
        raise errors.InputError(f"workspace must be on the CPU or a CUDA device, got {workspace.device}",
                                argument="workspace")
    aux = aux_for(ep_size, max_num_tokens, eplb)
    if aux.aux_bytes > workspace.shape[1] or aux.payload_data > workspace.shape[1]:
        raise errors.InputError(
            f"workspace rows of {workspace.shape[1]} bytes cannot hold the aux region ({aux.payload_data} bytes for "
            f"ep_size={ep_size}, max_num_tokens={max_num_tokens}); size them with "
            "moe_a2a_get_workspace_size_per_rank", argument="workspace")
    key = (str(workspace.device), int(workspace.data_ptr()))
    with _LOCK:
        shared = _SHARED.get(key)
        if shared is None or shared.ep_size != ep_size:
            shared = _SHARED[key] = _Shared(workspace, ep_size)
        shared.ranks.add(ep_rank)
    att = LocalAttachment(workspace, ep_rank, ep_size, max_num_tokens, aux, shared, eplb)
    _initialize_row(workspace, ep_rank, aux)
    timeout = float(timeout)

    def make_plane(top_k: int, num_experts: int):
        view = att.spec_for(top_k, num_experts)
        if workspace.is_cuda:
            from .cuda_plane import CudaPlane, sm_count

            budget = sm_budget
            if budget is None:  # ranks that share one GPU split its SMs (combine's grid is co-resident)
                n = len(shared.ranks)
                budget = max(1, sm_count(workspace.device) // (n + 1)) if n > 1 else 0
            return CudaPlane(view, timeout, sm_budget=budget)
        from .host_plane import HostPlane

        return HostPlane(view, timeout)

    front = Front(att, make_plane=make_plane, eplb_stats_num_experts=eplb)
    return front, front.metainfo.clone()


def _initialize_row(workspace: torch.Tensor, rank: int, aux) -> None:
    """Zero ``rank``'s aux region and set its FLAG_VAL to the first round (then synchronized)."""
    if workspace.is_cuda:
        from .cuda_plane import initialize_row

        with torch.cuda.device(workspace.device):
            initialize_row(workspace, rank, aux)
            torch.cuda.current_stream(workspace.device).synchronize()
        return
    workspace[rank, : aux.aux_bytes].zero_()
    workspace[rank, aux.flag_val : aux.flag_val + 4].view(torch.int32).fill_(L.INITIAL_ROUND)


def forget(workspace: torch.Tensor) -> None:
    """Drop the shared control block of ``workspace`` (its fronts must be released first)."""
    with _LOCK:
        _SHARED.pop((str(workspace.device), int(workspace.data_ptr())), None)
