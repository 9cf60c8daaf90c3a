"""Map host-backend rows (memfds) contiguously: row q at ``q * row_stride``."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import torch

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_NORESERVE = 0x4000


class HostMapping:
    """``[ep_size, size_per_rank]`` uint8 CPU tensor over ep_size memfds, stride(0) == row_stride."""

    def __init__(self, fds: list[int], size_per_rank: int, row_stride: int):
        self.total = row_stride * len(fds)
        self.row_stride = row_stride
        base = _libc.mmap(None, self.total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"reserving {self.total} bytes of address space: {os.strerror(err)}")
        self.base = base
        try:
            for q, fd in enumerate(fds):
                addr = _libc.mmap(
                    base + q * row_stride, row_stride, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0
                )
                if addr != base + q * row_stride:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mapping rank {q}'s workspace: {os.strerror(err)}")
        except BaseException:
            _libc.munmap(base, self.total)
            raise
        raw = (ctypes.c_uint8 * self.total).from_address(base)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        self.tensor = flat.as_strided((len(fds), size_per_rank), (row_stride, 1))

    def close(self) -> None:
        if self.base is not None:
            self.tensor = None
            _libc.munmap(self.base, self.total)
            self.base = None
