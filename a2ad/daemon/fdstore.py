"""Where the daemon keeps its workspace fds so that a restarted daemon gets them back.

- SystemdStore: systemd's file-descriptor store (``FDSTORE=1`` + ``FDNAME=`` over
  ``$NOTIFY_SOCKET``; a restarted service receives them as ``LISTEN_FDS`` with
  ``LISTEN_FDNAMES``). Needs ``FileDescriptorStoreMax=`` in the unit.
- KeeperStore: a2ad.daemon.keeper, a small detached process holding the fds, for daemons not
  run by systemd. A daemon killed with -9 leaves it running; the next daemon on the same
  runtime folder reconnects to it. The daemon calls ``check()`` about once a second: a keeper
  that died is restarted and given every fd again.
- NullStore: nothing survives the daemon.

Names: ``ws.<job>.<rank>`` for a workspace row, ``cb.<job>`` for a control block, where
``<job>`` is the job name with ``%``, ``:`` and anything outside printable ASCII
percent-encoded (``:`` -> ``%3A``), so that every name passes systemd's ``fdname_is_valid``
(which refuses ``:``, the separator of ``$LISTEN_FDNAMES``). An older daemon used
``ws:<job>:<rank>`` and ``cb:<job>``; ``load()`` translates those.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from a2ad import errors, fdpass
from a2ad.runtime import python_command

log = logging.getLogger("a2ad")

from a2ad.daemon.core.names import (  # noqa: E402,F401  (the store's names live with the core)
    FDNAME_MAX, _decode_job, _encode_job, _keep, _rank_of, cb_name, fdname_is_valid, normalize_name, parse_name, ws_name,
)


def _rejoin_legacy(tokens: list[str]) -> list[str]:
    """Best effort: ``$LISTEN_FDNAMES`` split at ':' when some names were legacy ones that
    themselves hold ':'. A legacy name starts at a ``ws``/``cb`` token; ``ws`` runs to the
    first all-digit token followed by the end or by the start of another name (``ws``, ``cb``,
    ``stored``, or a whole current name)."""
    out: list[str] = []
    i = 0
    starts = ("ws", "cb")

    def begins_name(tok: str) -> bool:
        return tok in starts or tok == "stored" or parse_name(tok) is not None

    while i < len(tokens):
        t = tokens[i]
        k = None
        if t in starts:
            for j in range(i + (2 if t == "ws" else 1), len(tokens)):
                at_end = j == len(tokens) - 1 or begins_name(tokens[j + 1])
                if at_end and (t == "cb" or _rank_of(tokens[j]) is not None):
                    k = j
                    break
        if k is None:
            out.append(t)
            i += 1
        else:
            out.append(":".join(tokens[i : k + 1]))
            i = k + 1
    return out


# --------------------------------------------------------------------------- stores
class FdStore:
    kind = "none"

    #: "ok", or "degraded" while the store cannot keep fds (a keeper being restarted).
    state = "ok"

    def put(self, name: str, fd: int) -> None:
        pass

    def drop(self, name: str) -> None:
        pass

    def load(self) -> dict[str, int]:
        """Fds a previous daemon stored (the caller owns them), under current names."""
        return {}

    def check(self, all_fds: Callable[[], dict[str, int]]) -> None:
        """Called about once a second from the daemon's loop; cheap and non-blocking."""

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
        if not fdname_is_valid(name):
            log.error("systemd fd store: %r is not a name systemd accepts; not storing it", name)
            return
        if not self._sd.notify(f"FDSTORE=1\nFDNAME={name}", fds=[fd]):
            log.warning("systemd fd store refused %s", name)

    def drop(self, name: str) -> None:
        if not fdname_is_valid(name):
            return  # systemd never stored it under this name
        self._sd.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")

    def load(self) -> dict[str, int]:
        if os.environ.get("LISTEN_PID") != str(os.getpid()):
            return {}
        try:
            n = int(os.environ.get("LISTEN_FDS", "0") or 0)
        except ValueError:
            n = 0
        raw = os.environ.get("LISTEN_FDNAMES", "")
        names = raw.split(":") if raw else []
        if len(names) != n:
            rejoined = _rejoin_legacy(names)
            if len(rejoined) == n:
                names = rejoined
            else:
                log.error("systemd passed %d fd(s) but %d name(s); the names cannot be matched to fds", n, len(names))
                names = []
        out: dict[str, int] = {}
        unnamed = 0
        legacy: list[tuple[str, str, int]] = []
        for i in range(n):
            fd = 3 + i
            try:
                os.set_inheritable(fd, False)
            except OSError:
                continue
            name = names[i] if i < len(names) else ""
            new = normalize_name(name)
            if new is None or new in out:
                unnamed += 1
                fdpass._close(fd)
                continue
            if new != name:
                legacy.append((name, new, fd))
            out[new] = fd
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
        if unnamed:
            log.warning(
                "systemd's fd store returned %d fd(s) without a usable a2ad name (an older a2ad stored "
                "them under names systemd refuses, so systemd kept them as 'stored'); they are closed",
                unnamed,
            )
            self._sd.notify("FDSTOREREMOVE=1\nFDNAME=stored")
        for old, new, fd in legacy:
            log.info("systemd fd store: legacy name %s is now %s", old, new)
            self.drop(old)
            self.put(new, fd)
        return out


