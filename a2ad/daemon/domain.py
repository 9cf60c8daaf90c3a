"""A domain of a2ad daemons: the nodes of one multi-node NVLink domain, each running its own
daemon, that know each other from one small config file and talk over ZeroMQ TCP with CURVE.

What lives here (and nothing about jobs: that is core/federation.py; and nothing that decides
from what is heard who is up or lost: that is core/links.py, which this module calls):

- the config file (TOML, read with ``tomllib``): the domain's name and shared key, the
  heartbeat settings, and the nodes with their addresses (docs/DOMAIN.md has the format);
- the keys: every node's CURVE keypair is derived from the shared key, the domain's name and
  the node's name (a keyed BLAKE2b gives the secret key, ``zmq.curve_public`` the public one),
  so every node knows every peer's public key and no key is ever exchanged;
- the link sockets: one ROUTER per daemon that its peers connect to (CURVE server), one
  DEALER per peer (CURVE client, which also authenticates the peer it reaches); messages
  only flow DEALER -> ROUTER, so "who sent this" is the node name that the ZAP handler
  attached to the connection, never a claim inside the message;
- the ROUTER and its ZAP handler (which accepts exactly the public keys of the configured
  nodes other than this one; anything else is refused and logged) live in the domain gate,
  a process of its own (gate.py), so that connections to the port that never authenticate
  spend the gate's fds and never the daemon's; the gate forwards each authenticated message
  with its node name over a private socketpair, read from the daemon's poll loop. A gate
  that dies is started again (with backoff) and the daemon serves on;
- heartbeats, and the state of every peer: ``connecting`` (never heard since this daemon
  started), ``up``, ``down`` (silent for ``heartbeat_interval * heartbeat_misses``); a
  daemon instance of a peer that a newer one replaced and that speaks again means two
  daemons run as that node name: logged, shown in the status, and its messages dropped;
- the message bus: msgpack maps with an envelope, at most MAX_MESSAGE bytes on both ends
  (the socket's own limit leaves room for CURVE's overhead and more, so a larger message is
  logged and dropped here instead of taking the link with it), decoded with limits; a
  message that does not decode or does not fit the envelope is dropped, counted and logged
  (rate-limited) and never reaches the federation.

Every socket is non-blocking and polled by the daemon's loop (:meth:`Domain.sockets`,
:meth:`Domain.service`, :meth:`Domain.tick`, :meth:`Domain.next_deadline`). The federation
registers itself as the handler: ``on_message(node, msg)``, ``on_peer_up(node, restarted)``,
``on_peer_lost(node, why)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import zmq

from a2ad import errors
from a2ad.daemon.core.links import PEER_DOWN, PEER_UP, Link, Links
from a2ad.daemon.core.ratelog import RateLog

log = logging.getLogger("a2ad")

#: Version of the daemon-to-daemon messages (``v`` of every envelope).
DOMAIN_PROTOCOL = 1
#: Largest domain message (its msgpack bytes) a daemon sends or takes: the sender does not send
#: a larger one (logged), the receiver drops a larger one (logged and counted; the link stays).
MAX_MESSAGE = 1 << 20
#: What CURVE adds to every message on the wire (the MESSAGE command's name, its nonce, the
#: box's MAC and the flags byte), which counts against the socket's own size limit.
CURVE_OVERHEAD = 33
#: The receive socket's own limit (ZMQ_MAXMSGSIZE), counting CURVE's overhead. libzmq cuts a
#: connection that carries a larger frame; frames between MAX_MESSAGE and this reach the loop,
#: which logs and drops them, so an oversized message never silently takes the link with it.
MAX_DOMAIN_FRAME = 4 * MAX_MESSAGE + CURVE_OVERHEAD
#: Superseded daemon instances (boot ids) remembered per peer, to tell a restart from two
#: daemons running as one node.
#: Node and domain names: what a config file may use.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ADDRESS_RE = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|\*):([0-9]{1,5})")
MAX_NODES = 256
#: Fewest bytes a shared key must have.
MIN_KEY_BYTES = 32
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_MISSES = 5
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: Messages handled per loop turn and socket before the loop looks at its other sockets.
BATCH = 256
#: Outgoing messages queued per peer link while its connection stands.
LINK_HWM = 4096
#: The message types counted by name (``messages_by_type``); anything else counts as "other".
MESSAGE_TYPES = ("hb", "job", "sync", "decide", "refuse", "refuse_rank", "prepare", "prepared", "release", "destroy")
#: How often a running gate reports (gate.REPORT_EVERY): a longer gap is time in which it did not run.
GATE_REPORT_EVERY = 0.5
#: Seconds the domain gate has to say READY; backoff between restarts of a gate that died.
GATE_START_TIMEOUT = 15.0
#: the most a starting gate's first line (READY, or why not) is read of
GATE_LINE_MAX = 4096
GATE_BACKOFF = (0.5, 30.0)


class DomainConfigError(errors.InvalidField):
    """The domain config file is missing, unreadable, or not valid; the message says where."""


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class NodeConfig:
    name: str
    #: where the peers reach this node: tcp://host:port
    address: str
    #: what this node binds when it is the one running (default: its address)
    bind: str


@dataclass(frozen=True)
class DomainConfig:
    name: str
    key: bytes = field(repr=False)
    nodes: tuple[NodeConfig, ...]
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES
    path: str = ""

    @property
    def loss_bound(self) -> float:
        """Seconds of silence after which a peer is counted as lost."""
        return self.heartbeat_interval * self.heartbeat_misses

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise DomainConfigError(
            f"node {name!r} is not in domain {self.name!r} ({self.path}); its nodes are "
            f"{', '.join(n.name for n in self.nodes)}",
            field="node",
        )

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


def _bad(path, what: str) -> DomainConfigError:
    return DomainConfigError(f"domain config {path}: {what}", field="domain")


def _private(path: Path, what: str, cfg_path) -> None:
    """A file holding the key must be readable by its owner only (like an ssh private key)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise _bad(cfg_path, f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if st.st_mode & 0o077:
        raise _bad(cfg_path, f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: it holds the domain's "
                             f"secret, so it must be readable by its owner only (chmod 600 {path})")


def load_config(path: str | os.PathLike) -> DomainConfig:
    """Read and check a domain config file (TOML). Raises DomainConfigError naming the file and
    what is wrong with it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as a package (a declared dependency there)
        try:
            import tomli as tomllib
        except ImportError:
            raise DomainConfigError("--domain needs tomli on Python 3.10 (pip install tomli)", field="domain") from None
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise _bad(p, f"cannot read it: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise _bad(p, f"not valid TOML: {exc}") from None
    dom = doc.get("domain")
    if not isinstance(dom, dict):
        raise _bad(p, "it needs a [domain] table (name, key_file or key)")
    unknown = set(dom) - {"name", "key", "key_file", "heartbeat_interval", "heartbeat_misses"}
    if unknown:
        raise _bad(p, f"unknown key(s) in [domain]: {', '.join(sorted(unknown))}")
    name = dom.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _bad(p, f"[domain] name must be 1-64 letters, digits and _.- (got {name!r:.80})")
    if ("key" in dom) == ("key_file" in dom):
        raise _bad(p, "[domain] needs exactly one of key_file (a file holding the shared key) or key")
    if "key_file" in dom:
        kf = dom["key_file"]
        if not isinstance(kf, str) or not kf:
            raise _bad(p, "[domain] key_file must be a path")
        kpath = Path(kf) if os.path.isabs(kf) else p.parent / kf
        _private(kpath, "key file", p)
        try:
            key = kpath.read_bytes().strip()
        except OSError as exc:
            raise _bad(p, f"cannot read the key file {kpath}: {exc.strerror or exc}") from None
    else:
        if not isinstance(dom["key"], str):
            raise _bad(p, "[domain] key must be a string")
        _private(p, "config file (it holds the key)", p)
        key = dom["key"].strip().encode()
    if len(key) < MIN_KEY_BYTES:
        raise _bad(p, f"the shared key has {len(key)} bytes; it needs at least {MIN_KEY_BYTES} "
                      "(e.g. `head -c 32 /dev/urandom | base64`)")
    interval = dom.get("heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.01 <= interval <= 60:
        raise _bad(p, f"[domain] heartbeat_interval must be seconds in [0.01, 60] (got {interval!r:.40})")
    misses = dom.get("heartbeat_misses", DEFAULT_HEARTBEAT_MISSES)
    if isinstance(misses, bool) or not isinstance(misses, int) or not 1 <= misses <= 100:
        raise _bad(p, f"[domain] heartbeat_misses must be an integer in [1, 100] (got {misses!r:.40})")
    raw_nodes = doc.get("node")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise _bad(p, "it needs at least one [[node]] table (name, address)")
    if len(raw_nodes) > MAX_NODES:
        raise _bad(p, f"{len(raw_nodes)} nodes; at most {MAX_NODES}")
    nodes, seen_names, seen_addrs = [], set(), set()
    for i, n in enumerate(raw_nodes):
        if not isinstance(n, dict):
            raise _bad(p, f"[[node]] {i + 1} is not a table")
        extra = set(n) - {"name", "address", "bind"}
        if extra:
            raise _bad(p, f"[[node]] {i + 1}: unknown key(s) {', '.join(sorted(extra))}")
        nname, addr = n.get("name"), n.get("address")
        if not isinstance(nname, str) or not NAME_RE.fullmatch(nname):
            raise _bad(p, f"[[node]] {i + 1}: name must be 1-64 letters, digits and _.- (got {nname!r:.80})")
        for label, a in (("address", addr), ("bind", n.get("bind", addr))):
            m = ADDRESS_RE.fullmatch(a) if isinstance(a, str) else None
            if m is None or not 1 <= int(m.group(2)) <= 65535 or (label == "address" and m.group(1) == "*"):
                raise _bad(p, f"node {nname}: {label} must be tcp://HOST:PORT with a port in 1-65535 (got {a!r:.80})")
        if nname in seen_names:
            raise _bad(p, f"node {nname} is listed twice")
        if addr in seen_addrs:
            raise _bad(p, f"address {addr} is listed twice")
        seen_names.add(nname)
        seen_addrs.add(addr)
        nodes.append(NodeConfig(nname, addr, n.get("bind", addr)))
    return DomainConfig(name=name, key=key, nodes=tuple(nodes), heartbeat_interval=float(interval),
                        heartbeat_misses=misses, path=str(p))


# ------------------------------------------------------------------------------------ keys
def _root(key: bytes) -> bytes:
    # BLAKE2b takes keys of at most 64 bytes: the shared key (any length) is hashed first
    return hashlib.blake2b(key, digest_size=64, person=b"a2ad-domain-key").digest()


def node_secret(key: bytes, domain: str, node: str) -> bytes:
    """The 32 bytes of ``node``'s CURVE secret key in ``domain`` (a keyed BLAKE2b of the names)."""
    return hashlib.blake2b(f"{domain}\0{node}".encode(), digest_size=32, key=_root(key),
                           person=b"a2ad-curve-node").digest()


def node_keypair(key: bytes, domain: str, node: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` CURVE keys of ``node``, both Z85-encoded as ZeroMQ takes them."""
    from zmq.utils import z85

    secret = z85.encode(node_secret(key, domain, node))
    return zmq.curve_public(secret), secret


# ------------------------------------------------------------------------------------ peers
@dataclass(eq=False)
class Peer(Link):
    """Another node of the domain: what this daemon knows of it (core/links.py) and the
    sockets it reaches it by."""

    address: str = ""
    public: bytes = b""  # Z85
    dealer: zmq.Socket | None = None
    monitor: zmq.Socket | None = None

    def summary(self, now: float) -> dict:
        return {
            "name": self.name,
            "address": self.address,
            "state": self.state,
            "state_for_s": round(now - self.since, 3),
            "last_heartbeat_age_s": None if self.last_heartbeat is None else round(now - self.last_heartbeat, 3),
            "last_message_age_s": None if self.last_rx is None else round(now - self.last_rx, 3),
            "boot": None if self.boot is None else self.boot.hex(),
            "link_connected": self.connected,
            "name_collision": self.collision is not None,
            "colliding_instance": None if self.collision is None else self.collision.hex(),
            **self.counters,
        }


_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (the other end does not hold this domain's key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by the ZAP handler",
}


class Domain:
    """This daemon's links to the other nodes of its domain (see the module doc)."""

    def __init__(self, config: DomainConfig, node: str, handler=None):
        self.cfg = config
        self.me = config.node(node)
        self.node = node
        self._handler = handler
        self.boot = secrets.token_bytes(8)
        self.public, self._secret = node_keypair(config.key, config.name, node)
        self.peers: dict[str, Peer] = {}
        for n in config.nodes:
            if n.name != node:
                self.peers[n.name] = Peer(n.name, address=n.address,
                                          public=node_keypair(config.key, config.name, n.name)[0])
        #: public key (Z85) -> node name: exactly whom the ZAP handler lets in
        self._allowed = {p.public: p.name for p in self.peers.values()}
        #: who is up, lost, restarted or owed a resync (core/links.py): what is decided from
        #: what this daemon hears
        self.links = Links(config.name, self.peers, config.heartbeat_interval, config.loss_bound, time.monotonic(),
                           handler, receiver_period=GATE_REPORT_EVERY)
        self.ctx: zmq.Context | None = None
        #: the domain gate (gate.py): its process and our end of its socketpair
        self.gate: subprocess.Popen | None = None
        self.channel: socket.socket | None = None
        self._rx = bytearray()
        self.gate_restarts = 0
        self._gate_next_try = 0.0
        self._gate_backoff = GATE_BACKOFF[0]
        #: a gate being started again: (process, our end of its channel, deadline, what it said)
        self._starting: tuple | None = None
        self._gate_counters: dict = {}
        self._gate_base = {"refused_connections": 0, "zap_requests": 0, "shed_connections": 0}
        self.log_level = logging.getLevelName(logging.getLogger("a2ad").getEffectiveLevel()).lower()
        self.counters = {"refused_connections": 0, "bad_messages": 0, "zap_requests": 0}
        #: messages sent to / taken from all peers, by type (heartbeats included)
        self.by_type = {"sent": dict.fromkeys(MESSAGE_TYPES + ("other",), 0),
                        "received": dict.fromkeys(MESSAGE_TYPES + ("other",), 0)}
        self.bytes_by_type = {"sent": dict.fromkeys(MESSAGE_TYPES + ("other",), 0),
                              "received": dict.fromkeys(MESSAGE_TYPES + ("other",), 0)}
        self._next_beat = 0.0
        self._ratelog = RateLog(time.monotonic)

    @property
    def handler(self):
        """Who hears of messages, ups, losses and resyncs (the federation)."""
        return self._handler

    @handler.setter
    def handler(self, h) -> None:
        self._handler = h
        self.links.handler = h

    @property
    def started(self) -> float:
        return self.links.started

    @property
    def stalled_s(self) -> float:
        return self.links.stalled_s

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        """Start the gate (which listens on this node's address) and connect to every peer.
        Raises BackendError (naming the address) when the address cannot be bound."""
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        try:
            self._start_gate()
            for p in self.peers.values():
                self._connect(p)
        except BaseException:
            self.close()
            raise
        # peers can be heard from now on: the time spent before (adopting kept jobs, waiting
        # for the runtime folder's lock, starting the gate) is nobody's silence
        self.links.listening(time.monotonic())
        log.info("domain %s: node %s listening on %s (gate pid %d); peers %s (heartbeat every %g s, lost after %g s)",
                 self.cfg.name, self.node, self.me.bind, self.gate.pid,
                 ", ".join(f"{p.name}={p.address}" for p in self.peers.values()) or "none",
                 self.cfg.heartbeat_interval, self.cfg.loss_bound)

    # ------------------------------------------------------------------- gate
    def _gate_settings(self) -> dict:
        return {"domain": self.cfg.name, "node": self.node, "bind": self.me.bind, "secret": self._secret,
                "public": self.public, "allowed": dict(self._allowed), "max_frame": MAX_DOMAIN_FRAME}

    def _start_gate(self) -> None:
        """Start the gate and wait (bounded) for its READY; raises BackendError with its reason.
        Only at the daemon's start: a restart waits in the loop (``_spawn_gate``)."""
        proc, ours = self._spawn_gate()
        try:
            line = _read_line(proc.stdout, GATE_START_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            _stop(proc)
            ours.close()
            raise errors.BackendError(f"domain {self.cfg.name}: the domain gate did not start: {exc}") from None
        self._gate_said(proc, ours, line)

    def _gate_said(self, proc: subprocess.Popen, ours: socket.socket, line: str) -> None:
        """A starting gate's first line: READY (it listens: it is the gate now) or why not."""
        if line != "READY":
            _stop(proc)
            ours.close()
            why = line[6:] if line.startswith("ERROR ") else f"it said {line!r}"
            raise errors.BackendError(why)
        ours.setblocking(False)
        self.gate, self.channel = proc, ours
        self._rx.clear()

    def _spawn_gate(self) -> tuple[subprocess.Popen, socket.socket]:
        """Start a gate process and hand it its settings; its READY (or error) comes on its stdout."""
        import msgpack as _mp

        from a2ad.runtime import python_command

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                python_command("a2ad.daemon.gate", "--channel", str(theirs.fileno()), "--log-level", self.log_level),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, close_fds=True,
                pass_fds=[theirs.fileno()],
            )
        except OSError as exc:
            ours.close()
            theirs.close()
            raise errors.BackendError(f"domain {self.cfg.name}: could not start the domain gate: {exc}") from None
        theirs.close()
        try:
            proc.stdin.write(_mp.packb(self._gate_settings(), use_bin_type=True))
            proc.stdin.close()
        except OSError as exc:
            _stop(proc)
            ours.close()
            raise errors.BackendError(f"domain {self.cfg.name}: the domain gate did not start: {exc}") from None
        return proc, ours

    def _stop_gate(self) -> None:
        if self._starting is not None:
            proc, ours = self._starting[0], self._starting[1]
            self._starting = None
            _stop(proc)
            ours.close()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.gate is not None:
            _stop(self.gate)
            self.gate = None
        for k in self._gate_base:  # what the dead gate had counted stays counted
            self._gate_base[k] += self._gate_counters.get(k, 0)
        self._gate_counters = {}

    def _check_gate(self, now: float) -> None:
        """A gate that died is started again (after a backoff that doubles while it keeps dying).
        The daemon's loop never waits for it: a starting gate says READY (or why not) on its
        stdout, which the loop polls with its other sockets (``_starting_gate``); it may take
        seconds (the gate retries binding an address still in use)."""
        if self._starting is not None:
            self._starting_gate(now)
            return
        if self.gate is not None and self.gate.poll() is None and self.channel is not None:
            return
        if self.gate is not None:
            log.error("domain %s: the domain gate (pid %d) exited with %s; peers cannot reach this node until "
                      "another one listens on %s", self.cfg.name, self.gate.pid, self.gate.returncode, self.me.bind)
            self._stop_gate()
            self._gate_next_try = now
        if now < self._gate_next_try:
            return
        try:
            proc, ours = self._spawn_gate()
        except errors.BackendError as exc:
            self._gate_failed(now, exc.message)
            return
        os.set_blocking(proc.stdout.fileno(), False)
        self._starting = (proc, ours, now + GATE_START_TIMEOUT, bytearray())

    def _starting_gate(self, now: float) -> None:
        """Read what the gate being started said so far; it is the gate once it says READY."""
        proc, ours, deadline, buf = self._starting
        try:
            while b"\n" not in buf and len(buf) < GATE_LINE_MAX:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                buf += chunk
        except BlockingIOError:
            pass
        except OSError as exc:
            buf += f"(its stdout failed: {exc})\n".encode()
        if b"\n" not in buf:
            if proc.poll() is None and now < deadline and len(buf) < GATE_LINE_MAX:
                return  # not yet: the loop goes on
            why = (f"a first line of more than {GATE_LINE_MAX} bytes" if len(buf) >= GATE_LINE_MAX else
                   f"no answer within {GATE_START_TIMEOUT:g} s" if proc.poll() is None else
                   f"it exited with {proc.returncode} " + (f"saying {bytes(buf).decode(errors='replace')!r}" if buf
                                                           else "without a word"))
            self._starting = None
            _stop(proc)
            ours.close()
            self._gate_failed(now, f"domain {self.cfg.name}: the domain gate did not start: {why}")
            return
        self._starting = None
        line = bytes(buf).split(b"\n", 1)[0].decode(errors="replace").strip()
        proc.stdout.close()
        try:
            self._gate_said(proc, ours, line)
        except errors.BackendError as exc:
            self._gate_failed(now, exc.message)
            return
        self.gate_restarts += 1
        self._gate_backoff = GATE_BACKOFF[0]
        log.warning("domain %s: domain gate started again (pid %d, %d restart(s))", self.cfg.name, self.gate.pid,
                    self.gate_restarts)

    def _gate_failed(self, now: float, why: str) -> None:
        self._gate_next_try = now + self._gate_backoff
        self._gate_backoff = min(self._gate_backoff * 2, GATE_BACKOFF[1])
        log.error("domain %s: could not start the domain gate again: %s (retrying in %.1f s)", self.cfg.name, why,
                  self._gate_next_try - now)

    def _connect(self, p: Peer) -> None:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.IMMEDIATE, 1)  # no queue for a peer that is not connected: sends fail, a resync follows
        d.setsockopt(zmq.SNDHWM, LINK_HWM)
        d.setsockopt(zmq.MAXMSGSIZE, MAX_DOMAIN_FRAME)
        ivl = max(10, int(self.cfg.heartbeat_interval * 250))
        d.setsockopt(zmq.RECONNECT_IVL, ivl)
        d.setsockopt(zmq.RECONNECT_IVL_MAX, max(ivl, int(self.cfg.heartbeat_interval * 1000)))
        d.curve_secretkey = self._secret
        d.curve_publickey = self.public
        d.curve_serverkey = p.public  # the peer must prove it holds its secret key
        p.monitor = d.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        d.connect(p.address)
        p.dealer = d

    def close(self) -> None:
        for p in self.peers.values():
            if p.dealer is not None and p.monitor is not None:
                try:
                    p.dealer.disable_monitor()
                except zmq.ZMQError:
                    pass
            for sock in (p.monitor, p.dealer):
                if sock is not None:
                    sock.close(0)
            p.monitor = p.dealer = None
        self._stop_gate()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    # ------------------------------------------------------------------- poll
    def sockets(self) -> list[zmq.Socket]:
        """What the daemon's poller watches for POLLIN."""
        out: list = [self.channel.fileno()] if self.channel is not None else []  # the poller answers with fd numbers
        if self._starting is not None:
            out.append(self._starting[0].stdout.fileno())  # a starting gate's READY
        out += [p.monitor for p in self.peers.values() if p.monitor is not None]
        return out

    def service(self, ready) -> None:
        """Handle whatever is readable among :meth:`sockets` (``ready``: the poller's events)."""
        for p in self.peers.values():
            if p.monitor is not None and p.monitor in ready:
                self._link_events(p)
        if self.channel is not None and self.channel.fileno() in ready:
            self._receive()
        if self._starting is not None and self._starting[0].stdout.fileno() in ready:
            self._starting_gate(time.monotonic())

    def next_deadline(self) -> float:
        return self._next_beat

    def tick(self, now: float) -> None:
        """Heartbeats, peers that went silent, resyncs owed."""
        if now < self._next_beat:
            return
        self._next_beat = now + self.cfg.heartbeat_interval
        self.links.discount_own_stall(now)
        self._check_gate(now)
        self.links.beat(now, self.send)
        self.links.resyncs()

    def _link_events(self, p: Peer) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(BATCH):
            try:
                ev = recv_monitor_message(p.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            e = ev["event"]
            if e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.links.link_up(p)
            elif e == zmq.EVENT_DISCONNECTED:
                p.connected = False
            elif e in _HANDSHAKE_FAILED:
                p.connected = False
                p.counters["handshake_failures"] += 1
                self._ratelog(logging.WARNING, ("link", p.name),
                              "domain %s: cannot authenticate node %s at %s: %s", self.cfg.name, p.name, p.address,
                              "it does not hold this domain's key for that node" if e != zmq.EVENT_HANDSHAKE_FAILED_AUTH
                              else "it refused this node's key")

    # ------------------------------------------------------------------ the bus
    def send(self, node: str, msg: dict, heartbeat: bool = False) -> bool:
        """Queue one message to ``node`` without blocking; False (and a resync owed) when the
        link cannot take it now."""
        data = self._encode(msg)
        return data is not None and self._send_bytes(self.peers[node], data, msg.get("t"), heartbeat)

    def send_many(self, nodes, msg: dict) -> None:
        """The same message to each of ``nodes``, encoded once (a release table to every node
        of a job costs one encoding, not one per node)."""
        data = self._encode(msg)
        if data is not None:
            for node in nodes:
                self._send_bytes(self.peers[node], data, msg.get("t"), False)

    def _encode(self, msg: dict) -> bytes | None:
        env = {"v": DOMAIN_PROTOCOL, "dom": self.cfg.name, "from": self.node, "boot": self.boot, **msg}
        try:
            data = msgpack.packb(env, use_bin_type=True)
        except Exception as exc:  # a bug: never a crash of the loop
            log.error("domain: could not encode a %r message: %s", msg.get("t"), exc)
            return None
        if len(data) > MAX_MESSAGE:
            log.error("domain: a %r message of %d bytes is over the %d-byte limit; not sent", msg.get("t"), len(data), MAX_MESSAGE)
            return None
        return data

    def _send_bytes(self, p: Peer, data: bytes, t, heartbeat: bool) -> bool:
        try:
            p.dealer.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.links.send_failed(p, heartbeat)
            return False
        p.counters["heartbeats_sent" if heartbeat else "messages_sent"] += 1
        t = t if t in MESSAGE_TYPES else "other"
        self.by_type["sent"][t] += 1
        self.bytes_by_type["sent"][t] += len(data)
        return True

    def broadcast(self, msg: dict) -> None:
        for name, p in self.peers.items():
            if p.state != PEER_DOWN or p.connected:
                self.send(name, msg)

    def _receive(self) -> None:
        """Read what the gate forwarded: frames of ``[kind, ...]`` (gate.py)."""
        import struct

        for _ in range(BATCH):
            try:
                chunk = self.channel.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:  # the gate is gone; the next tick starts another
                self._stop_gate_channel()
                break
            self._rx += chunk
        while len(self._rx) >= 4:
            (n,) = struct.unpack(">I", self._rx[:4])
            if n > MAX_DOMAIN_FRAME + 4096:
                log.error("domain %s: the domain gate sent a frame of %d bytes; restarting it", self.cfg.name, n)
                self._stop_gate_channel()
                return
            if len(self._rx) < 4 + n:
                return
            raw = bytes(self._rx[4 : 4 + n])
            del self._rx[: 4 + n]
            try:
                item = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                kind = item[0]
            except Exception:
                continue
            if kind == "m" and len(item) == 3:
                self._on_frame(item[1], item[2])
            elif kind == "s" and len(item) in (2, 3) and isinstance(item[1], dict):
                self._gate_counters = item[1]
                if len(item) == 3 and isinstance(item[2], float):
                    self.links.receiver_ran(item[2])  # (the gate's time: this daemon's stalls are not its)
                for k in ("refused_connections", "zap_requests"):
                    self.counters[k] = self._gate_base[k] + int(item[1].get(k, 0))
            elif kind == "l" and len(item) == 3 and isinstance(item[1], int) and isinstance(item[2], str):
                log.log(item[1], "%s", item[2][:2000])

    def _stop_gate_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._rx.clear()

    def _on_frame(self, node: str, data: bytes | None) -> None:
        """One message the gate received on ``node``'s authenticated connection (``None``: a
        message that was not exactly one frame)."""
        p = self.peers.get(node) if isinstance(node, str) else None
        if p is None:  # cannot happen past the ZAP handler; dropped all the same
            self.counters["bad_messages"] += 1
            return
        if not isinstance(data, bytes):
            self._bad(p, "not exactly one frame")
            return
        if len(data) > MAX_MESSAGE:
            self._bad(p, f"a frame of {len(data)} bytes, over the {MAX_MESSAGE}-byte cap of a domain message "
                         "(the link stays)")
            return
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_MESSAGE,
                                  max_bin_len=MAX_MESSAGE, max_array_len=1 << 16, max_map_len=1 << 16)
        except Exception as exc:
            self._bad(p, f"undecodable ({type(exc).__name__})")
            return
        why = _envelope_problem(msg, self.cfg.name, node)
        if why:
            self._bad(p, why)
            return
        if not self.links.heard(p, msg["boot"], msg["t"], time.monotonic()):
            return
        t = msg["t"]
        kind = t if t in MESSAGE_TYPES else "other"
        self.by_type["received"][kind] += 1
        self.bytes_by_type["received"][kind] += len(data)
        if t == "hb":
            p.counters["heartbeats_received"] += 1
            if not self.links.their_losses(p, msg.get("lost", 0)):
                self._bad(p, "a heartbeat with a bad loss count")
            return
        p.counters["messages_received"] += 1
        if self.handler is not None:
            try:
                self.handler.on_message(node, msg)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, errors.A2ADError) as exc:
                self._bad(p, f"a {msg['t']!r} message the daemon could not use ({type(exc).__name__}: {exc})")

    def _bad(self, p: Peer, why: str) -> None:
        p.counters["bad_messages"] += 1
        self.counters["bad_messages"] += 1
        self._ratelog(logging.WARNING, ("bad", p.name), "domain %s: dropped a message from node %s: %s",
                      self.cfg.name, p.name, why)

    # ----------------------------------------------------------------- status
    def state(self, node: str) -> str:
        return PEER_UP if node == self.node else self.peers[node].state

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "domain": self.cfg.name,
            "node": self.node,
            "address": self.me.address,
            "config": self.cfg.path,
            "heartbeat_interval_s": self.cfg.heartbeat_interval,
            "heartbeat_misses": self.cfg.heartbeat_misses,
            "loss_bound_s": self.cfg.loss_bound,
            "stalled_s": round(self.links.stalled_s, 3),
            "gate_stalled_s": round(self.links.deaf_s, 3),
            "boot": self.boot.hex(),
            "nodes": [{"name": self.node, "address": self.me.address, "state": "self", "state_for_s": round(now - self.links.started, 3)}]
            + [p.summary(now) for p in self.peers.values()],
            "name_collisions": sorted(p.name for p in self.peers.values() if p.collision is not None),
            "messages_by_type": {k: dict(v) for k, v in self.by_type.items()},
            "bytes_by_type": {k: dict(v) for k, v in self.bytes_by_type.items()},
            **self.counters,
            "gate": {
                "pid": self.gate.pid if self.gate is not None else None,
                "restarts": self.gate_restarts,
                "shed_connections": self._gate_base["shed_connections"] + int(self._gate_counters.get("shed_connections", 0)),
                "connections": int(self._gate_counters.get("connections", 0)),
            },
        }


def _envelope_problem(msg, domain: str, node: str) -> str | None:
    """Why a decoded message is not a version-1 domain message from ``node``, or None."""
    if not isinstance(msg, dict):
        return "not a map"
    if msg.get("v") != DOMAIN_PROTOCOL:
        return f"domain protocol version {msg.get('v')!r:.20}, this daemon speaks {DOMAIN_PROTOCOL}"
    if msg.get("dom") != domain:
        return f"for domain {msg.get('dom')!r:.70}"
    if msg.get("from") != node:
        return f"claims to come from {msg.get('from')!r:.70}"
    boot = msg.get("boot")
    if not isinstance(boot, bytes) or len(boot) != 8:
        return "no daemon instance id"
    if not isinstance(msg.get("t"), str):
        return "no message type"
    return None


def _read_line(f, timeout: float) -> str:
    """One line from a child's stdout within ``timeout`` seconds (poll, never select())."""
    fd = f.fileno()
    buf = b""
    end = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:g} s")
            if sel.select(left):
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
    f.close()
    return buf.split(b"\n", 1)[0].decode(errors="replace").strip() if buf else "(exited without a word)"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for f in (proc.stdin, proc.stdout):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass
