"""The daemon's side of the core's ``Host`` port (core/ports.py): pidfds, closing fds, the
process table and control blocks in sealed memfds."""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket

from a2ad import layout as L
from a2ad.control import ControlBlock, hold_job
from a2ad.daemon import memfd

log = logging.getLogger("a2ad")

#: pidfd_open's flag for a handle on one thread (Linux 6.9; the value of O_EXCL)
PIDFD_THREAD = getattr(os, "PIDFD_THREAD", os.O_EXCL)


class RealHost:
    #: the control block's memfd, and the descriptor Python's mmap keeps of it (it dup()s
    #: the fd it maps, so that the mapping can be resized)
    control_block_fds = 2

    def __init__(self) -> None:
        self.hostname = socket.gethostname().split(".")[0]

    @staticmethod
    def open_pidfd(pid: int) -> int | None:
        try:
            return os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except (OSError, TypeError):
            return None

    @staticmethod
    def open_thread_pidfd(pid: int, tid: int) -> int | None:
        if tid == pid:
            return None  # the leader's pidfd reports the whole process, not the thread
        try:
            fd = os.pidfd_open(tid, PIDFD_THREAD)
        except (OSError, TypeError):
            return None
        # checked after the open: the thread the handle names has not ended (it may not be
        # the one named tid now) and tid is one of pid's threads, so the handle watches a
        # thread of pid
        ended = select.poll()  # (poll: a daemon's fds are numbered past select()'s 1024)
        ended.register(fd, select.POLLIN)
        if ended.poll(0) or not os.path.exists(f"/proc/{pid}/task/{tid}"):
            os.close(fd)
            return None
        return fd

    @staticmethod
    def token(n: int) -> bytes:
        return secrets.token_bytes(n)

    @staticmethod
    def close_fd(fd: int) -> None:
        os.close(fd)

    @staticmethod
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie (exited, not yet reaped) maps nothing
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    @staticmethod
    def new_control_block(ep_size: int, policy: int) -> tuple[int, ControlBlock]:
        """A sealed memfd (clients cannot shrink it under the daemon's mapping) holding a fresh
        control block."""
        fd = memfd.sealed_memfd("a2ad-ctl", L.CONTROL_BLOCK_SIZE)
        try:
            hold_job(fd)  # the holder lock: ranks learn when no daemon or fd store holds the job
            cb = ControlBlock.map_fd(fd)
        except BaseException:
            os.close(fd)
            raise
        cb.initialize(ep_size, policy)
        return fd, cb

    @staticmethod
    def adopt_control_block(fd: int, job: str) -> ControlBlock:
        from a2ad.daemon.persist import check_control_version

        check_control_version(fd, job)
        if not memfd.adopt_memfd(fd, L.CONTROL_BLOCK_SIZE, "control block"):
            log.warning("job %s: its control block cannot be sealed (from an older daemon)", job)
        hold_job(fd)  # held already when the store kept the daemon's description; taken if not
        return ControlBlock.map_fd(fd)
