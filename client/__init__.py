"""a2ad client library: attach to a job through the daemon and move tokens with MoeAlltoAll."""

from a2ad.errors import (
    A2ADError,
    BackendError,
    DaemonUnavailable,
    Draining,
    InputError,
    InvalidField,
    JobDestroyed,
    LimitExceeded,
    NoSuchJob,
    PeerLeft,
    PeerLost,
    PeerTimeout,
    PermissionDenied,
    ProtocolError,
    RankTaken,
    RendezvousTimeout,
    SpecMismatch,
    StateError,
)

from .attach import Attachment, attach
from .connection import DaemonClient, ping
from .findjob import find_job
from .moe_alltoall import MoeAlltoAll

__all__ = [
    "A2ADError",
    "Attachment",
    "BackendError",
    "DaemonClient",
    "DaemonUnavailable",
    "Draining",
    "InputError",
    "InvalidField",
    "JobDestroyed",
    "LimitExceeded",
    "NoSuchJob",
    "PeerLeft",
    "PeerLost",
    "PeerTimeout",
    "PermissionDenied",
    "ProtocolError",
    "RankTaken",
    "RendezvousTimeout",
    "SpecMismatch",
    "StateError",
    "attach",
    "find_job",
    "ping",
]

__all__.append("MoeAlltoAll")

# FlashInfer's module-level API (flashinfer.comm.trtllm_moe_alltoall): the functional ops
# (also registered as torch.ops.a2ad.moe_a2a_*), the workspace helpers and the metainfo
# index names, so that switching is a change of import.
from a2ad.layout import (  # noqa: E402,F401
    BLOCK_COUNTERS_OFFSET_INDEX,
    COMBINE_COMPLETION_FLAGS_OFFSET_INDEX,
    DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX,
    FLAG_VAL_OFFSET_INDEX,
    LOCAL_TOKEN_COUNTER_OFFSET_INDEX,
    METAINFO_INDEX as _METAINFO_INDEX,
    NUM_METAINFO_FIELDS,
    PAYLOAD_DATA_OFFSET_INDEX,
    RECV_COUNTERS_OFFSET_INDEX,
    SEND_COUNTERS_OFFSET_INDEX,
    TOPK_SEND_INDICES_OFFSET_INDEX,
    TOPK_TARGET_RANKS_OFFSET_INDEX,
)

from .module import get_moe_alltoall_module  # noqa: E402,F401
from .moe_alltoall import moe_a2a_get_workspace_size_per_rank, moe_a2a_wrap_payload_tensor_in_workspace  # noqa: E402,F401
from .ops import (  # noqa: E402,F401
    MOE_A2A_RANK_MASK_WORDS,
    moe_a2a_active_rank_mask,
    moe_a2a_combine,
    moe_a2a_dispatch,
    moe_a2a_initialize,
    moe_a2a_release,
    moe_a2a_sanitize_expert_ids,
)

__all__ += [
    "MOE_A2A_RANK_MASK_WORDS",
    "get_moe_alltoall_module",
    "moe_a2a_active_rank_mask",
    "moe_a2a_initialize",
    "moe_a2a_release",
    "moe_a2a_combine",
    "moe_a2a_dispatch",
    "moe_a2a_get_workspace_size_per_rank",
    "moe_a2a_sanitize_expert_ids",
    "moe_a2a_wrap_payload_tensor_in_workspace",
    "NUM_METAINFO_FIELDS",
    *_METAINFO_INDEX,
]
