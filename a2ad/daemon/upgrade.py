"""The upgrade hand-over: a running daemon starts its successor with the same arguments and
hands it every job as one transaction.

1. The predecessor writes its state file, starts ``a2ad serve ... --takeover`` with one end of
   a private socketpair (its fd number in ``$A2AD_HANDOVER_SOCK``) and sends every workspace
   and control-block fd over it.
2. The successor adopts the jobs from those fds and the state file, answers
   ``{"ok", "jobs", "pid"}`` and waits for the predecessor's ``go``.
3. The predecessor checks that every job is held, says ``go``, lets go of the runtime folder
   and stops; the successor takes the lock and binds the sockets.

On any failure before the ``go`` the successor is stopped and the predecessor stays in
charge. Every wait is bounded and uses poll (never ``select()``: the daemon may hold far more
than 1024 fds).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import subprocess
import time
from typing import TYPE_CHECKING

from a2ad import errors, fdpass, runtime
from a2ad.daemon import persist, sdnotify
from a2ad.daemon.fdstore import NullStore

if TYPE_CHECKING:
    from a2ad.daemon.server import Daemon

log = logging.getLogger("a2ad")

#: Environment variable naming the socket an upgrading daemon hands its jobs over on.
HANDOVER_ENV = "A2AD_HANDOVER_SOCK"
#: Seconds a successor has to confirm that it holds every job.
HANDOVER_TIMEOUT = 60.0
#: Seconds the fds may take to travel, either way.
TRANSFER_TIMEOUT = 30.0


def upgrade(d: Daemon) -> dict:
    """The predecessor's side (the ``upgrade`` request): start a successor daemon with our
    arguments and hand it every job; on any failure the successor is stopped and this daemon
    stays in charge (BackendError says why)."""
    if d.store.kind == "none":
        raise errors.BackendError("this daemon runs with --fd-store none: an upgrade would lose every job")
    d._write_state_now()
    if not d.state.healthy:
        raise errors.BackendError(f"upgrade refused: the state file cannot be written ({d.state.last_error}); "
                                  "this daemon stays in charge")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [a for a in d.cfg.argv if a != "--takeover"]
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")}
    env[HANDOVER_ENV] = str(theirs.fileno())
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            runtime.python_command("a2ad.tools.cli", "serve", *argv, "--takeover"),
            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True, pass_fds=[theirs.fileno()], env=env,
        )
    except OSError as exc:
        ours.close()
        theirs.close()
        raise errors.BackendError(f"upgrade failed: the successor could not be started: {exc}; this daemon stays in charge") from None
    theirs.close()
    fds = d.registry.all_fds()
    try:
        fdpass.send_named_fds(ours, fds, timeout=TRANSFER_TIMEOUT)
        answer = _await_successor(d, ours, proc)
        expected = sorted(d.registry.jobs)
        if not isinstance(answer, dict) or not answer.get("ok"):
            why = answer.get("message", "no reason given") if isinstance(answer, dict) else "a bad answer"
            raise errors.BackendError(f"the successor refused the handover: {why}")
        if sorted(answer.get("jobs", [])) != expected:
            missing = sorted(set(expected) - set(answer.get("jobs", [])))
            raise errors.BackendError(f"the successor adopted {len(answer.get('jobs', []))} of {len(expected)} jobs "
                                      f"(missing {missing[:10]})")
        fdpass.send_frame(ours, {"op": "go"}, timeout=5.0)
    except (errors.A2ADError, OSError, TimeoutError, ValueError) as exc:
        msg = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        try:
            fdpass.send_frame(ours, {"op": "abort"}, timeout=1.0)
        except (OSError, TimeoutError, ValueError, errors.A2ADError):
            pass
        ours.close()
        stop_process(proc)
        log.error("upgrade failed, this daemon (pid %d) stays in charge: %s", os.getpid(), msg)
        raise errors.BackendError(f"upgrade failed: {msg}; the old daemon (pid {os.getpid()}) stays in charge") from None
    ours.close()
    if os.environ.get("NOTIFY_SOCKET"):
        sdnotify.notify(f"MAINPID={proc.pid}")  # before the successor's READY=1 and watchdog
    log.info("upgrade: successor daemon (pid %d) holds all %d job(s) (%d fds, %.2f s); handing over",
             proc.pid, len(d.registry.jobs), len(fds), time.monotonic() - t0)
    d.handover = True
    d.stopping = True
    return {"successor_pid": proc.pid, "jobs": sorted(d.registry.jobs)}


def _await_successor(d: Daemon, sock: socket.socket, proc: subprocess.Popen) -> object:
    """The successor's answer, waiting at most HANDOVER_TIMEOUT; meanwhile the watchdog is
    fed, the domain peers keep hearing this node and ctl.sock connections are still
    counted (the fd budget must not go blind while we wait)."""
    end = time.monotonic() + HANDOVER_TIMEOUT
    sock.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= end:
                raise errors.BackendError(f"the successor (pid {proc.pid}) did not confirm within {HANDOVER_TIMEOUT:g} s")
            if proc.poll() is not None:
                raise errors.BackendError(f"the successor (pid {proc.pid}) exited with {proc.returncode} before confirming")
            readable = sel.select(min(0.2, end - now))
            d.notifier.tick(d)
            d.keep_accounting()
            if d.domain is not None:
                d.domain.tick(time.monotonic())
            if readable:
                answer, extra = fdpass.recv_frame(sock, timeout=max(0.1, end - time.monotonic()))
                fdpass.close_all(extra)
                return answer


def handover_socket() -> socket.socket | None:
    """The successor's end of the hand-over socket, when this daemon was started by an upgrade."""
    raw = os.environ.pop(HANDOVER_ENV, None)
    if not raw:
        return None
    try:
        sock = socket.socket(fileno=int(raw))
    except (ValueError, OSError) as exc:
        raise errors.BackendError(f"bad upgrade handover socket {raw!r}: {exc}") from None
    sock.set_inheritable(False)
    return sock


def receive_handover(d: Daemon, sock: socket.socket) -> None:
    """The successor's side: receive the fds, adopt every job from them and the state file,
    confirm, and wait for the predecessor's go (then it lets go of the folder and we take it).
    Nothing is dropped from the store before the go."""
    try:
        fds = fdpass.recv_named_fds(sock, timeout=TRANSFER_TIMEOUT)
        store_fds = {}
        try:
            store_fds = d.store.load()
        except Exception as exc:
            log.warning("upgrade: the fd store could not be read (%s); using the handed-over fds", exc)
        for name, fd in store_fds.items():  # the handed-over fds win
            if name in fds:
                os.close(fd)
            else:
                fds[name] = fd
        state = persist.load(d.cfg.runtime_dir)
        keep_store = d.store
        d.store = d.registry.store = NullStore()  # no drops until we are in charge
        try:
            d._adopt(fds, state)
        finally:
            d.store = d.registry.store = keep_store
        fdpass.send_frame(sock, {"ok": True, "jobs": sorted(d.registry.jobs), "pid": os.getpid()}, timeout=5.0)
        answer, extra = fdpass.recv_frame(sock, timeout=HANDOVER_TIMEOUT)
        fdpass.close_all(extra)
    except (errors.A2ADError, OSError, TimeoutError, ValueError) as exc:
        raise errors.BackendError(f"upgrade handover failed: {getattr(exc, 'message', None) or exc}") from None
    finally:
        sock.close()
    if not isinstance(answer, dict) or answer.get("op") != "go":
        raise errors.BackendError("the predecessor called the upgrade off")
    for name, fd in d.registry.all_fds().items():  # the store now follows us
        d.store.put(name, fd)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
