"""The fd keeper: a tiny process that holds the daemon's workspace fds so that they
outlive the daemon (a crash, kill -9, or an upgrade) when no systemd fd store exists.

It listens on ``<runtime dir>/keeper.sock`` (AF_UNIX stream, a2ad.fdpass frames) and
serves only its own uid, which is the daemon's (it is the daemon that starts it): a
connection from any other uid, root included, is closed at once (SO_PEERCRED). Requests
(many per connection):
  {"op": "put", "name": N} + one fd           store (replacing any fd under N)
  {"op": "put_many", "names": [...], "epoch": E} + len(names) fds
                                              store them all (at most fdpass.BATCH_FDS per frame)
  {"op": "drop", "name": N}                   close and forget N
  {"op": "prune", "epoch": E}                 close and forget every fd not last stored with epoch E
  {"op": "get", "chunked": true}              reply: fdpass.send_named_fds frames, each
                                              {"ok": true, "names": [...], "more": b, "total": n}
  {"op": "get"}                               (older daemons) one reply frame {"ok": true, "names": [...]} + all fds
  {"op": "ping"}                              {"ok": true, "count": n, "pid": p, "jobs": j, "bytes": b,
                                               "linger": s, "freed_jobs": f}
  {"op": "exit"}                              close everything and exit
Every other request gets one reply map {"ok": bool, ...}. The keeper holds no other state
and never touches the memory behind the fds.

A daemon that does not come back: while nobody is connected, the keeper looks once a second
at each job's rank lock (a2ad/control.py, "Holder and rank locks": every attached rank holds
one on its own description of the control block). A job that has had no daemon connected and
no rank attached for ``--linger`` seconds (default $A2AD_KEEPER_LINGER, else DEFAULT_LINGER;
``a2ad serve --keeper-linger``) is freed: the keeper closes its fds, and with them ends the
job's holder lock, so processes that still map it learn it at their next call. A daemon's
connection (one that stored, dropped or loaded fds; a ping does not count) stops every such
clock while it stands.

It exits when told to, when its socket path is removed or replaced (a newer keeper took
over the runtime folder), or after IDLE_EXIT seconds holding nothing with no daemon connected.
The loop waits with selectors (epoll), so any number of fds may be held.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import selectors
import signal
import socket
import sys
import time

from a2ad import fdpass
from a2ad.control import ranks_present

KEEPER_SOCK = "keeper.sock"
#: Seconds the keeper lingers holding nothing with no daemon connected, then exits.
IDLE_EXIT = 30.0
#: Seconds one request (reading it, or sending its reply) may take before the connection is dropped.
IO_TIMEOUT = 10.0
#: Environment variable: the default of --linger (the daemon sets it from --keeper-linger).
LINGER_ENV = "A2AD_KEEPER_LINGER"
#: Seconds a job is kept with no daemon connected and no rank attached, unless configured.
DEFAULT_LINGER = 600.0
#: Seconds between two looks at the jobs' rank locks while no daemon is connected.
SCAN_EVERY = 1.0


def parse_linger(text) -> float:
    """A linger time in seconds (>= 0, finite); ValueError naming the value otherwise."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"keeper linger must be a number of seconds >= 0, got {text!r}")
    return value


def raise_nofile_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard limit (holding many fds is the whole job)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass


