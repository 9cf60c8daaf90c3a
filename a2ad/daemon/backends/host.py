"""Host backend: memfd shared memory, one sealed memfd per rank row.

In a domain (``enable_fabric``) a row is instead a shared-memory object with a random
256-bit name in the shared-memory folder (``protocol.host_handle_path``; mode 0600, owned by
the daemon's user): its 32 name bytes are the row's fabric-like handle, which a process of
another daemon on the same machine opens by name, so several daemons on one machine run a
real multi-node job. Such a row cannot be sealed (only memfds can); the daemon removes its
name when the job is freed. Where the folder is not usable, the row falls back to a memfd
and records why (``Allocation.fabric_error``), as the cuda backend does without an IMEX
channel: a job that spans nodes is then refused with that reason.

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
import secrets

from a2ad import errors, protocol
from a2ad.daemon import memfd
from a2ad.daemon.backends.base import Allocation, Backend, check_tail, init_words

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

    def __init__(self, fabric: bool = False):
        self.fabric = fabric

    def enable_fabric(self) -> None:
        self.fabric = True

    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        size = self.row_stride(size_per_rank, device)
        why = None
        if self.fabric:
            try:
                return self._named(size)
            except OSError as exc:
                why = (f"the host row could not get a shared-memory name in {protocol.shm_dir()} "
                       f"({exc.strerror or exc}; set {protocol.SHM_DIR_ENV} to a folder every daemon and worker "
                       "of the machine can use)")
                log.warning("%s; a memfd it is, usable on this node only", why)
        try:
            fd = memfd.sealed_memfd("a2ad-ws", size)
        except OSError as exc:
            raise errors.BackendError(f"memfd of {size} bytes failed: {exc}") from None
        return Allocation(fd=fd, size=size, device="host", handle_type="memfd",
                          extra={"fabric_error": why} if why else {})

    def _named(self, size: int) -> Allocation:
        handle = secrets.token_bytes(protocol.HOST_HANDLE_BYTES)
        path = protocol.host_handle_path(handle)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)  # sparse: nothing is committed until written, as with a memfd
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return Allocation(fd=fd, size=size, device="host", handle_type="shm", extra={"fabric_handle": handle})

    def initialize(
        self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int, fresh: bool = False,
        words: dict[int, int] | None = None, tail: int = 0,
    ) -> None:
        if alloc.fd < 0:
            raise errors.BackendError("initialize() of a released host allocation")
        if not 0 <= aux_bytes <= alloc.size:
            raise errors.BackendError(f"aux region of {aux_bytes} bytes does not fit a row of {alloc.size}")
        check_tail(tail, aux_bytes, alloc.size)
        writes = init_words(flag_offset, initial_round, words, aux_bytes, alloc.size)
        try:
            if not fresh and aux_bytes:
                # a used row: drop the aux pages (they read as zeros again, in every mapping)
                memfd.zero_range(alloc.fd, 0, aux_bytes)
            if not fresh and tail:
                memfd.zero_range(alloc.fd, alloc.size - tail, tail)
            # a fresh memfd already reads as zeros: only the flag (and words) are written
            for off, data in writes:
                if os.pwrite(alloc.fd, data, off) != 4:
                    raise OSError(f"short write at offset {off}")
        except OSError as exc:
            raise errors.BackendError(f"initializing a host row failed: {exc}") from None

    def adopt(self, fd: int, size: int, device: str, handle_type: str, fabric: bytes | None = None) -> Allocation:
        """Take over a row a previous daemon made. Seals it where it is not sealed yet (daemons
        before sealing made plain memfds); a row smaller than ``size`` is refused. A named row
        keeps its name if the name still leads to this very row."""
        if handle_type == "shm":
            st = os.fstat(fd)
            if st.st_size < size:
                raise errors.BackendError(f"the kept row has {st.st_size} bytes, fewer than its {size}")
            extra: dict = {}
            try:
                named = os.stat(protocol.host_handle_path(fabric), follow_symlinks=False) if fabric else None
            except (OSError, ValueError):
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
                extra["fabric_handle"] = bytes(fabric)
            else:
                extra["fabric_error"] = "the row's shared-memory name is gone (removed while no daemon ran)"
            return Allocation(fd=fd, size=size, device="host", handle_type="shm", extra=extra)
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
        handle = alloc.extra.pop("fabric_handle", None)
        if handle is not None:
            _unlink(protocol.host_handle_path(handle))

    def memory_capacity(self) -> int:
        """Physical memory of the machine (SC_PHYS_PAGES * SC_PAGE_SIZE)."""
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 0

    def describe(self) -> dict:
        out = {"backend": self.name, "handle_type": "shm" if self.fabric else "memfd"}
        if self.fabric:
            out["shm_dir"] = protocol.shm_dir()
        return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove the shared-memory name %s: %s", path, exc)