class KeeperStore(FdStore):
    """Fds held by a2ad.daemon.keeper. ``state`` is "ok", or "degraded" from the moment the
    keeper is seen dead until a new one holds every fd again (see ``check``)."""

    kind = "keeper"
    #: Seconds one request to the keeper may take.
    CALL_TIMEOUT = 5.0
    #: Seconds a load (every fd, in batches) may take.
    LOAD_TIMEOUT = 30.0
    #: Seconds a starting keeper has to say READY.
    START_TIMEOUT = 10.0
    #: Backoff between failed restarts: first, then doubling up to the last.
    RESTART_BACKOFF = (0.5, 30.0)

    def __init__(self, runtime_dir: Path):
        from a2ad.daemon.keeper import KEEPER_SOCK

        self.path = Path(runtime_dir) / KEEPER_SOCK
        self.sock: socket.socket | None = None
        self._state = "ok"
        self.last_error: str | None = None
        self.restarts = 0
        self._starting: subprocess.Popen | None = None
        self._start_buf = b""
        self._start_deadline = 0.0
        self._children: list[subprocess.Popen] = []
        self._next_try = 0.0
        self._backoff = self.RESTART_BACKOFF[0]
        self._logged_failure: str | None = None
        self._all_fds: Callable[[], dict[str, int]] | None = None
        self._epoch = 0
        self._hung = False
        #: listeners on keeper.sock found running as another uid (handed nothing)
        self.impostors = 0
        if self.path.exists() and self._connect():
            log.info("fd keeper found at %s", self.path)
            return
        proc = self._spawn()
        try:
            self._wait_ready_blocking(proc, time.monotonic() + self.START_TIMEOUT)
        except errors.BackendError:
            _kill(proc)
            raise
        if not self._connect():
            _kill(proc)
            raise errors.BackendError(f"the fd keeper started but its socket {self.path} does not answer")
        log.info("fd keeper started (pid %d)", proc.pid)

    # ------------------------------------------------------------------ public
    @property
    def state(self) -> str:
        return self._state

    def put(self, name: str, fd: int) -> None:
        if self.sock is None:
            log.debug("fd keeper is down: %s will be stored when it is back", name)
            return
        try:
            reply = self._call({"op": "put", "name": name}, [fd])
        except _KeeperDown:
            return
        if not (isinstance(reply, dict) and reply.get("ok")):
            log.warning("fd keeper refused %s: %s", name, reply.get("message") if isinstance(reply, dict) else reply)

    def drop(self, name: str) -> None:
        if self.sock is None:
            return  # the refill after the restart stores only what the daemon still holds
        try:
            self._call({"op": "drop", "name": name})
        except _KeeperDown:
            return

    def load(self) -> dict[str, int]:
        """Every fd the keeper holds, under current names (legacy names are translated, and
        stored again in the keeper under the new name)."""
        if self.sock is None:
            raise errors.BackendError("the fd keeper is not connected")
        try:
            fdpass.send_frame(self.sock, {"op": "get", "chunked": True}, timeout=self.CALL_TIMEOUT)
            got = fdpass.recv_named_fds(self.sock, timeout=self.LOAD_TIMEOUT)
        except (OSError, errors.A2ADError) as exc:
            self._mark_dead(f"loading from the keeper failed: {exc}")
            raise errors.BackendError(f"could not load the fds the keeper holds: {exc}") from None
        out: dict[str, int] = {}
        for name, fd in got.items():
            new = normalize_name(name)
            if new is None or new in out:
                log.warning("fd keeper held %r, which is not an a2ad name; dropping it", name)
                fdpass._close(fd)
                self.drop(name)
                continue
            out[new] = fd
            if new != name:
                log.info("fd keeper: legacy name %s is now %s", name, new)
                self.put(new, fd)
                self.drop(name)
        return out

    def check(self, all_fds: Callable[[], dict[str, int]]) -> None:
        """Detect a dead keeper and replace it; call about once a second. Cheap and
        non-blocking: a peek at the keeper connection; while a new keeper starts, a
        non-blocking look at its READY line. When the new keeper is up, every fd of
        ``all_fds()`` (name -> fd, the daemon's current fds; the store does not take them) is
        stored in it in batches and anything else it holds is dropped; then ``state`` is "ok"
        again. A failed restart stays "degraded" and is retried on later checks with backoff."""
        self._all_fds = all_fds
        self._reap()
        if self.sock is not None and self._state == "ok":
            reason = self._peek_dead()
            if reason is None:
                return
            self._mark_dead(reason)
        elif self.sock is not None:
            self._close_sock()  # connected during a refill that did not finish: start over
        now = time.monotonic()
        if self._starting is not None:
            self._poll_start(now)
            return
        if now < self._next_try:
            return
        self._begin_restart(now)

    def close(self, clean: bool) -> None:
        if not clean and self._state == "degraded" and self._all_fds is not None:
            # the daemon stops keeping its jobs for the next one: make sure a keeper holds them
            self._restart_blocking()
        if self._starting is not None:
            _kill(self._starting)
            self._starting = None
        if self.sock is None:
            return
        if clean:
            try:
                self._call({"op": "exit"})
            except _KeeperDown:
                pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # ------------------------------------------------------------------ connection
    def _connect(self) -> bool:
        """Connect to the keeper socket; True once connected to a keeper run by this daemon's
        own uid. Nothing is sent before the peer's credentials are checked: a keeper.sock
        planted by another user gets no fd (and the daemon starts a keeper of its own)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(self.CALL_TIMEOUT)
            s.connect(str(self.path))
            pid, uid, _ = fdpass.peer_credentials(s)
        except OSError:
            s.close()
            return False
        if uid != os.getuid():
            s.close()
            self.impostors += 1
            log.error("fd keeper: the process listening on %s (pid %d) runs as uid %d, not this daemon's uid %d: "
                      "handing it nothing; it is set aside and a keeper of our own is started", self.path, pid, uid,
                      os.getuid())
            self._set_aside()
            return False
        self.sock = s
        return True

    def _set_aside(self) -> None:
        """Move a keeper.sock that is not ours out of the way (the runtime folder is ours, so
        we may), so that our keeper can bind the path."""
        aside = self.path.with_name(f"{self.path.name}.foreign-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            log.error("fd keeper: could not move %s aside: %s", self.path, exc)

    def _call(self, req: dict, fds: list[int] | None = None):
        """One request and its reply; raises _KeeperDown (after marking the keeper dead)
        when the keeper does not answer."""
        if self.sock is None:
            raise _KeeperDown("not connected")
        try:
            fdpass.send_frame(self.sock, req, fds, timeout=self.CALL_TIMEOUT)
            reply, extra = fdpass.recv_frame(self.sock, timeout=self.CALL_TIMEOUT)
        except (OSError, errors.A2ADError) as exc:  # TimeoutError and ConnectionError are OSErrors
            detail = exc.message if isinstance(exc, errors.A2ADError) else (str(exc) or type(exc).__name__)
            reason = f"{req.get('op')} failed: {detail}"
            self._mark_dead(reason, hung=isinstance(exc, TimeoutError))
            raise _KeeperDown(reason) from None
        fdpass.close_all(extra)
        return reply

    def _peek_dead(self) -> str | None:
        """Why the keeper connection is dead, or None while it looks alive (never blocks)."""
        try:
            self.sock.settimeout(0.0)
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            return f"the keeper connection failed: {exc}"
        if not data:
            return "the keeper closed its connection"
        return "the keeper sent something nobody asked for"

    def _close_sock(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _mark_dead(self, reason: str, hung: bool = False) -> None:
        # a keeper that stopped answering (rather than died) must not be reconnected to
        self._hung = self._hung or hung
        self._close_sock()
        if self._state != "degraded":
            log.error(
                "fd keeper lost (%s): until it is restarted and refilled, a daemon crash would lose every job",
                reason,
            )
            self._state = "degraded"
            self._next_try = 0.0
            self._backoff = self.RESTART_BACKOFF[0]
            self._logged_failure = None
        self.last_error = reason

    # ------------------------------------------------------------------ restart
    def _spawn(self) -> subprocess.Popen:
        try:
            return subprocess.Popen(
                python_command("a2ad.daemon.keeper", "--socket", str(self.path)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise errors.BackendError(f"could not start the fd keeper: {exc}") from None

    def _wait_ready_blocking(self, proc: subprocess.Popen, deadline: float) -> None:
        fd = proc.stdout.fileno()
        buf = b""
        try:
            with selectors.DefaultSelector() as sel:  # poll: this process may hold more than 1024 fds
                sel.register(fd, selectors.EVENT_READ)
                while b"\n" not in buf:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise errors.BackendError(f"the fd keeper did not start at {self.path} within {self.START_TIMEOUT} s")
                    if sel.select(remaining):
                        chunk = os.read(fd, 64)
                        if not chunk:
                            raise errors.BackendError(f"the fd keeper exited before it was ready (status {proc.wait(1)})")
                        buf += chunk
        finally:
            proc.stdout.close()
        if buf.split(b"\n", 1)[0].strip() != b"READY":
            raise errors.BackendError(f"the fd keeper said {buf!r} instead of READY")
        self._children.append(proc)

    def _begin_restart(self, now: float) -> None:
        # our connection broke but a keeper may still serve the path: use it (unless it hung;
        # a new keeper takes the path over and the hung one exits when it wakes up)
        if not self._hung and self.path.exists() and self._connect():
            log.info("fd keeper: reconnected to the keeper at %s", self.path)
            self._refill()
            return
        try:
            proc = self._spawn()
        except errors.BackendError as exc:
            self._restart_failed(exc.message)
            return
        os.set_blocking(proc.stdout.fileno(), False)
        self._starting = proc
        self._start_buf = b""
        self._start_deadline = now + self.START_TIMEOUT
        log.info("fd keeper: starting a new keeper (pid %d)", proc.pid)

    def _poll_start(self, now: float) -> None:
        proc = self._starting
        eof = False
        try:
            chunk = os.read(proc.stdout.fileno(), 64)
            if chunk:
                self._start_buf += chunk
            else:
                eof = True
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        if b"\n" in self._start_buf:
            proc.stdout.close()
            self._starting = None
            if self._start_buf.split(b"\n", 1)[0].strip() != b"READY":
                _kill(proc)
                self._restart_failed(f"the new keeper said {self._start_buf!r} instead of READY")
                return
            self._children.append(proc)
            self._hung = False
            if not self._connect():
                self._restart_failed(f"the new keeper (pid {proc.pid}) does not answer at {self.path}")
                return
            self._refill(pid=proc.pid)
            return
        if eof or proc.poll() is not None or now >= self._start_deadline:
            why = "exited before it was ready" if eof or proc.poll() is not None else f"was not ready within {self.START_TIMEOUT} s"
            proc.stdout.close()
            self._starting = None
            _kill(proc)
            self._restart_failed(f"the new keeper (pid {proc.pid}) {why}")

    def _refill(self, pid: int | None = None) -> None:
        """Store every fd the daemon holds in the (new) keeper, then drop whatever else it
        holds; success makes the store "ok" again."""
        try:
            fds = dict(self._all_fds()) if self._all_fds is not None else {}
        except Exception as exc:  # the daemon's callback: never let it stop the loop
            self._close_sock()  # the next attempt starts over from connecting
            self._restart_failed(f"listing the daemon's fds failed: {exc!r}")
            return
        self._epoch += 1
        epoch = f"{os.getpid()}-{self._epoch}-{time.time_ns()}"
        try:
            runs = fdpass.batches(list(fds))
        except fdpass.FdTransferError as exc:
            self._close_sock()
            self._restart_failed(exc.message)
            return
        try:
            for run in runs:
                reply = self._call({"op": "put_many", "names": run, "epoch": epoch}, [fds[n] for n in run])
                if not (isinstance(reply, dict) and reply.get("ok")):
                    raise _KeeperDown(f"the keeper refused a batch: {reply!r}")
            reply = self._call({"op": "prune", "epoch": epoch})
        except _KeeperDown as exc:
            if self.sock is not None:
                self._mark_dead(str(exc))
            self._restart_failed(f"refilling the keeper failed: {exc}")
            return
        self.restarts += 1
        self._state = "ok"
        self.last_error = None
        self._logged_failure = None
        self._backoff = self.RESTART_BACKOFF[0]
        self._next_try = 0.0
        dropped = reply.get("dropped", 0) if isinstance(reply, dict) else 0
        log.info(
            "fd keeper%s is back: it holds all %d fd(s) again%s",
            f" (pid {pid})" if pid else "",
            len(fds),
            f" ({dropped} stale fd(s) dropped)" if dropped else "",
        )

    def _restart_failed(self, reason: str) -> None:
        self.last_error = reason
        delay = self._backoff
        self._next_try = time.monotonic() + delay
        self._backoff = min(self._backoff * 2, self.RESTART_BACKOFF[1])
        if reason != self._logged_failure:
            log.error("fd keeper restart failed: %s (retrying in %.1f s, then less often)", reason, delay)
            self._logged_failure = reason
        else:
            log.debug("fd keeper restart failed again: %s (retrying in %.1f s)", reason, delay)

    def _restart_blocking(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT + 2.0
        self._next_try = 0.0
        while self._state == "degraded" and time.monotonic() < deadline:
            self.check(self._all_fds)
            if self._state == "degraded":
                time.sleep(0.02)
                if self._starting is None and self._next_try > deadline:
                    break
        if self._state == "degraded":
            log.error("fd keeper: could not restart it before stopping; the jobs' fds are not kept (%s)", self.last_error)

    def _reap(self) -> None:
        self._children = [p for p in self._children if p.poll() is None]


class _KeeperDown(Exception):
    pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        pass
    for f in (proc.stdout,):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass


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
