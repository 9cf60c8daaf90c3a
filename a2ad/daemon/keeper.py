"""The fd keeper: a tiny process that holds the daemon's workspace fds so that they
outlive the daemon (a crash, kill -9, or an upgrade) when no systemd fd store exists.

It listens on ``<runtime dir>/keeper.sock`` (AF_UNIX stream, a2ad.fdpass frames) and
serves only its own uid (and root). Requests (many per connection):
  {"op": "put", "name": N} + one fd           store (replacing any fd under N)
  {"op": "put_many", "names": [...], "epoch": E} + len(names) fds
                                              store them all (at most fdpass.BATCH_FDS per frame)
  {"op": "drop", "name": N}                   close and forget N
  {"op": "prune", "epoch": E}                 close and forget every fd not last stored with epoch E
  {"op": "get", "chunked": true}              reply: fdpass.send_named_fds frames, each
                                              {"ok": true, "names": [...], "more": b, "total": n}
  {"op": "get"}                               (older daemons) one reply frame {"ok": true, "names": [...]} + all fds
  {"op": "ping"}                              {"ok": true, "count": n, "pid": p}
  {"op": "exit"}                              close everything and exit
Every other request gets one reply map {"ok": bool, ...}. The keeper holds no other state
and never touches the memory behind the fds.

It exits when told to, when its socket path is removed or replaced (a newer keeper took
over the runtime folder), or after IDLE_EXIT seconds holding nothing with no daemon connected.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import socket
import sys
import time

from a2ad import fdpass

KEEPER_SOCK = "keeper.sock"
#: Seconds the keeper lingers holding nothing with no daemon connected, then exits.
IDLE_EXIT = 30.0
#: Seconds one request (reading it, or sending its reply) may take before the connection is dropped.
IO_TIMEOUT = 10.0


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


def _valid_name(name) -> bool:
    return isinstance(name, str) and 0 < len(name.encode("utf-8", "replace")) <= fdpass.MAX_NAME_BYTES


def _handle(s: socket.socket, req, fds: list[int], store: _Store) -> bool:
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
        fdpass.send_frame(s, {"ok": True, "count": len(store.fds), "pid": os.getpid()}, timeout=IO_TIMEOUT)
    elif op == "exit":
        fdpass.send_frame(s, {"ok": True}, timeout=IO_TIMEOUT)
        return False
    else:
        fdpass.send_frame(s, {"ok": False, "message": f"bad request {op!r}"}, timeout=IO_TIMEOUT)
    return True


def _same_socket(path: str, ident: tuple[int, int]) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ident


def serve(path: str) -> int:
    raise_nofile_limit()
    store = _Store()
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
    conns: list[socket.socket] = []
    uid = os.getuid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # tell the starter we are listening
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    running = True
    idle_since = time.monotonic()
    while running:
        readable, _, _ = select.select([lsock, *conns], [], [], 1.0)
        if not _same_socket(path, ident):
            break  # the runtime folder is gone, or a newer keeper owns the path: nobody reaches us
        if conns or store.fds:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_EXIT:
            break  # holding nothing and nobody connected
        for s in readable:
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
                if cuid not in (uid, 0):
                    c.close()
                    continue
                conns.append(c)
                continue
            try:
                req, fds = fdpass.recv_frame(s, timeout=IO_TIMEOUT)
            except Exception:
                conns.remove(s)
                s.close()
                continue
            try:
                running = _handle(s, req, fds, store)
            except Exception:
                # a reply that could not be sent (peer gone, timed out): that connection is done
                conns.remove(s)
                s.close()
            finally:
                fdpass.close_all(fds)
            if not running:
                break
    store.close()
    for c in conns:
        c.close()
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
    args = p.parse_args(argv)
    return serve(args.socket)


if __name__ == "__main__":
    sys.exit(main())
