"""Map host-backend rows contiguously: row q at ``q * row_stride``.

A row is an fd (a memfd or a named shared-memory object the daemon passed over
``fd.sock``) or, for a row another daemon of the domain holds, its handle: the 32 bytes
that name a shared-memory object (``protocol.host_handle_path``), opened here by name."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import torch

from a2ad import errors, protocol

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_NORESERVE = 0x4000


def open_row(handle: bytes, row_stride: int) -> int:
    """Open the row a host handle names (read-write); refuses one smaller than a row."""
    try:
        path = protocol.host_handle_path(handle)
    except ValueError as exc:
        raise errors.ProtocolError(f"bad host row handle: {exc}") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise errors.BackendError(
            f"cannot open the workspace row {path} that another daemon of the domain holds: {exc.strerror or exc} "
            f"(every daemon and worker of the machine must use the same {protocol.SHM_DIR_ENV})") from None
    try:
        size = os.fstat(fd).st_size
        if size < row_stride:
            raise errors.BackendError(f"the workspace row {path} has {size} bytes, fewer than a row ({row_stride})")
    except BaseException:
        os.close(fd)
        raise
    return fd


class HostMapping:
    """``[ep_size, size_per_rank]`` uint8 CPU tensor over ep_size rows, stride(0) == row_stride.

    ``fds``: per rank, an fd (int; not closed here) or a host row handle (bytes)."""

    def __init__(self, fds: list, size_per_rank: int, row_stride: int):
        self.total = row_stride * len(fds)
        self.row_stride = row_stride
        base = _libc.mmap(None, self.total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"reserving {self.total} bytes of address space: {os.strerror(err)}")
        self.base = base
        try:
            for q, row in enumerate(fds):
                fd = open_row(bytes(row), row_stride) if isinstance(row, (bytes, bytearray)) else row
                try:
                    addr = _libc.mmap(
                        base + q * row_stride, row_stride, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                        fd, 0
                    )
                    err = ctypes.get_errno()
                finally:
                    if fd is not row:
                        os.close(fd)  # the mapping keeps the row; the name's fd is not needed
                if addr != base + q * row_stride:
                    raise OSError(err, f"mapping rank {q}'s workspace: {os.strerror(err)}")
        except BaseException:
            _libc.munmap(base, self.total)
            raise
        # what checkpoint_prepare / checkpoint_restore need to map the rows again at these addresses
        self._rows = [bytes(r) if isinstance(r, (bytes, bytearray)) else os.dup(r) for r in fds]
        self.suspended = False
        raw = (ctypes.c_uint8 * self.total).from_address(base)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        self.tensor = flat.as_strided((len(fds), size_per_rank), (row_stride, 1))

    def suspend(self) -> None:
        """Unmap every row, keeping the address range reserved (PROT_NONE): a touch faults
        until :meth:`resume`. Idempotent."""
        if self.suspended or self.base is None:
            return
        addr = _libc.mmap(self.base, self.total, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
        if addr != self.base:
            err = ctypes.get_errno()
            raise OSError(err, f"unmapping the workspace: {os.strerror(err)}")
        self.suspended = True

    def resume(self) -> None:
        """Map every row again at the addresses it had (MAP_FIXED). Idempotent."""
        if not self.suspended or self.base is None:
            return
        for q, row in enumerate(self._rows):
            fd = open_row(row, self.row_stride) if isinstance(row, bytes) else row
            try:
                addr = _libc.mmap(self.base + q * self.row_stride, self.row_stride, mmap.PROT_READ | mmap.PROT_WRITE,
                                  mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
                err = ctypes.get_errno()
            finally:
                if fd is not row:
                    os.close(fd)
            if addr != self.base + q * self.row_stride:
                raise OSError(err, f"mapping rank {q}'s workspace again: {os.strerror(err)}")
        self.suspended = False

    def close(self) -> None:
        if self.base is not None:
            self.tensor = None
            _libc.munmap(self.base, self.total)
            self.base = None
        for row in getattr(self, "_rows", ()):
            if isinstance(row, int):
                os.close(row)
        self._rows = []
