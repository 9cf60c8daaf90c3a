"""Host backend: memfd shared memory, one sealed memfd per rank row.

Rows are created with :func:`a2ad.daemon.memfd.sealed_memfd`, so no client can shrink
(or grow) a row the daemon later writes. The daemon never maps a row: it writes the flag
with ``pwrite`` and zeroes with a punched hole, so a fresh row commits one page and a
re-arm frees the pages of the aux region instead of writing them. (Rows must not be
pinned by clients, e.g. with cudaHostRegister: a punched hole gives the CPU new zero
pages that a pinned GPU view would not see. Clients register only the control block,
which is never punched.)
"""

from __future__ import annotations

import logging
import mmap
import os

from a2ad import errors
from a2ad.daemon import memfd
from a2ad.daemon.backends.base import Allocation, Backend

PAGE = mmap.PAGESIZE

log = logging.getLogger("a2ad")


class HostBackend(Backend):
    name = "host"
    #: Half of physical memory by default (see base.default_limits).
    default_share = 0.5

    def check_device(self, device: str) -> None:
        if device != "host":
            raise errors.InvalidField(
                f"this daemon runs the host backend; device must be 'host', got {device!r:.60}", field="device"
            )

    def row_stride(self, size_per_rank: int, device: str) -> int:
        return ((size_per_rank + PAGE - 1) // PAGE) * PAGE

    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        size = self.row_stride(size_per_rank, device)
        try:
            fd = memfd.sealed_memfd("a2ad-ws", size)
        except OSError as exc:
            raise errors.BackendError(f"memfd of {size} bytes failed: {exc}") from None
        return Allocation(fd=fd, size=size, device="host", handle_type="memfd")

    def initialize(
        self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int, fresh: bool = False
    ) -> None:
        if alloc.fd < 0:
            raise errors.BackendError("initialize() of a released host allocation")
        if not 0 <= aux_bytes <= alloc.size:
            raise errors.BackendError(f"aux region of {aux_bytes} bytes does not fit a row of {alloc.size}")
        if not 0 <= flag_offset <= alloc.size - 4 or flag_offset % 4:
            raise errors.BackendError(f"flag offset {flag_offset} is not an aligned int32 inside a row of {alloc.size}")
        flag = int(initial_round).to_bytes(4, "little", signed=True)
        try:
            if not fresh and aux_bytes:
                # a used row: drop the aux pages (they read as zeros again, in every mapping)
                memfd.zero_range(alloc.fd, 0, aux_bytes)
            # a fresh memfd already reads as zeros: only the flag is written (one page)
            if os.pwrite(alloc.fd, flag, flag_offset) != 4:
                raise OSError("short write of the flag")
        except OSError as exc:
            raise errors.BackendError(f"initializing a host row failed: {exc}") from None

    def adopt(self, fd: int, size: int, device: str, handle_type: str) -> Allocation:
        """Take over a row a previous daemon made. Seals it where it is not sealed yet (daemons
        before sealing made plain memfds); a row smaller than ``size`` is refused."""
        if not memfd.adopt_memfd(fd, size, "workspace memfd"):
            log.warning(
                "adopted workspace memfd (fd %d, %d bytes) cannot be sealed against resizing: "
                "a client could still shrink it under the daemon", fd, size,
            )
        return Allocation(fd=fd, size=size, device="host", handle_type="memfd")

    def release(self, alloc: Allocation) -> None:
        if alloc.fd >= 0:
            os.close(alloc.fd)
            alloc.fd = -1

    def memory_capacity(self) -> int:
        """Physical memory of the machine (SC_PHYS_PAGES * SC_PAGE_SIZE)."""
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 0

    def describe(self) -> dict:
        return {"backend": self.name, "handle_type": "memfd"}
