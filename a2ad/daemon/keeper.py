"""The fd keeper: a tiny process that holds the daemon's workspace fds so that they
outlive the daemon (a crash, kill -9, or an upgrade) when no systemd fd store exists.

It listens on ``<runtime dir>/keeper.sock`` (AF_UNIX stream, a2ad.fdpass frames) and
serves only its own uid. Requests (one per connection or many):
  {"op": "put", "name": N} + one fd   store (replacing any fd under N)
  {"op": "drop", "name": N}           close and forget N
  {"op": "get"}                       reply {"names": [...]} + all fds, in that order
  {"op": "exit"}                      close everything and exit
Each request gets a reply map {"ok": bool, ...}. The keeper holds no other state and
never touches the memory behind the fds.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import time

from a2ad import fdpass

KEEPER_SOCK = "keeper.sock"
#: Seconds the keeper lingers holding nothing with no daemon connected, then exits.
IDLE_EXIT = 30.0


def serve(path: str) -> int:
    store: dict[str, int] = {}
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    old = os.umask(0o177)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    lsock.bind(path)
    os.umask(old)
    lsock.listen(16)
    conns: list[socket.socket] = []
    uid = os.getuid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # tell the starter we are listening
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    running = True
    idle_since = time.monotonic()
    while running:
        readable, _, _ = select.select([lsock, *conns], [], [], 1.0)
        if not os.path.exists(path):
            break  # the runtime folder is gone: nobody can reach us any more
        if conns or store:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_EXIT:
            break  # holding nothing and nobody connected
        for s in readable:
            if s is lsock:
                c, _ = lsock.accept()
                _, cuid, _ = _cred(c)
                if cuid not in (uid, 0):
                    c.close()
                    continue
                conns.append(c)
                continue
            try:
                req, fds = fdpass.recv_frame(s, timeout=5.0)
            except Exception:
                conns.remove(s)
                s.close()
                continue
            op = req.get("op") if isinstance(req, dict) else None
            name = req.get("name") if isinstance(req, dict) else None
            try:
                if op == "put" and isinstance(name, str) and len(fds) == 1:
                    if name in store:
                        os.close(store[name])
                    store[name] = fds.pop()
                    fdpass.send_frame(s, {"ok": True})
                elif op == "drop" and isinstance(name, str):
                    fd = store.pop(name, None)
                    if fd is not None:
                        os.close(fd)
                    fdpass.send_frame(s, {"ok": True})
                elif op == "get":
                    names = sorted(store)
                    fdpass.send_frame(s, {"ok": True, "names": names}, [store[n] for n in names])
                elif op == "exit":
                    fdpass.send_frame(s, {"ok": True})
                    running = False
                else:
                    fdpass.send_frame(s, {"ok": False, "message": f"bad request {op!r}"})
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
    for fd in store.values():
        os.close(fd)
    for c in conns:
        c.close()
    lsock.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return 0


def _cred(sock: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = fdpass.peer_credentials(sock)
    return pid, uid, gid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="a2ad-keeper", description="hold a2ad's workspace fds across daemon restarts")
    p.add_argument("--socket", required=True)
    args = p.parse_args(argv)
    return serve(args.socket)


if __name__ == "__main__":
    sys.exit(main())
