"""Where the daemon keeps its workspace fds so that a restarted daemon gets them back.

- SystemdStore: systemd's file-descriptor store (``FDSTORE=1`` + ``FDNAME=`` over
  ``$NOTIFY_SOCKET``; a restarted service receives them as ``LISTEN_FDS`` with
  ``LISTEN_FDNAMES``). Needs ``FileDescriptorStoreMax=`` in the unit.
- KeeperStore: a2ad.daemon.keeper, a small detached process holding the fds, for daemons not
  run by systemd. A daemon killed with -9 leaves it running; the next daemon on the same
  runtime folder reconnects to it.
- NullStore: nothing survives the daemon.

Names: ``ws:<job>:<rank>`` for a workspace row, ``cb:<job>`` for a control block.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from a2ad import errors, fdpass

log = logging.getLogger("a2ad")


class FdStore:
    kind = "none"

    def put(self, name: str, fd: int) -> None:
        pass

    def drop(self, name: str) -> None:
        pass

    def load(self) -> dict[str, int]:
        """Fds a previous daemon stored (the caller owns them)."""
        return {}

    def close(self, clean: bool) -> None:
        """``clean``: the daemon freed its jobs and nothing needs keeping."""


class NullStore(FdStore):
    pass


class SystemdStore(FdStore):
    kind = "systemd"

    def __init__(self):
        from a2ad.daemon import sdnotify

        self._sd = sdnotify

    def put(self, name: str, fd: int) -> None:
        if not self._sd.notify(f"FDSTORE=1\nFDNAME={name}", fds=[fd]):
            log.warning("systemd fd store refused %s", name)

    def drop(self, name: str) -> None:
        self._sd.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")

    def load(self) -> dict[str, int]:
        if os.environ.get("LISTEN_PID") != str(os.getpid()):
            return {}
        n = int(os.environ.get("LISTEN_FDS", "0") or 0)
        names = os.environ.get("LISTEN_FDNAMES", "").split(":")
        out = {}
        for i in range(n):
            fd = 3 + i
            os.set_inheritable(fd, False)
            name = names[i] if i < len(names) else f"unnamed:{i}"
            if name.startswith(("ws:", "cb:")):
                out[name] = fd
            else:
                os.close(fd)
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
        return out


class KeeperStore(FdStore):
    kind = "keeper"

    def __init__(self, runtime_dir: Path):
        from a2ad.daemon.keeper import KEEPER_SOCK

        self.path = runtime_dir / KEEPER_SOCK
        self.sock: socket.socket | None = None
        self._connect_or_start()

    def _connect(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect(str(self.path))
        except OSError:
            s.close()
            return False
        self.sock = s
        return True

    def _connect_or_start(self) -> None:
        if self.path.exists() and self._connect():
            log.info("fd keeper found at %s", self.path)
            return
        proc = subprocess.Popen(
            [sys.executable, "-m", "a2ad.daemon.keeper", "--socket", str(self.path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        line = proc.stdout.readline()
        proc.stdout.close()
        if line.strip() != b"READY" or not self._connect():
            raise errors.BackendError(f"the fd keeper did not start at {self.path}")
        log.info("fd keeper started (pid %d)", proc.pid)

    def _call(self, req: dict, fds: list[int] | None = None):
        if self.sock is None:
            raise errors.BackendError("the fd keeper is not connected")
        fdpass.send_frame(self.sock, req, fds)
        return fdpass.recv_frame(self.sock, timeout=10.0)

    def put(self, name: str, fd: int) -> None:
        try:
            self._call({"op": "put", "name": name}, [fd])
        except (OSError, TimeoutError, errors.A2ADError) as exc:
            log.warning("fd keeper: could not store %s: %s", name, exc)

    def drop(self, name: str) -> None:
        try:
            self._call({"op": "drop", "name": name})
        except (OSError, TimeoutError, errors.A2ADError) as exc:
            log.warning("fd keeper: could not drop %s: %s", name, exc)

    def load(self) -> dict[str, int]:
        reply, fds = self._call({"op": "get"})
        names = reply.get("names", [])
        if len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            raise errors.BackendError("the fd keeper returned a mismatched fd list")
        return dict(zip(names, fds))

    def close(self, clean: bool) -> None:
        if self.sock is None:
            return
        if clean:
            try:
                self._call({"op": "exit"})
            except (OSError, TimeoutError, errors.A2ADError):
                pass
        self.sock.close()
        self.sock = None


def make_store(kind: str, runtime_dir: Path) -> FdStore:
    """``auto``: systemd's store when run under systemd (NOTIFY_SOCKET set), else the keeper."""
    if kind == "auto":
        kind = "systemd" if os.environ.get("NOTIFY_SOCKET") else "keeper"
    if kind == "systemd":
        return SystemdStore()
    if kind == "keeper":
        return KeeperStore(runtime_dir)
    if kind == "none":
        return NullStore()
    raise errors.InvalidField(f"unknown fd store {kind!r}; choose auto, systemd, keeper or none", field="fd_store")


def ws_name(job: str, rank: int) -> str:
    return f"ws:{job}:{rank}"


def cb_name(job: str) -> str:
    return f"cb:{job}"
