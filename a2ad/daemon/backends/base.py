"""The memory-backend seam: the daemon's only view of where workspace memory lives."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field

from a2ad import errors


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

    @property
    def fabric_handle(self) -> bytes | None:
        """The bytes a process on another node of the domain imports the row with (a CUDA
        fabric handle, or a host shared-memory name), or None when the row has none."""
        return self.extra.get("fabric_handle")

    @property
    def fabric_error(self) -> str | None:
        """Why the row has no fabric handle (None when it has one, or none was asked for)."""
        return self.extra.get("fabric_error")


class Backend(abc.ABC):
    name: str = "?"
    #: Whether a job's rows get a lines tail (layout.ROW_TAIL_BYTES at the top of each row's
    #: allocation, zeroed with the aux region): where the CUDA kernels' small combine stages
    #: its rows as lines. Rows no CUDA kernel uses need none.
    lines_tail: bool = False

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
    def initialize(
        self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int, fresh: bool = False,
        words: dict[int, int] | None = None, tail: int = 0,
    ) -> None:
        """Make ``[0, aux_bytes)`` of the row and its last ``tail`` bytes (its lines tail) read as
        zeros, then write ``initial_round`` (int32) at ``flag_offset`` and each value of
        ``words`` (int32) at its offset (aligned, inside the aux region).

        ``fresh=True`` promises that the row comes straight from :meth:`allocate` and was never
        handed to a client: a backend whose new memory already reads as zeros (host memfds) may
        then skip the zeroing and commit nothing but the flag's page. ``fresh=False`` (a re-arm
        of a used row, or unknown) is always correct; it is also cheap on the host backend.
        """

    @abc.abstractmethod
    def adopt(self, fd: int, size: int, device: str, handle_type: str, fabric: bytes | None = None) -> Allocation:
        """Take over a row a previous daemon allocated, from its exported fd (restart);
        ``fabric``: the row's fabric handle as that daemon recorded it, if it had one."""

    def enable_fabric(self) -> None:
        """Rows allocated from now on also get a handle that other nodes of a domain can
        import (``Allocation.fabric_handle``), where the backend can make one."""

    @abc.abstractmethod
    def release(self, alloc: Allocation) -> None:
        """Drop the daemon's reference (close the fd / release the handle)."""

    @contextlib.contextmanager
    def batch(self):
        """Group several initialize() calls (a job-wide re-arm), so that a backend can keep
        per-device setup (a CUDA context) across them instead of paying it per row."""
        yield

    def memory_capacity(self) -> int:
        """Bytes of the memory this backend allocates from, on this machine (host: physical
        memory; cuda: total memory of the visible GPUs). The base for :func:`default_limits`."""
        raise NotImplementedError

    #: Share of :meth:`memory_capacity` the daemon may hand out by default (see default_limits).
    default_share: float = 0.5

    def describe(self) -> dict:
        """Backend facts for status (handle type, per-device overhead, ...)."""
        return {"backend": self.name}

    def close(self) -> None:
        """Release backend-wide resources at daemon shutdown."""


def default_limits(backend: Backend) -> tuple[int, int]:
    """``(max_job_bytes, max_total_bytes)`` derived from the machine, for when the operator
    sets no limit.

    The daemon-wide limit is ``backend.default_share`` of :meth:`Backend.memory_capacity`,
    rounded down to MiB: half of physical memory on the host backend (workspaces are shared
    memory, which competes with every process on the node and cannot be swapped out unless swap
    exists), 90% of the visible GPUs' total memory on the cuda backend (what is left covers
    the CUDA contexts of the clients and the daemon and the models' own allocations live in
    the same HBM, so an operator running large models should set lower limits). One job may
    use all of it: the per-job limit equals the total. A backend that cannot tell its capacity
    (0 or an error) gets the previous fixed defaults (1 TiB per job, 4 TiB in all).
    """
    try:
        capacity = int(backend.memory_capacity())
    except Exception:
        capacity = 0
    if capacity <= 0:
        return 1 << 40, 1 << 42
    total = int(capacity * backend.default_share) // (1 << 20) * (1 << 20)
    if total <= 0:
        total = capacity
    return total, total


def check_tail(tail: int, aux_bytes: int, size: int) -> None:
    """BackendError unless the last ``tail`` bytes of a row of ``size`` lie past its aux region."""
    if not 0 <= tail <= size - aux_bytes:
        raise errors.BackendError(f"a tail of {tail} bytes does not fit a row of {size} past its aux region "
                                  f"of {aux_bytes}")


def init_words(flag_offset: int, initial_round: int, words: dict[int, int] | None, aux_bytes: int,
               size: int) -> list[tuple[int, bytes]]:
    """The (offset, 4 bytes) writes of an ``initialize``: the flag, then ``words``; each offset
    checked (BackendError: an int32 that is not aligned or not inside the row / aux region)."""
    if not 0 <= flag_offset <= size - 4 or flag_offset % 4:
        raise errors.BackendError(f"flag offset {flag_offset} is not an aligned int32 inside a row of {size}")
    out = [(flag_offset, int(initial_round).to_bytes(4, "little", signed=True))]
    for off, value in sorted((words or {}).items()):
        if not 0 <= off <= aux_bytes - 4 or off % 4:
            raise errors.BackendError(f"word offset {off} is not an aligned int32 inside an aux region of {aux_bytes}")
        out.append((off, int(value).to_bytes(4, "little", signed=True)))
    return out
