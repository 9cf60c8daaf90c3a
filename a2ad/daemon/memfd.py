"""Shared-memory files the daemon hands to clients: sealed memfds and cheap zeroing.

The daemon maps the memfds it creates (workspace rows on the host backend, every
job's control block) and passes the same fds to client processes. A client that
shrinks such a file would make the daemon's next access to the lost pages die
of SIGBUS; a client that grows it would make the file unbounded. Every memfd the
daemon creates is therefore sealed against resizing (``F_SEAL_SHRINK``,
``F_SEAL_GROW``) and then against further sealing (``F_SEAL_SEAL``, so no
client can add ``F_SEAL_WRITE`` and freeze the daemon's writes). Writes and
shared mappings stay allowed: clients need them.

Zeroing uses ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``: the
pages of the range are dropped (from every process's mapping too) and read back
as zeros, without the daemon writing or committing anything. Where a file
system cannot punch holes, the range is zeroed in bounded chunks, skipping
chunks that already read as zeros (reading a memfd hole commits nothing).

Constants are the kernel's (include/uapi/linux/fcntl.h, falloc.h, memfd.h); they
are the same on x86-64 and aarch64.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os

from a2ad import errors

# include/uapi/linux/memfd.h
MFD_CLOEXEC = getattr(os, "MFD_CLOEXEC", 0x0001)
MFD_ALLOW_SEALING = getattr(os, "MFD_ALLOW_SEALING", 0x0002)
# include/uapi/linux/fcntl.h: F_LINUX_SPECIFIC_BASE (1024) + 9 / + 10
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1024 + 9)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1024 + 10)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
# include/uapi/linux/falloc.h
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

#: The seals every daemon-made memfd carries: no resizing, no further seals.
SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
#: What makes an fd safe for the daemon to map: nobody can resize it.
_SAFE = F_SEAL_SHRINK | F_SEAL_GROW
#: Seals that would make the daemon's own writes fail.
_WRITE_SEALS = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE

#: Largest write of the zeroing fallback (bounds the daemon's temporary memory).
ZERO_CHUNK = 1 << 20

_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV)


def sealed_memfd(name: str, size: int) -> int:
    """A new close-on-exec memfd of ``size`` bytes (reading as zeros), sealed against shrinking,
    growing and further sealing. Writable and mappable MAP_SHARED by every holder.

    Raises OSError (ENOMEM, EMFILE, ...) with the fd closed; the caller owns the fd returned.
    """
    size = int(size)
    if size < 0:
        raise ValueError(f"memfd size must be >= 0, got {size}")
    fd = os.memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seals(fd: int) -> int | None:
    """The fd's current seals (F_SEAL_* bits), or None when the file does not support sealing."""
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def ensure_sealed(fd: int, size: int) -> bool:
    """Seal an fd adopted from an older daemon (which may have made unsealed memfds).

    Adds ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` where the file still allows it, then
    checks with fstat that it is at least ``size`` bytes. Returns True when the fd can now be
    neither shrunk nor grown, is large enough and carries no write seal, i.e. the daemon may map
    and write ``size`` bytes of it without risking SIGBUS or EPERM; False otherwise (a memfd made
    without MFD_ALLOW_SEALING, sealed with F_SEAL_SEAL before the resize seals, write-sealed by a
    client, not a memfd, or too small): the caller decides
    (refuse it when too small, else log a warning and carry on). The size is read after
    sealing, so a client that shrinks the file concurrently is caught either way.
    """
    current = seals(fd)
    if current is not None and current & SEALS != SEALS and not current & F_SEAL_SEAL:
        try:
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
        except OSError:
            pass  # e.g. EPERM: sealing is not allowed on this file
        current = seals(fd)
    sealed = current is not None and current & _SAFE == _SAFE and not current & _WRITE_SEALS
    return sealed and os.fstat(fd).st_size >= size


def adopt_memfd(fd: int, size: int, what: str = "memfd") -> bool:
    """ensure_sealed() for a daemon taking over a previous daemon's fd: raises BackendError when
    the file is smaller than ``size`` (mapping it would fault), else returns whether it is sealed
    (False: usable, but a client could still resize it; log a warning)."""
    safe = ensure_sealed(fd, size)
    actual = os.fstat(fd).st_size
    if actual < size:
        raise errors.BackendError(f"adopted {what} is {actual} bytes, expected {size}")
    return safe


_fallocate = None


def _libc_fallocate():
    global _fallocate
    if _fallocate is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate  # off_t is 64-bit on x86-64 and aarch64 (LP64)
        fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        fn.restype = ctypes.c_int
        _fallocate = fn
    return _fallocate


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) over the range; raises OSError (EOPNOTSUPP where the
    file system cannot punch holes)."""
    try:
        fn = _libc_fallocate()
    except (OSError, AttributeError):
        raise OSError(errno.ENOSYS, "libc has no fallocate") from None
    while True:
        if fn(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
            return
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def zero_range(fd: int, offset: int, length: int) -> None:
    """Make ``[offset, offset + length)`` of the file read as zeros, without writing page by page.

    Punches a hole (freeing the range's pages; partial pages at the edges are zeroed by the
    kernel; the file's size is unchanged). Where that is unsupported, writes zeros in chunks of
    at most ZERO_CHUNK bytes, only over chunks that are not already zero, and never past the end
    of the file. Every process's shared mapping of the range reads zeros afterwards.
    """
    offset, length = int(offset), int(length)
    if offset < 0 or length < 0:
        raise ValueError(f"bad range: offset {offset}, length {length}")
    if length == 0:
        return
    try:
        punch_hole(fd, offset, length)
        return
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    _zero_by_writing(fd, offset, length)


def _zero_by_writing(fd: int, offset: int, length: int) -> None:
    end = min(offset + length, os.fstat(fd).st_size)
    zeros = bytes(min(ZERO_CHUNK, max(0, end - offset)))
    pos = offset
    while pos < end:
        n = min(ZERO_CHUNK, end - pos)
        current = os.pread(fd, n, pos)
        if current.count(0) != len(current):
            view = memoryview(zeros)[:n]
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], pos + done)
        if not current:
            break  # the file ended under us
        pos += n
