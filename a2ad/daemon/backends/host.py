"""Host backend: memfd shared memory, one memfd per rank row."""

from __future__ import annotations

import mmap
import os

from a2ad import errors
from a2ad.daemon.backends.base import Allocation, Backend

PAGE = mmap.PAGESIZE


class HostBackend(Backend):
    name = "host"

    def check_device(self, device: str) -> None:
        if device != "host":
            raise errors.InvalidField(
                f"this daemon runs the host backend; device must be 'host', got {device!r:.60}", field="device"
            )

    def row_stride(self, size_per_rank: int, device: str) -> int:
        return ((size_per_rank + PAGE - 1) // PAGE) * PAGE

    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        size = self.row_stride(size_per_rank, device)
        fd = os.memfd_create("a2ad-ws", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            raise errors.BackendError(f"memfd of {size} bytes failed: {exc}") from None
        return Allocation(fd=fd, size=size, device="host", handle_type="memfd")

    def initialize(self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int) -> None:
        # A fresh memfd reads as zeros; write explicitly anyway (re-arm reuses rows).
        with mmap.mmap(alloc.fd, alloc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            mm[:aux_bytes] = bytes(aux_bytes)
            mm[flag_offset : flag_offset + 4] = int(initial_round).to_bytes(4, "little", signed=True)

    def adopt(self, fd: int, size: int, device: str, handle_type: str) -> Allocation:
        if os.fstat(fd).st_size < size:
            raise errors.BackendError(f"adopted memfd is {os.fstat(fd).st_size} bytes, expected {size}")
        return Allocation(fd=fd, size=size, device="host", handle_type="memfd")

    def release(self, alloc: Allocation) -> None:
        if alloc.fd >= 0:
            os.close(alloc.fd)
            alloc.fd = -1

    def describe(self) -> dict:
        return {"backend": self.name, "handle_type": "memfd"}
