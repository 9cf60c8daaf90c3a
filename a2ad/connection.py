"""A request/reply connection to the daemon that cannot hang: DEALER socket, a request
id per call, linger 0, every wait polled with a timeout, typed errors."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import zmq

from a2ad import errors, protocol, runtime

DEFAULT_TIMEOUT = 10.0


class DaemonClient:
    """Talks to the daemon serving ``runtime_dir``. Not thread-safe; one per thread."""

    def __init__(self, runtime_dir: str | os.PathLike | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.runtime_dir = runtime.resolve(runtime_dir)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._pid = os.getpid()

    @property
    def ctl_path(self) -> Path:
        return self.runtime_dir / runtime.CTL_SOCK

    @property
    def fd_path(self) -> Path:
        return self.runtime_dir / runtime.FD_SOCK

    def _socket(self) -> zmq.Socket:
        if self._sock is None or self._pid != os.getpid():
            if not self.ctl_path.exists():
                raise errors.DaemonUnavailable(
                    f"no a2ad daemon at {self.runtime_dir} ({runtime.CTL_SOCK} is missing); start one with `a2ad serve`"
                )
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

    def request(self, rtype: str, *, wait: float | None = None, **fields) -> dict:
        """Send one request and return the reply payload; raise the error class of an error reply.

        Raises DaemonUnavailable when no reply comes within ``wait`` seconds (default: the
        client's timeout)."""
        timeout = self.timeout if wait is None else wait
        sock = self._socket()
        rid = next(self._ids)
        try:
            sock.send(protocol.encode_request(rtype, rid, **fields), zmq.NOBLOCK)
        except zmq.Again:
            self._reset()
            raise errors.DaemonUnavailable(f"could not send {rtype!r} to the daemon at {self.runtime_dir}") from None
        deadline_ms = int(timeout * 1000)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        import time

        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 or not poller.poll(max(1, min(deadline_ms, int(remaining * 1000)))):
                if time.monotonic() >= end:
                    self._reset()  # a late reply must not be read as the answer to the next request
                    raise errors.DaemonUnavailable(
                        f"the daemon at {self.runtime_dir} did not answer {rtype!r} within {timeout:g} s"
                    )
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