class _Store:
    def __init__(self):
        self.fds: dict[str, int] = {}
        self.epochs: dict[str, object] = {}

    def put(self, name: str, fd: int, epoch=None) -> None:
        old = self.fds.get(name)
        self.fds[name] = fd
        self.epochs[name] = epoch
        if old is not None and old != fd:
            fdpass._close(old)

    def drop(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        self.epochs.pop(name, None)
        if fd is not None:
            fdpass._close(fd)

    def prune(self, epoch) -> int:
        stale = [n for n, e in self.epochs.items() if e != epoch]
        for n in stale:
            self.drop(n)
        return len(stale)

    def close(self) -> None:
        fdpass.close_all(self.fds.values())
        self.fds.clear()
        self.epochs.clear()

    def jobs(self) -> dict[str, list[str]]:
        """Job name -> the names of its fds (workspace rows and control block)."""
        from a2ad.daemon.fdstore import parse_name

        out: dict[str, list[str]] = {}
        for name in self.fds:
            parsed = parse_name(name)
            out.setdefault(parsed[1] if parsed else name, []).append(name)
        return out

    def bytes_held(self, names=None) -> int:
        total = 0
        for n in self.fds if names is None else names:
            try:
                total += os.fstat(self.fds[n]).st_size
            except (OSError, KeyError):
                pass
        return total


class _Linger:
    """Frees jobs that had no daemon connected and no rank attached for ``linger`` seconds."""

    def __init__(self, linger: float):
        self.linger = linger
        self.gone_since: float | None = None  # since when no connection stands
        self.free_since: dict[str, float] = {}  # job -> the first look that found no rank attached
        self.next_scan = 0.0
        self.freed = 0

    def connected(self) -> None:
        self.gone_since = None
        self.free_since.clear()

    def scan(self, store: _Store, now: float) -> None:
        if self.gone_since is None:
            self.gone_since = now
        if now < self.next_scan:
            return
        self.next_scan = now + SCAN_EVERY
        from a2ad.daemon.fdstore import cb_name

        for job, names in store.jobs().items():
            try:
                cfd = store.fds.get(cb_name(job))
            except ValueError:
                cfd = None
            if cfd is not None and ranks_present(cfd):
                self.free_since.pop(job, None)
                continue
            since = max(self.gone_since, self.free_since.setdefault(job, now))
            if now - since < self.linger:
                continue
            nbytes = store.bytes_held(names)
            for n in names:
                store.drop(n)
            self.free_since.pop(job, None)
            self.freed += 1
            _say(f"freed job {job} ({len(names)} fd(s), {nbytes} bytes): no daemon connected for "
                 f"{now - self.gone_since:.1f} s and no rank attached for {now - since:.1f} s (linger {self.linger:g} s)")


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"a2ad keeper[{os.getpid()}]: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _valid_name(name) -> bool:
    return isinstance(name, str) and 0 < len(name.encode("utf-8", "replace")) <= fdpass.MAX_NAME_BYTES


def _handle(s: socket.socket, req, fds: list[int], store: _Store, linger: _Linger | None = None) -> bool:
    """Serve one request; returns False when the keeper should exit. Fds taken into the
    store are removed from ``fds``; the caller closes whatever is left."""
    op = req.get("op") if isinstance(req, dict) else None
    if op == "put":
        name = req.get("name")
        if not _valid_name(name) or len(fds) != 1:
            fdpass.send_frame(s, {"ok": False, "message": "put needs a name and exactly one fd"}, timeout=IO_TIMEOUT)
            return True
        store.put(name, fds.pop(), req.get("epoch"))
        fdpass.send_frame(s, {"ok": True}, timeout=IO_TIMEOUT)
    elif op == "put_many":
        names = req.get("names")
        if (
            not isinstance(names, list)
            or len(names) != len(fds)
            or not all(_valid_name(n) for n in names)
            or len(set(names)) != len(names)
        ):
            fdpass.send_frame(s, {"ok": False, "message": "put_many needs distinct names, one per fd"}, timeout=IO_TIMEOUT)
            return True
        epoch = req.get("epoch")
        for name, fd in zip(names, fds):
            store.put(name, fd, epoch)
        fds.clear()
        fdpass.send_frame(s, {"ok": True, "count": len(names)}, timeout=IO_TIMEOUT)
    elif op == "drop":
        name = req.get("name")
        if isinstance(name, str):
            store.drop(name)
        fdpass.send_frame(s, {"ok": True}, timeout=IO_TIMEOUT)
    elif op == "prune":
        dropped = store.prune(req.get("epoch"))
        fdpass.send_frame(s, {"ok": True, "dropped": dropped}, timeout=IO_TIMEOUT)
    elif op == "get":
        names = sorted(store.fds)
        if req.get("chunked"):
            fdpass.send_named_fds(s, {n: store.fds[n] for n in names}, timeout=IO_TIMEOUT, extra={"ok": True})
        elif len(names) > fdpass.MAX_FDS:
            fdpass.send_frame(
                s, {"ok": False, "message": f"{len(names)} fds do not fit one frame; ask with chunked=true"}, timeout=IO_TIMEOUT
            )
        else:
            fdpass.send_frame(s, {"ok": True, "names": names}, [store.fds[n] for n in names], timeout=IO_TIMEOUT)
    elif op == "ping":
        fdpass.send_frame(s, {
            "ok": True, "count": len(store.fds), "pid": os.getpid(), "jobs": len(store.jobs()),
            "bytes": store.bytes_held(), "linger": None if linger is None else linger.linger,
            "freed_jobs": 0 if linger is None else linger.freed,
        }, timeout=IO_TIMEOUT)
    elif op == "exit":
        fdpass.send_frame(s, {"ok": True}, timeout=IO_TIMEOUT)
        return False
    else:
        fdpass.send_frame(s, {"ok": False, "message": f"bad request {op!r}"}, timeout=IO_TIMEOUT)
    return True


#: Requests only a daemon makes: a connection that sent one is a daemon's while it stands.
_DAEMON_OPS = frozenset({"put", "put_many", "drop", "prune", "get"})


def _same_socket(path: str, ident: tuple[int, int]) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ident


def serve(path: str, linger: float | None = None) -> int:
    raise_nofile_limit()
    if linger is None:
        linger = parse_linger(os.environ.get(LINGER_ENV, DEFAULT_LINGER))
    store = _Store()
    lingering = _Linger(linger)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    old = os.umask(0o177)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        lsock.bind(path)
    finally:
        os.umask(old)
    st = os.stat(path)
    ident = (st.st_dev, st.st_ino)
    lsock.listen(16)
    sel = selectors.DefaultSelector()  # epoll: no limit on fd numbers, unlike select()
    sel.register(lsock, selectors.EVENT_READ)
    conns: set[socket.socket] = set()
    #: connections that stored, dropped or loaded fds: a daemon's (a ping does not count)
    daemons: set[socket.socket] = set()
    uid = os.getuid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # tell the starter we are listening
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    running = True
    idle_since = time.monotonic()

    def drop_conn(c: socket.socket) -> None:
        conns.discard(c)
        daemons.discard(c)
        try:
            sel.unregister(c)
        except (KeyError, ValueError):
            pass
        c.close()

    while running:
        events = sel.select(SCAN_EVERY)
        if not _same_socket(path, ident):
            break  # the runtime folder is gone, or a newer keeper owns the path: nobody reaches us
        now = time.monotonic()
        if daemons:
            lingering.connected()
        elif store.fds:
            lingering.scan(store, now)
        if conns or store.fds:
            idle_since = now
        elif now - idle_since > IDLE_EXIT:
            break  # holding nothing and nobody connected
        for key, _ in events:
            s = key.fileobj
            if s is lsock:
                try:
                    c, _ = lsock.accept()
                except OSError:
                    continue
                try:
                    _, cuid, _ = fdpass.peer_credentials(c)
                except OSError:
                    c.close()
                    continue
                if cuid != uid:
                    c.close()  # only the daemon's uid (ours) may hand fds over or take them
                    continue
                conns.add(c)
                sel.register(c, selectors.EVENT_READ)
                continue
            if s not in conns:
                continue
            try:
                req, fds = fdpass.recv_frame(s, timeout=IO_TIMEOUT)
            except Exception:
                drop_conn(s)
                continue
            if isinstance(req, dict) and req.get("op") in _DAEMON_OPS:
                daemons.add(s)
                lingering.connected()
            try:
                running = _handle(s, req, fds, store, lingering)
            except Exception:
                # a reply that could not be sent (peer gone, timed out): that connection is done
                drop_conn(s)
            finally:
                fdpass.close_all(fds)
            if not running:
                break
    store.close()
    for c in list(conns):
        drop_conn(c)
    sel.close()
    lsock.close()
    if _same_socket(path, ident):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="a2ad-keeper", description="hold a2ad's workspace fds across daemon restarts")
    p.add_argument("--socket", required=True)
    p.add_argument("--linger", type=_linger_arg, default=None,
                   help=f"seconds a job is kept with no daemon connected and no rank attached, then freed "
                        f"(default ${LINGER_ENV}, else {DEFAULT_LINGER:g})")
    args = p.parse_args(argv)
    try:
        linger = args.linger if args.linger is not None else parse_linger(os.environ.get(LINGER_ENV, DEFAULT_LINGER))
    except ValueError as exc:
        p.error(f"${LINGER_ENV}: {exc}")
    return serve(args.socket, linger)


def _linger_arg(text: str) -> float:
    try:
        return parse_linger(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
