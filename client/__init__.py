"""a2ad client library: attach to a job through the daemon and move tokens with MoeAlltoAll."""

from a2ad.errors import (
    A2ADError,
    BackendError,
    DaemonUnavailable,
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

__all__ = [
    "A2ADError",
    "Attachment",
    "BackendError",
    "DaemonClient",
    "DaemonUnavailable",
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
    "ping",
]

try:  # the data plane (written alongside); absent only in a partial checkout
    from .moe_alltoall import MoeAlltoAll  # noqa: F401

    __all__.append("MoeAlltoAll")
except ImportError as _exc:  # pragma: no cover
    if "moe_alltoall" not in str(_exc):
        raise
