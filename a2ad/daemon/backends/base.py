"""The memory-backend seam: the daemon's only view of where workspace memory lives."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field


@dataclass
class Allocation:
    """One rank's workspace row, owned by the daemon.

    ``fd`` is the exportable file descriptor that clients receive (a memfd on
    the host backend, a CUDA POSIX-fd handle on the cuda backend); the daemon
    keeps it open until the job is freed. ``size`` is the allocated size (the
    row stride clients map with), ``>=`` the job's size_per_rank.
    """

    fd: int
    size: int
    device: str
    handle_type: str
    extra: dict = field(default_factory=dict)


class Backend(abc.ABC):
    name: str = "?"

    @abc.abstractmethod
    def check_device(self, device: str) -> None:
        """Raise InvalidField/BackendError when a client's declared device is unusable here."""

    @abc.abstractmethod
    def row_stride(self, size_per_rank: int, device: str) -> int:
        """Allocation size for a row (size rounded up to the backend's granularity)."""

    @abc.abstractmethod
    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        """Allocate one row of ``row_stride(size_per_rank, device)`` bytes on ``device``."""

    @abc.abstractmethod
    def initialize(self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int) -> None:
        """Zero ``[0, aux_bytes)`` of the row and write ``initial_round`` (int32) at ``flag_offset``."""

    @abc.abstractmethod
    def adopt(self, fd: int, size: int, device: str, handle_type: str) -> Allocation:
        """Take over a row a previous daemon allocated, from its exported fd (restart)."""

    @abc.abstractmethod
    def release(self, alloc: Allocation) -> None:
        """Drop the daemon's reference (close the fd / release the handle)."""

    @contextlib.contextmanager
    def batch(self):
        """Group several initialize() calls (a job-wide re-arm), so that a backend can keep
        per-device setup (a CUDA context) across them instead of paying it per row."""
        yield

    def describe(self) -> dict:
        """Backend facts for status (handle type, per-device overhead, ...)."""
        return {"backend": self.name}

    def close(self) -> None:
        """Release backend-wide resources at daemon shutdown."""
