"""The domain gate: a small process of its own that listens on this node's domain TCP port,
so that whatever reaches that port before authenticating spends the gate's file
descriptors, never the daemon's.

Why a process: anyone who can reach the port may open connections without holding a key,
and libzmq takes an fd for each one before the CURVE handshake can refuse it. In the
daemon's process those fds would come out of the table that its ``ctl.sock`` listener,
leases, pidfds and workspaces share, and libzmq aborts the whole process when an ipc
``accept()`` meets EMFILE. Here a flood can at worst fill the gate's own table: libzmq's TCP
listener survives EMFILE (it retries), the gate sheds connections past a cap of
unauthenticated ones and closes any that has not finished its handshake within
``HANDSHAKE_IVL``; and should the gate die all the same, the daemon starts another one and
serves on.

What the gate holds: the CURVE server socket (a ROUTER) with this node's secret key, and the
ZAP handler that lets in exactly the configured nodes' public keys. It forwards every
message that arrives on an authenticated connection to the daemon over one private
socketpair, with the node name the ZAP handler attached to the connection (never a claim
inside the message); the daemon decodes and judges the message (domain.py). Frames on the
socketpair: a 4-byte big-endian length, then a msgpack array:

- ``["m", node, payload]``: a message from ``node``;
- ``["s", counters, t]``: the gate's counters (refused connections, ZAP requests, shed ones),
  every ``REPORT_EVERY`` while its loop runs, with its ``time.monotonic()`` then (the
  daemon's clock too): the daemon tells from them when the gate did not run;
- ``["l", level, text]``: a line for the daemon's log (sent after the counters it is about).

Started by the daemon (``Domain.start``) with the socketpair's fd number in ``--channel``
and its settings as one msgpack map on stdin (the secret key never appears in argv); it
prints ``READY`` or ``ERROR <why>`` on stdout and exits when the socketpair closes.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import struct
import sys
import time

import msgpack
import zmq

log = logging.getLogger("a2ad")

#: Milliseconds a connection to the domain port has to finish its CURVE handshake.
HANDSHAKE_IVL_MS = 3000
#: Connections to the port, past which a new one is shut down at once: each of the domain's
#: other nodes needs one, and this many more may be mid-handshake.
MAX_PREAUTH = 512
#: Seconds between the counter reports to the daemon (domain.GATE_REPORT_EVERY: the daemon tells
#: from a longer gap that the gate did not run).
REPORT_EVERY = 0.5
#: Seconds the gate retries binding its address (a previous gate may still be exiting).
BIND_RETRY = 5.0
CHANNEL_HDR = struct.Struct(">I")


def frame(obj) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return CHANNEL_HDR.pack(len(data)) + data


class Gate:
    def __init__(self, cfg: dict, channel: socket.socket):
        self.cfg = cfg
        self.name = cfg["domain"]
        self.bind_addr = cfg["bind"]
        self.allowed: dict[bytes, str] = {bytes(k): v for k, v in cfg["allowed"].items()}
        self.channel = channel
        self.counters = {"refused_connections": 0, "zap_requests": 0, "shed_connections": 0,
                         "handshake_timeouts": 0, "authenticated": 0}
        #: the fds of the connections libzmq accepted on the port (authenticated or not: libzmq's
        #: handshake events do not say which connection they are about)
        self.conns: set[int] = set()
        #: log lines for the daemon to write, after the counters they are about
        self._lines: list[tuple[int, str]] = []
        self._last_line: dict = {}
        self.max_conns = MAX_PREAUTH + len(self.allowed)
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.zap = self.router = self.monitor = None

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        from a2ad.daemon.domain import LINK_HWM

        # the ZAP handler first: a CURVE server without one would let any key in
        self.zap = self.ctx.socket(zmq.ROUTER)
        self.zap.bind("inproc://zeromq.zap.01")
        r = self.ctx.socket(zmq.ROUTER)
        self.router = r
        r.setsockopt(zmq.LINGER, 0)
        # the frame cap counts CURVE's overhead and more: the daemon logs and drops a message over
        # its own cap, so that an oversized one never takes the link with it (domain.MAX_DOMAIN_FRAME)
        r.setsockopt(zmq.MAXMSGSIZE, int(self.cfg["max_frame"]))
        r.setsockopt(zmq.RCVHWM, LINK_HWM)
        r.setsockopt(zmq.HANDSHAKE_IVL, int(self.cfg.get("handshake_ivl_ms", HANDSHAKE_IVL_MS)))
        r.setsockopt(zmq.BACKLOG, 128)
        r.setsockopt(zmq.ZAP_DOMAIN, f"a2ad:{self.name}".encode())
        r.curve_server = True
        r.curve_secretkey = bytes(self.cfg["secret"])
        r.curve_publickey = bytes(self.cfg["public"])
        self.monitor = r.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        end = time.monotonic() + BIND_RETRY
        while True:
            try:
                r.bind(self.bind_addr)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= end:
                    raise RuntimeError(
                        f"domain {self.name}: node {self.cfg['node']} cannot listen on {self.bind_addr}: {exc} "
                        "(another process holds the port, or the address is not this host's)") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.router is not None and self.monitor is not None:
            try:
                self.router.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (self.monitor, self.router, self.zap):
            if s is not None:
                s.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------- loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.channel, zmq.POLLIN)
        next_report = 0.0
        while True:
            events = dict(poller.poll(int(REPORT_EVERY * 1000)))
            if self.channel.fileno() in events:  # (the poller answers with fd numbers for plain sockets)
                try:
                    if not self.channel.recv(4096):
                        return  # the daemon is gone (or closed us): so are we
                except BlockingIOError:
                    pass
                except OSError:
                    return
            if self.zap in events:
                self._serve_zap()
            if self.monitor in events:
                self._events()
            if self.router in events:
                if not self._forward():
                    return
            now = time.monotonic()
            if now >= next_report or self._lines:
                next_report = now + REPORT_EVERY
                if not self._send(["s", dict(self.counters, connections=len(self.conns)), now]):
                    return
                lines, self._lines = self._lines, []
                for level, text in lines:
                    if not self._send(["l", level, text]):
                        return

    def _ratelog(self, level: int, key, msg: str, *args) -> None:
        """At most one line per key every 10 s (how many were suppressed is said); the daemon
        writes it, once it has the counters that go with it."""
        now = time.monotonic()
        if key not in self._last_line and len(self._last_line) >= 1024:  # a flood from many addresses
            self._last_line = {k: v for k, v in self._last_line.items() if now - v[0] < 10.0}
            if len(self._last_line) >= 1024:
                self._last_line.clear()
        last, skipped = self._last_line.get(key, (None, 0))
        if last is not None and now - last < 10.0:
            self._last_line[key] = (last, skipped + 1)
            return
        self._last_line[key] = (now, 0)
        text = msg % args
        if skipped:
            text += f" ({skipped} more like it since the last report)"
        self._lines.append((level, text))

    def _send(self, obj) -> bool:
        """One frame to the daemon; blocks while the daemon does not read (backpressure all
        the way to the peers' TCP connections). False once the daemon is gone."""
        try:
            self.channel.sendall(frame(obj))
            return True
        except OSError:
            return False

    def _forward(self) -> bool:
        for _ in range(256):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                node = frames[-1].get("User-Id")
            except zmq.ZMQError:
                node = None
            if not node or len(frames) != 2:
                # a message without one payload frame: the daemon counts and logs it for the node
                if node and not self._send(["m", node, None]):
                    return False
                continue
            if not self._send(["m", node, frames[1].bytes]):
                return False
        return True

    # ------------------------------------------------------------------- ZAP
    def _serve_zap(self) -> None:
        from zmq.utils import z85

        for _ in range(256):
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["zap_requests"] += 1
            # [routing id, empty, version, request id, domain, address, identity, mechanism, credentials...]
            if len(frames) < 9 or frames[1] != b"" or frames[2] != b"1.0":
                if len(frames) >= 4:
                    self._zap_reply(frames[0], frames[3], b"500", b"bad ZAP request", b"")
                continue
            rid, req_domain, address, mechanism, creds = frames[3], frames[4], frames[5], frames[7], frames[8:]
            node = None
            if mechanism == b"CURVE" and len(creds) == 1 and len(creds[0]) == 32 and req_domain == f"a2ad:{self.name}".encode():
                node = self.allowed.get(z85.encode(creds[0]))
            if node is None:
                self.counters["refused_connections"] += 1
                self._ratelog(logging.WARNING, ("zap", address),
                              "domain %s: refused a connection from %s: its key is not one of this domain's nodes "
                              "(a daemon with another domain key or config?)", self.name,
                              address.decode(errors="replace") or "?")
                self._zap_reply(frames[0], rid, b"400", b"not a node of this domain", b"")
            else:
                self._zap_reply(frames[0], rid, b"200", b"OK", node.encode())

    def _zap_reply(self, ident: bytes, rid: bytes, code: bytes, text: bytes, user: bytes) -> None:
        try:
            self.zap.send_multipart([ident, b"", b"1.0", rid, code, text, user, b""], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("domain gate: could not answer a ZAP request: %s", exc)

    def _events(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        from a2ad.daemon.domain import _HANDSHAKE_FAILED

        for _ in range(1024):
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            e, fd = ev["event"], ev["value"]
            if e == zmq.EVENT_ACCEPTED:
                if len(self.conns) >= self.max_conns:
                    self.counters["shed_connections"] += 1
                    self._ratelog(logging.WARNING, "shed",
                                  "domain %s: %d connections to %s already; shutting new ones down (%d so far): "
                                  "a flood of connections that hold no domain key?", self.name, len(self.conns),
                                  self.bind_addr, self.counters["shed_connections"])
                    _shutdown(fd)
                else:
                    self.conns.add(fd)
            elif e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.counters["authenticated"] += 1
            elif e == zmq.EVENT_DISCONNECTED:
                self.conns.discard(fd)
                self._ratelog(logging.INFO, ("disconnect",),
                              "domain %s: a connection to %s closed: its daemon stopped or restarted, it sent a frame "
                              "over the %d-byte socket limit, or it never authenticated", self.name, self.bind_addr,
                              int(self.cfg["max_frame"]))
            elif e in _HANDSHAKE_FAILED:
                if e != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the ZAP handler counted and logged those
                    self.counters["refused_connections"] += 1
                    self._ratelog(logging.WARNING, ("handshake", e),
                                  "domain %s: refused a connection on %s: %s; a daemon with another domain key, or "
                                  "something that is not an a2ad daemon", self.name, self.bind_addr, _HANDSHAKE_FAILED[e])


def _shutdown(fd: int) -> None:
    """End a connection libzmq accepted (shutdown() on a duplicate: libzmq then closes its fd)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    try:
        if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="a2ad-domain-gate")
    p.add_argument("--channel", type=int, required=True)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    from a2ad.daemon.fdbudget import raise_nofile_limit
    from a2ad.daemon.sdnotify import log_handler

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), handlers=[log_handler(sys.stderr)])
    channel = socket.socket(fileno=args.channel)
    channel.set_inheritable(False)
    try:
        cfg = msgpack.unpackb(sys.stdin.buffer.read(), raw=False, strict_map_key=False)
        raise_nofile_limit()
        gate = Gate(cfg, channel)
    except Exception as exc:
        print(f"ERROR bad settings: {exc}", flush=True)
        return 2
    try:
        gate.start()
    except Exception as exc:
        print(f"ERROR {exc}", flush=True)
        gate.close()
        return 1
    print("READY", flush=True)
    sys.stdout.close()
    try:
        gate.run()
    finally:
        gate.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
