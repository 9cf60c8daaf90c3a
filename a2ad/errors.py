"""Error codes and the exception classes behind them.

Every daemon reply carries one code from :data:`CODES`. The daemon raises the
class for a code to answer with it; the client turns an error reply back into
the same class with :func:`from_reply`. Data-plane errors (which never travel
over the wire) live here too so that callers catch one base class.
"""

from __future__ import annotations

from typing import Any


class A2ADError(Exception):
    """Base class of every error a2ad raises."""

    code = "internal"

    def __init__(self, message: str = "", **details: Any):
        super().__init__(message)
        self.message = message
        self.details = details


# --- control plane (daemon replies) -----------------------------------------
class BadMessage(A2ADError):
    """The request could not be decoded, or is not a map with the envelope fields."""

    code = "bad_message"


class UnsupportedVersion(A2ADError):
    code = "unsupported_version"


class UnknownType(A2ADError):
    code = "unknown_type"


class InvalidField(A2ADError, ValueError):
    """A field is missing, of the wrong type, or out of range."""

    code = "invalid_field"


class SpecMismatch(A2ADError):
    """A join's spec differs from the job's; ``details``: field, job_value, requested, and who
    asked for the other value (rank, node; node only for a join refused by a domain)."""

    code = "spec_mismatch"


class RankTaken(A2ADError):
    code = "rank_taken"


class RendezvousTimeout(A2ADError, TimeoutError):
    """Not every rank joined in time; ``details['missing_ranks']`` lists who is missing."""

    code = "rendezvous_timeout"

    @property
    def missing_ranks(self) -> list[int]:
        return list(self.details.get("missing_ranks", []))


class NoSuchJob(A2ADError, KeyError):
    code = "no_such_job"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class LimitExceeded(A2ADError):
    """A memory limit (per job or per daemon) would be exceeded."""

    code = "limit_exceeded"


class PermissionDenied(A2ADError, PermissionError):
    code = "permission_denied"


class BadTicket(A2ADError):
    """An unknown, expired, reused, or foreign ticket on the fd socket."""

    code = "bad_ticket"


class BackendError(A2ADError):
    """The memory backend failed (allocation, export, unsupported device)."""

    code = "backend_error"


class Draining(A2ADError):
    """The daemon is draining (``a2ad-ctl drain``): it refuses new jobs; existing ones run on."""

    code = "draining"


class JobDestroyed(A2ADError):
    """The job was destroyed (``a2ad-ctl destroy``) or freed: its memory is gone for good.

    Nothing can resume it, recover() included: close the object and attach again, which
    creates a new job under the name."""

    code = "job_destroyed"


class InternalError(A2ADError):
    code = "internal"


# --- client side only -------------------------------------------------------
class DaemonUnavailable(A2ADError, ConnectionError):
    """The daemon did not answer in time, or its sockets are missing."""

    code = "daemon_unavailable"


class ProtocolError(A2ADError):
    """The daemon's reply could not be understood."""

    code = "protocol_error"


# --- data plane --------------------------------------------------------------
class PeerTimeout(A2ADError, TimeoutError):
    """A data-plane wait on a peer rank ran out; ``peer``, ``phase``, ``round``."""

    code = "peer_timeout"

    def __init__(self, message: str = "", *, peer: int, phase: str, round: int = -1, **details: Any):
        super().__init__(message, peer=peer, phase=phase, round=round, **details)
        self.peer = peer
        self.phase = phase
        self.round = round


class PeerLost(A2ADError):
    """A peer of the job died (or the job was aborted); ``rank`` and ``generation``.

    ``details['reason_name']`` says why in words ("peer lost", "aborted by operator", "re-arm
    requested", "peer left", "wait aborted", "not an active rank", "left behind"); where the
    job's abort word caused it, ``details['reason']`` is that word's number
    (``a2ad.layout.ABORT_*``)."""

    code = "peer_lost"

    def __init__(self, message: str = "", *, rank: int, generation: int, **details: Any):
        super().__init__(message, rank=rank, generation=generation, **details)
        self.rank = rank
        self.generation = generation


class PeerLeft(PeerLost):
    """A peer left the job cleanly (closed its attachment) while the job ran; ``rank``.

    A subclass of PeerLost: the job must be re-armed the same way (every rank calls
    recover() once a replacement joined as ``rank``). Like PeerLost it never travels in a
    daemon reply, so it is not in :data:`CODES`."""

    code = "peer_left"


class StateError(A2ADError, RuntimeError):
    """A call out of order (combine before dispatch, dispatch twice, use after close)."""

    code = "state_error"


class InputError(A2ADError, ValueError):
    """Bad input to dispatch/combine. Checks of shapes, dtypes and devices raise before
    anything is written to a peer; what only the GPU can see without a host sync (an expert
    id out of range, ranks passing different runtime_max_tokens_per_rank) is found by the
    kernels, which still complete the round for every rank, and raised by a later call."""

    code = "input_error"


class BuildError(A2ADError):
    """The CUDA extension failed to build."""

    code = "build_error"


_ALL = [
    BadMessage,
    UnsupportedVersion,
    UnknownType,
    InvalidField,
    SpecMismatch,
    RankTaken,
    RendezvousTimeout,
    NoSuchJob,
    LimitExceeded,
    PermissionDenied,
    BadTicket,
    BackendError,
    Draining,
    JobDestroyed,
    InternalError,
    DaemonUnavailable,
    ProtocolError,
]

#: code -> exception class, for every code a reply may carry.
CODES: dict[str, type[A2ADError]] = {cls.code: cls for cls in _ALL}


def from_reply(code: str, message: str, details: dict | None = None) -> A2ADError:
    cls = CODES.get(code, InternalError)
    err = cls(message, **(details or {}))
    if cls is InternalError and code != "internal":
        err.details["code"] = code
    return err
