"""A request/reply connection to the daemon that cannot hang: DEALER socket, a request
id per call, linger 0, every wait polled with a timeout, typed errors.

Before its first request (and again whenever it opens a new socket: after a timeout, a
close or a fork) a client checks whom it is about to talk to, cheaply and once:

- the runtime folder must be one it trusts (:func:`a2ad.runtime.check_trusted`: owned by
  itself, root or the daemon's user, writable by no one else), else PermissionDenied;
- a plain non-blocking connect to ``fd.sock``, closed at once, must find a listener
  (else DaemonUnavailable saying the socket is stale: a ZeroMQ connect to a dead ipc
  endpoint would only time out) that runs as a trusted uid (SO_PEERCRED), else
  PermissionDenied.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import zmq

from a2ad import errors, protocol, runtime

DEFAULT_TIMEOUT = 10.0


class DaemonClient:
    """Talks to the daemon serving ``runtime_dir``. Not thread-safe; one per thread."""

    def __init__(self, runtime_dir: str | os.PathLike | None = None, timeout: float = DEFAULT_TIMEOUT,
                 trust_uids=()):
        """``trust_uids``: uids to trust as the daemon's besides the usual ones (e.g. a
        launcher that started the daemon as that uid itself)."""
        self.runtime_dir = runtime.resolve(runtime_dir)
        self.timeout = timeout
        self.trust_uids = tuple(trust_uids)
        #: (pid, uid, gid) of the process listening on fd.sock, from the latest check
        self.daemon_cred: tuple[int, int, int] | None = None
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._pid = os.getpid()

    @property
    def ctl_path(self) -> Path:
        return self.runtime_dir / runtime.CTL_SOCK

    @property
    def fd_path(self) -> Path:
        return self.runtime_dir / runtime.FD_SOCK

    def check_daemon(self) -> tuple[int, int, int]:
        """Is there a daemon we trust? Returns its (pid, uid, gid); raises DaemonUnavailable
        (no folder, no socket, a stale socket) or PermissionDenied (an untrusted folder or
        daemon)."""
        rd = self.runtime_dir
        try:
            runtime.check_trusted(rd, self.trust_uids)
        except FileNotFoundError:
            raise errors.DaemonUnavailable(
                f"no a2ad daemon at {rd} (the folder does not exist); start one with `a2ad serve`",
                runtime_dir=str(rd),
            ) from None
        if not self.ctl_path.exists():
            raise errors.DaemonUnavailable(
                f"no a2ad daemon at {rd} ({runtime.CTL_SOCK} is missing); start one with `a2ad serve`",
                runtime_dir=str(rd),
            )
        self.daemon_cred = runtime.probe_daemon(rd, self.trust_uids, busy_wait=min(1.0, self.timeout))
        return self.daemon_cred

    def _socket(self) -> zmq.Socket:
        if self._sock is None or self._pid != os.getpid():
            self._sock = None  # a socket inherited over fork belongs to the parent
            self.check_daemon()
            self._pid = os.getpid()
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY_FRAME)
            sock.connect(runtime.ctl_endpoint(self.runtime_dir))
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, rtype: str, *, wait: float | None = None, on_wait=None, wait_step: float = 1.0,
                **fields) -> dict:
        """Send one request and return the reply payload; raise the error class of an error reply.

        Raises DaemonUnavailable when no reply comes within ``wait`` seconds (default: the
        client's timeout). ``on_wait(elapsed)``, when given, is called in this thread about
        every ``wait_step`` seconds while no reply has come (it must return well before the
        wait ends: the wait is not extended for it)."""
        timeout = self.timeout if wait is None else wait
        sock = self._socket()
        rid = next(self._ids)
        try:
            sock.send(protocol.encode_request(rtype, rid, **fields), zmq.NOBLOCK)
        except zmq.Again:
            self._reset()
            raise errors.DaemonUnavailable(f"could not send {rtype!r} to the daemon at {self.runtime_dir}") from None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        start = time.monotonic()
        end = start + timeout
        next_call = start + wait_step
        while True:
            now = time.monotonic()
            remaining = end - now
            step = remaining if on_wait is None else min(remaining, next_call - now)
            # a last look without waiting once the time is up (a reply may have come while on_wait ran)
            if not poller.poll(max(1, int(step * 1000)) if remaining > 0 else 0):
                now = time.monotonic()
                if now >= end:
                    self._reset()  # a late reply must not be read as the answer to the next request
                    raise errors.DaemonUnavailable(
                        f"the daemon at {self.runtime_dir} did not answer {rtype!r} within {timeout:g} s"
                    )
                if on_wait is not None and now >= next_call:
                    on_wait(now - start)
                    next_call = time.monotonic() + wait_step
                continue
            reply = protocol.decode_reply(sock.recv())
            if reply.id not in (rid, -1):
                continue  # a stale reply to an earlier, timed-out request
            return reply.raise_for_error()

    def close(self) -> None:
        self._reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_local = threading.local()


def ping(runtime_dir=None, timeout: float = 2.0) -> dict:
    """The daemon's hello reply (version, backend, pid, uptime); raises DaemonUnavailable."""
    with DaemonClient(runtime_dir, timeout) as c:
        return c.request("hello")
