"""The a2ad daemon's server: bind the runtime folder, run one poll loop over the ZeroMQ
ROUTER (requests), the fd socket (handles and leases), the pidfds of joining ranks, the
metrics port and timers, and stop (keeping jobs for the next daemon) or hand over to a
successor.

The rooms: everything the daemon decides is the core's (core/: the registry, its jobs, leases,
loss policy and mirror, the domain federation and links), a state machine that reads no clock
and does no I/O; this module and the others around it are its adapters. Requests are decoded
and authorized in commands.py, which calls the registry; the fd socket is fdsock.py; who may
do what is auth.py; the state file is persist.py and the fds that outlive the daemon are in
fdstore.py; pidfds, closing fds and control blocks are hostio.py's. Every event reaches the
core through ``_guard``, which gives it the time (``Registry.now``), then carries out what it
decided (``_deliver``). In a domain (``--domain``), the sockets to the other nodes' daemons
and the gate are domain.py; the jobs that span nodes are core/federation.py. Nothing here is
on the data path.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from a2ad import __version__, errors, fdpass, protocol, runtime
from a2ad.daemon import metrics, persist, sdnotify, upgrade
from a2ad.daemon.auth import Auth, Peer
from a2ad.daemon.backends import make_backend
from a2ad.daemon.backends.base import Backend, default_limits
from a2ad.daemon.fdbudget import FdBudget, count_fds, raise_nofile_limit
from a2ad.daemon.fdsock import DEFAULT_HANDSHAKES_PER_UID, FdSocket
from a2ad.daemon.fdstore import FdStore, NullStore, make_store
from a2ad.daemon.core.registry import Job, Limits, Registry
from a2ad.daemon.hostio import RealHost

log = logging.getLogger("a2ad")

#: The daemon caps every client's rendezvous timeout at this many seconds by default.
DEFAULT_MAX_RENDEZVOUS = 600.0
#: Requests handled per loop iteration before the loop looks at its other sockets and timers.
REQUEST_BATCH = 256
#: Replies queued per ZeroMQ peer; past it, replies to a peer that does not read are dropped.
SNDHWM = 64
RCVHWM = 256
#: ctl.sock's listen backlog: connections wait there, holding no fd of the daemon, until
#: libzmq accepts them.
CTL_BACKLOG = 64
#: Milliseconds a ctl.sock connection has to complete its ZeroMQ handshake.
CTL_HANDSHAKE_MS = 5000


@dataclass
class Config:
    runtime_dir: Path
    backend: str = "auto"
    group: str | None = None
    grace: float = 30.0
    max_rendezvous_timeout: float = DEFAULT_MAX_RENDEZVOUS
    #: None: derived from the machine (see backends.base.default_limits)
    max_job_bytes: int | None = None
    max_total_bytes: int | None = None
    allow_uids: set[int] = field(default_factory=set)
    allow_gids: set[int] = field(default_factory=set)
    #: members of this group administer the daemon (drain, upgrade, shutdown, every job)
    admin_group: str | None = None
    #: serve GET /metrics on 127.0.0.1:PORT from the poll loop (None: off)
    metrics_port: int | None = None
    #: name jobs in the HTTP /metrics series (anyone on the node can read that port)
    metrics_job_names: bool = False
    #: auto | systemd | keeper | none: where workspace fds survive a daemon restart
    fd_store: str = "auto"
    #: Seconds the fd keeper keeps a job once no daemon is connected and no rank attached
    #: (None: the keeper's default, keeper.DEFAULT_LINGER).
    keeper_linger: float | None = None
    #: Wait for the previous daemon to hand over the runtime folder (upgrade successor).
    takeover: bool = False
    #: The `a2ad serve` arguments, so that an upgrade can start a successor just like us.
    argv: list[str] = field(default_factory=list)
    max_held_joins_per_uid: int = 256
    #: what one uid's jobs may hold at once (admins are not capped); None: the default
    max_jobs_per_uid: int = 256
    #: None: half the open-file limit
    max_fds_per_uid: int | None = None
    #: None: half the per-daemon memory limit
    max_bytes_per_uid: int | None = None
    max_handshakes_per_uid: int = DEFAULT_HANDSHAKES_PER_UID
    #: every rank of an attached job keeps its ctl.sock connection: an ep_size 256 job plus room
    max_zmq_peers_per_uid: int = DEFAULT_HANDSHAKES_PER_UID
    #: The domain config file (TOML) of a multi-node NVLink domain, and this node's name in it.
    domain: str | None = None
    node: str | None = None


class Daemon:
    def __init__(self, config: Config, backend: Backend | None = None):
        self.cfg = config
        self.backend = backend or make_backend(config.backend)
        job_limit, total_limit = default_limits(self.backend)
        if config.max_total_bytes is None:
            config.max_total_bytes = total_limit
        if config.max_job_bytes is None:
            config.max_job_bytes = min(job_limit, config.max_total_bytes)
        if config.max_bytes_per_uid is None:
            config.max_bytes_per_uid = max(1, config.max_total_bytes // 2)
        self.started = time.monotonic()
        self.stopping = False
        self.free_on_stop = False
        #: set by a successful upgrade: leave every job to the successor
        self.handover = False
        self.notifier = sdnotify.Notifier()
        self.metrics_http: metrics.MetricsHTTP | None = None
        self.rendezvous_hist = metrics.LatencyHistogram()
        self.auth = Auth(config.allow_uids, config.allow_gids)
        self.store: FdStore = NullStore()
        self.registry = Registry(self.backend, self.store, self.auth, Limits(
            grace=config.grace, max_rendezvous_timeout=config.max_rendezvous_timeout,
            max_job_bytes=config.max_job_bytes, max_total_bytes=config.max_total_bytes,
            max_held_joins_per_uid=config.max_held_joins_per_uid, max_jobs_per_uid=config.max_jobs_per_uid,
            max_bytes_per_uid=config.max_bytes_per_uid,
        ), RealHost())
        self.registry.on_rendezvous = self.rendezvous_hist.observe
        self.registry.fd_budget = self._charge_fds
        self.state = persist.StateWriter(config.runtime_dir, reserve=True)
        self._ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.fdsock: FdSocket | None = None
        self.lock: runtime.Lock | None = None
        self._wake_r = self._wake_w = None
        self._bound: list[str] = []
        #: fd of each ZeroMQ connection -> (the uid at its other end, whether it is an admin)
        self.zpeers: dict[int, tuple[int, bool]] = {}
        self.zpeer_counts: dict[int, int] = {}
        self.zpeers_nonadmin = 0
        self.zpeers_refused = 0
        self.ctl_paused = False
        self.ctl_pauses = 0
        self._sock_mode = 0o600
        self._sock_gid: int | None = None
        self.nofile = raise_nofile_limit()
        self.fds = FdBudget(self.nofile[0])
        if config.max_fds_per_uid is None:
            config.max_fds_per_uid = max(1, self.nofile[0] // 2)
        self.registry.limits.max_fds_per_uid = config.max_fds_per_uid
        self._next_store_check = 0.0
        self.domain = self.fed = None
        if config.domain is not None:
            self._setup_domain(config)

    def _setup_domain(self, config: Config) -> None:
        from a2ad.daemon.domain import Domain, load_config
        from a2ad.daemon.core.federation import Federation

        dcfg = load_config(config.domain)
        node = config.node
        if node is None:
            host = socket.gethostname().split(".")[0]
            if host not in dcfg.names:
                raise errors.InvalidField(
                    f"this host ({host}) is not a node of domain {dcfg.name} ({dcfg.path}: {', '.join(dcfg.names)}); "
                    "pass --node NAME", field="node")
            node = host
        self.domain = Domain(dcfg, node)
        self.backend.enable_fabric()
        self.fed = Federation(self.registry, self.domain, self.backend.name)

    # ------------------------------------------------------- views for metrics
    @property
    def jobs(self) -> dict[str, Job]:
        return self.registry.jobs

    @property
    def counters(self) -> dict[str, int]:
        return self.registry.counters

    @property
    def draining(self) -> bool:
        return self.registry.draining

    @property
    def conns(self) -> dict:
        return self.fdsock.conns if self.fdsock is not None else {}

    @property
    def rendezvous_latencies(self) -> list[float]:
        return self.registry.rendezvous_latencies

    def _released_mapped(self) -> dict:
        return self.registry.released_mapped()

    # ------------------------------------------------------------------ setup
    def bind(self) -> None:
        """Take the runtime folder and start serving it. On any failure nothing is left
        behind: no lock, no sockets, no half-adopted jobs (the fds stay in the store)."""
        rd = self.cfg.runtime_dir
        # an open-file limit too low to serve: refuse now, rather than serve and go deaf
        self.fds.check_startable(peers=len(self.domain.peers) if self.domain is not None else 0)
        if self.cfg.allow_uids - {os.getuid(), 0} and self.cfg.group is None:
            raise errors.InvalidField(
                "--allow-uid needs --group: without a group the runtime folder is private (mode 0700), so "
                f"uid(s) {sorted(self.cfg.allow_uids - {os.getuid(), 0})} could not reach its sockets; "
                "put those users in a group and pass --group NAME (members are allowed)",
                field="allow_uid",
            )
        gid = runtime.prepare(rd, self.cfg.group)
        if gid is not None:
            self.auth.allowed_gids.add(gid)
        if self.cfg.admin_group is not None:
            import grp

            try:
                self.auth.admin_gids.add(grp.getgrnam(self.cfg.admin_group).gr_gid)
            except KeyError:
                raise errors.InvalidField(f"admin group {self.cfg.admin_group!r} does not exist", field="admin_group") from None
        from a2ad.daemon.keeper import LINGER_ENV, parse_linger

        if self.cfg.keeper_linger is not None:
            os.environ[LINGER_ENV] = repr(parse_linger(self.cfg.keeper_linger))  # every keeper we start inherits it
        elif LINGER_ENV in os.environ:
            try:
                parse_linger(os.environ[LINGER_ENV])
            except ValueError as exc:
                raise errors.InvalidField(f"${LINGER_ENV}: {exc}", field="keeper_linger") from None
        handover = upgrade.handover_socket()
        self.lock = None if handover is not None else self._take_lock(rd, wait=self.cfg.takeover)
        store_held = True  # until the store is known to hold nothing, a failure leaves it be
        try:
            self.store = make_store(self.cfg.fd_store, rd)
            self.registry.store = self.store
            if handover is not None:
                upgrade.receive_handover(self, handover)  # returns once the predecessor let go of the folder
                self.lock = self._take_lock(rd, wait=True)
            else:
                kept = self.store.load()
                store_held = bool(kept)
                self._adopt(kept, persist.load(rd))
            self._bind_sockets(rd, gid)
        except BaseException:
            self._unbind()
            for job in list(self.registry.jobs.values()):
                self.registry.release_handles(job)
            self.registry.jobs.clear()
            self.store.close(clean=not store_held)  # a keeper that holds nothing goes too
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            raise
        log.info(
            "a2ad %s serving %s (backend %s, fd store %s, pid %d, open-file limit %d, %d kept in reserve)",
            __version__, rd, self.backend.name, self.store.kind, os.getpid(), self.nofile[0], self.fds.reserve,
        )
        self.notifier.ready(self)

    def _bind_sockets(self, rd: Path, gid: int | None) -> None:
        for name in (runtime.CTL_SOCK, runtime.FD_SOCK):
            try:
                (rd / name).unlink()
            except FileNotFoundError:
                pass
        self._sock_mode = 0o660 if gid is not None else 0o600
        self._sock_gid = gid
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)
        self.router.setsockopt(zmq.SNDHWM, SNDHWM)
        self.router.setsockopt(zmq.RCVHWM, RCVHWM)
        self.router.setsockopt(zmq.BACKLOG, CTL_BACKLOG)
        # a connection that has not sent its ZeroMQ greeting within this is closed (libzmq's
        # default is 30 s of an fd held for nothing)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, CTL_HANDSHAKE_MS)
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self._bind_ctl()
        self._bound.append(runtime.CTL_SOCK)
        old_umask = os.umask(0o777 & ~self._sock_mode)
        try:
            self.fdsock = FdSocket(str(rd / runtime.FD_SOCK), self.registry, self.cfg.max_handshakes_per_uid,
                                   fd_ceiling=self.fds.ceiling)
            self._bound.append(runtime.FD_SOCK)
        finally:
            os.umask(old_umask)
        if gid is not None:
            os.chown(rd / runtime.FD_SOCK, -1, gid, follow_symlinks=False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        if self.cfg.metrics_port is not None:
            self.metrics_http = metrics.MetricsHTTP(self, self.cfg.metrics_port)
            log.info("metrics on http://%s:%d/metrics", *self.metrics_http.address)
        if self.domain is not None:
            self.domain.start()  # after adoption: the first reports already hold the adopted jobs

    def _bind_ctl(self) -> None:
        rd = self.cfg.runtime_dir
        old_umask = os.umask(0o777 & ~self._sock_mode)
        try:
            self.router.bind(runtime.ctl_endpoint(rd))
        finally:
            os.umask(old_umask)
        if self._sock_gid is not None:
            os.chown(rd / runtime.CTL_SOCK, -1, self._sock_gid, follow_symlinks=False)

    def _pause_ctl(self, fd: int) -> None:
        """Stop listening on ctl.sock until the daemon is well below its open-file limit."""
        if self.ctl_paused:
            return
        self.ctl_paused = True
        self.ctl_pauses += 1
        try:
            self.router.unbind(runtime.ctl_endpoint(self.cfg.runtime_dir))
        except zmq.ZMQError as exc:
            log.error("could not stop listening on ctl.sock: %s", exc)
        self._clear_zpeers()  # libzmq ends the connections it accepted on that endpoint
        log.error("open files at %d of %d: not listening on ctl.sock until fewer are open (%d time(s) so far)",
                  fd + 1, self.nofile[0], self.ctl_pauses)

    def _maybe_resume_ctl(self) -> None:
        if not self.ctl_paused or not self.fds.may_resume():
            return
        try:
            self._bind_ctl()
        except (zmq.ZMQError, OSError) as exc:
            log.error("could not listen on ctl.sock again: %s", exc)
            return
        self.ctl_paused = False
        log.info("listening on ctl.sock again (%d open files)", count_fds())

    def _unbind(self) -> None:
        if self.domain is not None:
            self.domain.close()
        if self.metrics_http is not None:
            self.metrics_http.close()
            self.metrics_http = None
        if self.fdsock is not None:
            self.fdsock.shutdown()
            self.fdsock = None
        if self.monitor is not None:
            self.router.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        if self.router is not None:
            self.router.close(0)
            self.router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for name in self._bound:
            try:
                (self.cfg.runtime_dir / name).unlink()
            except FileNotFoundError:
                pass
        self._bound = []
        if self._wake_r is not None:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
            self._wake_r.close()
            self._wake_w.close()
            self._wake_r = self._wake_w = None

    def _take_lock(self, rd: Path, wait: bool) -> runtime.Lock:
        end = time.monotonic() + (30.0 if wait else 0.0)
        while True:
            try:
                return runtime.Lock(rd)
            except runtime.RuntimeDirError:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.02)

    def request_stop(self, free_jobs: bool = False) -> None:
        self.free_on_stop = free_jobs
        self.stopping = True

    def install_signal_handlers(self) -> None:
        def stop(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

    def _charge_fds(self, needed: int) -> None:
        """Refuse work that would take the daemon into its fd reserve (fdbudget.py)."""
        try:
            self.fds.charge(needed)
        except errors.LimitExceeded:
            self.registry.counters["refused"] += 1
            raise

    def keep_accounting(self) -> None:
        """Count (and cap) ctl.sock connections now: called from waits outside the loop."""
        if self.monitor is not None:
            try:
                self._on_monitor()
            except Exception:
                log.exception("internal error in peer accounting (the daemon keeps serving)")

    # ------------------------------------------------------------------- loop
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.fdsock.fileno(), zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self.metrics_http is not None:
            poller.register(self.metrics_http.fileno(), zmq.POLLIN)
        registered: set[int] = set()
        domain_socks: list = []
        while not self.stopping:
            # keep the poller in step with the live connections and pidfds
            want = set(self.fdsock.conns) | set(self.registry.pidfds)
            for fd in registered - want:
                poller.unregister(fd)
            for fd in want - registered:
                poller.register(fd, zmq.POLLIN)
            registered = want
            if self.domain is not None:  # and with the domain's (the gate's channel changes when it restarts)
                now_socks = self.domain.sockets()
                if now_socks != domain_socks:
                    for sock in domain_socks:
                        poller.unregister(sock)
                    for sock in now_socks:
                        poller.register(sock, zmq.POLLIN)
                    domain_socks = now_socks
            nxt = self._next_deadline()
            timeout_ms = 1000 if nxt is None else max(0, min(1000, int((nxt - time.monotonic()) * 1000) + 1))
            events = dict(poller.poll(self.notifier.poll_timeout_ms(timeout_ms)))
            if self._wake_r.fileno() in events:
                try:
                    while self._wake_r.recv(64):
                        pass
                except BlockingIOError:
                    pass
            if self.monitor in events:
                self._guard("peer accounting", self._on_monitor)
            if self.router in events:
                self._guard("requests", self._drain_router)
            if domain_socks and any(sock in events for sock in domain_socks):
                self._guard("domain", self.domain.service, events)
            if self.fdsock.fileno() in events:
                self._guard("fd socket accept", self.fdsock.accept)
            for fd in events:
                if fd in self.fdsock.conns:
                    self._guard("fd socket connection", self.fdsock.readable, fd)
                elif fd in self.registry.pidfds:
                    self._guard("pidfd", self.registry.pid_exited, fd)
            if self.metrics_http is not None:
                self._guard("metrics", self.metrics_http.service)
            self._guard("timers", self._run_timers)
            self._flush()
            self.notifier.tick(self)

    def _guard(self, what: str, fn, *args) -> None:
        """Run one event handler; a bug in it is logged and costs that event only. The core
        decides on the clock it is given: the time of this event."""
        self.registry.now = time.monotonic()
        try:
            fn(*args)
        except Exception:
            log.exception("internal error in %s (the daemon keeps serving)", what)
        self._deliver()

    def _deliver(self) -> None:
        """Carry out what the registry decided: the domain's reports and rendezvous steps, then
        the state file when there are replies to send, then the replies and lease connections
        to close. No reply leaves before the state it reflects is written: a daemon killed
        right after answering must not come back without what it answered (a job, a
        generation). Without replies the write waits for the end of the loop's turn
        (``_flush``): a turn's redeems are one write. (The federation reads the registry's
        change flag, which writing the state file clears: it goes first.)"""
        if self.fed is not None:
            try:
                self.fed.flush()
            except Exception:
                log.exception("internal error in the domain federation (the daemon keeps serving)")
        if self.registry.outbox:
            self._persist()  # (without replies to send it waits for the end of the loop's turn: one write)
        outbox, self.registry.outbox = self.registry.outbox, []
        for identity, data in outbox:
            self._send(identity, data)
        if self.fdsock is not None:
            self.fdsock.close_pending()

    def _flush(self) -> None:
        """What the registry decided, and then the state file again for what delivering it
        changed (a lease closed, say); then the handles of the turn's redeems, which the state
        file now records as attached (and the state file again for what sending them changed).
        After a hand-over they are not sent: their clients join again at the successor."""
        self._deliver()
        self._persist()
        if self.fdsock is not None and self.fdsock.ready:
            if self.handover:
                self.fdsock.drop_ready()
                return
            self._guard("fd socket answers", self.fdsock.send_ready)
            self._persist()

    def _persist(self) -> None:
        """Write the state file if the registry changed it (a failing disk backs off: the
        state is kept in memory, and a reply is not held back for it). Once the jobs are
        handed to a successor, the state file is the successor's."""
        if self.handover:
            return
        if self.registry.dirty:
            self.registry.dirty = False
            self.state.mark_dirty()
        self.state.flush(self._state_records, self.backend.name, time.monotonic())

    def _write_state_now(self) -> None:
        self.state.mark_dirty()
        self.state.flush(self._state_records, self.backend.name, time.monotonic(), force=True)

    def _state_records(self) -> list[dict]:
        return [persist.job_record(j) for j in self.registry.jobs.values()]

    def _next_deadline(self) -> float | None:
        retry = self.state.retry_in if self.state.dirty else None
        times = [t for t in (self.registry.next_deadline(), self.fdsock.next_deadline(),
                             None if retry is None else time.monotonic() + retry,
                             self.domain.next_deadline() if self.domain is not None else None,
                             self.fed.next_deadline() if self.fed is not None else None) if t is not None]
        return min(times) if times else None

    def _run_timers(self) -> None:
        now = time.monotonic()
        self.registry.expire(now)
        self.fdsock.expire(now)
        if self.domain is not None:
            self.domain.tick(now)
            self.fed.tick(now)
        if now >= self._next_store_check:
            self._next_store_check = now + 1.0
            self._maybe_resume_ctl()
            check = getattr(self.store, "check", None)
            if check is not None:
                check(self.registry.all_fds)

    # --------------------------------------------------------------- requests
    def _drain_router(self) -> None:
        from a2ad.daemon.commands import handle

        for _ in range(REQUEST_BATCH):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) != 2:
                self.registry.counters["bad_requests"] += 1
                self._send(identity, protocol.encode_error(-1, errors.BadMessage("a request is exactly one frame")))
                continue
            self.registry.now = time.monotonic()
            reply = handle(self, identity, frames[1].bytes, _zmq_peer(frames[1]))
            if reply is not None:
                # in the outbox with the registry's own replies: it goes out once the state it
                # reflects is written, with the rest of the batch (one write for the batch)
                self.registry.outbox.append((identity, reply))
            self.notifier.tick(self)

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            self.router.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out on its side
            log.debug("could not reply to a client: %s", exc)

    def _on_monitor(self) -> None:
        """Count ZeroMQ connections per uid; past the cap a new one is shut down at once (its
        fd is libzmq's: shutdown() on a duplicate ends the connection, libzmq closes it)."""
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(1024):
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = msg["event"], msg["value"]
            if event == zmq.EVENT_ACCEPTED:
                if self.fds.should_pause(fd):
                    self._pause_ctl(fd)
                    continue
                if self.ctl_paused:
                    continue
                try:
                    dupfd = os.dup(fd)
                except OSError:
                    continue
                try:
                    dup = socket.socket(fileno=dupfd)
                except OSError:  # the number was reused by something else already: not ours to judge
                    os.close(dupfd)
                    continue
                try:
                    if dup.family != socket.AF_UNIX or dup.getsockname() != str(self.cfg.runtime_dir / runtime.CTL_SOCK):
                        continue  # the connection closed and its number went to another socket
                    _, uid, gid = fdpass.peer_credentials(dup)
                    admin = self.auth.is_admin(Peer(uid, gid, None))
                    count = self.zpeer_counts.get(uid, 0)
                    capped = None if admin else (
                        f"uid {uid} has {count} connections to ctl.sock (limit {self.cfg.max_zmq_peers_per_uid})"
                        if count >= self.cfg.max_zmq_peers_per_uid else
                        f"non-admin uids hold {self.zpeers_nonadmin} connections to ctl.sock in all "
                        f"(limit {self.fds.ctl_total}, from the open-file limit)"
                        if self.zpeers_nonadmin >= self.fds.ctl_total else None)
                    if capped is not None:
                        self.zpeers_refused += 1
                        if self.zpeers_refused == 1 or self.zpeers_refused % 100 == 0:
                            log.warning("%s; refusing more (%d so far)", capped, self.zpeers_refused)
                        dup.shutdown(socket.SHUT_RDWR)
                    else:
                        self._add_zpeer(fd, uid, admin)
                except OSError:
                    pass
                finally:
                    dup.close()
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self._drop_zpeer(fd)

    def _add_zpeer(self, fd: int, uid: int, admin: bool) -> None:
        self._drop_zpeer(fd)  # a number reused before its close was seen
        self.zpeers[fd] = (uid, admin)
        self.zpeer_counts[uid] = self.zpeer_counts.get(uid, 0) + 1
        self.zpeers_nonadmin += not admin

    def _drop_zpeer(self, fd: int) -> None:
        got = self.zpeers.pop(fd, None)
        if got is None:
            return
        uid, admin = got
        left = self.zpeer_counts.get(uid, 1) - 1
        if left > 0:
            self.zpeer_counts[uid] = left
        else:
            self.zpeer_counts.pop(uid, None)
        self.zpeers_nonadmin -= not admin

    def _clear_zpeers(self) -> None:
        self.zpeers.clear()
        self.zpeer_counts.clear()
        self.zpeers_nonadmin = 0

    # ---------------------------------------------------------------- adoption
    def _adopt(self, fds: dict[str, int], state: dict | None) -> None:
        self.registry.now = time.monotonic()
        self.registry.adopt_state(state, fds)

    # ----------------------------------------------------------------- upgrade
    def upgrade(self) -> dict:
        """Start a successor daemon and hand it every job (upgrade.py)."""
        return upgrade.upgrade(self)

    # --------------------------------------------------------------- teardown
    def shutdown(self, fatal: bool = False) -> None:
        """Stop. Jobs with attached ranks are kept for the next daemon (state file plus fd
        store); jobs without any are freed, their held joins left unanswered (they die with
        the daemon and are asked of the next one, which makes the job anew). ``shutdown
        --free-jobs`` frees every job and ends held joins with JobDestroyed; an upgrade hands
        everything to the successor; a fatal error frees nothing."""
        self.notifier.stopping(self)
        reg = self.registry
        reg.now = time.monotonic()
        log.info("shutting down%s", " after a fatal error" if fatal else "")
        if self.handover:
            log.info("handing %d job(s) over to the successor", len(reg.jobs))
        else:
            if self.free_on_stop or not fatal:  # (a fatal error frees nothing it was not asked to)
                reg.stop(free_jobs=self.free_on_stop)
            if reg.jobs:
                log.info("stopping: %d job(s) kept for the next daemon: %s",
                         len(reg.jobs), ", ".join(sorted(reg.jobs)[:20]))
                self._log_kept(list(reg.jobs.values()))
            self._flush()
        if reg.jobs and not self.handover:
            self._write_state_now()
        elif not reg.jobs:
            self.state.remove()  # nothing is left to re-adopt
        self._deliver()
        self._unbind()
        kept = bool(reg.jobs)
        for job in list(reg.jobs.values()):  # close our copies only; the store keeps theirs
            reg.release_handles(job)
        if not kept:
            self.backend.close()
        self.store.close(clean=not kept and not self.handover)
        if self.lock is not None:
            self.lock.release()
        log.info("stopped")

    def _log_kept(self, jobs: list[Job]) -> None:
        """Say who holds the kept jobs' memory now the daemon goes, and how to free it."""
        nbytes = sum(j.job_bytes for j in jobs)
        what = f"{len(jobs)} job(s), {nbytes} bytes"
        kind = self.store.kind
        if kind == "keeper":
            pid, linger = _keeper_info(self.cfg.runtime_dir)
            who = f"the fd keeper (pid {pid})" if pid else f"the fd keeper at {self.cfg.runtime_dir / 'keeper.sock'}"
            log.warning(
                "stopping: %s holds %s for the next daemon on %s; if none comes back it frees each job %s after "
                "its last rank is gone (--keeper-linger); to free them now: start a2ad serve and run a2ad-ctl shutdown "
                "--free-jobs, or %s", who, what, self.cfg.runtime_dir,
                f"{linger:g} s" if isinstance(linger, (int, float)) else "some time",
                f"kill {pid}" if pid else "kill the keeper",
            )
        elif kind == "systemd":
            log.warning(
                "stopping: systemd's fd store holds %s for the next start of the unit; to free them now: "
                "start it and run a2ad-ctl shutdown --free-jobs (or systemctl clean --what=fdstore on systemd 254+)", what)
        else:
            log.warning("stopping with --fd-store none: %s are held by no one once this daemon exits; their ranks "
                        "get JobDestroyed at their next call and their memory is freed when they close it", what)

    # ----------------------------------------------------------------- status
    def status(self, peer: Peer | None = None) -> dict:
        peer = peer or Peer(None, None, None)
        now = time.monotonic()
        lat = sorted(self.registry.rendezvous_latencies)
        admin = self.auth.is_admin(peer)
        jobs = self.registry.visible_jobs(peer)
        store_state = getattr(self.store, "state", "ok")
        return {
            "version": __version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started, 3),
            "runtime_dir": str(self.cfg.runtime_dir),
            "backend": self.backend.describe(),
            "draining": self.registry.draining,
            "admin": admin,
            "jobs": [j.summary(now, show_pids=admin or j.owner_uid == peer.uid) for j in jobs],
            "jobs_hidden": len(self.registry.jobs) - len(jobs),
            "memory": {
                "job_bytes": sum(j.job_bytes for j in self.registry.jobs.values()),
                **self.registry.released_mapped(),
                "max_job_bytes": self.cfg.max_job_bytes,
                "max_total_bytes": self.cfg.max_total_bytes,
            },
            "counters": dict(self.registry.counters),
            "uid_usage": self.registry.uid_usage(peer.uid) if peer.uid is not None else None,
            "fd_store": self.store.kind if store_state == "ok" else f"{self.store.kind} ({store_state})",
            "fd_store_state": store_state,
            "state_file": "ok" if self.state.healthy else f"failing: {self.state.last_error}" + (
                "; kept in the reserve" if self.state.in_reserve else
                f"; the reserve fails too: {self.state.reserve_error}" if self.state.reserve_error else ""),
            "limits": {
                **self.fds.describe(),
                "held_joins_per_uid": self.cfg.max_held_joins_per_uid,
                "jobs_per_uid": self.cfg.max_jobs_per_uid,
                "fds_per_uid": self.cfg.max_fds_per_uid,
                "bytes_per_uid": self.cfg.max_bytes_per_uid,
                "fd_handshakes_per_uid": self.cfg.max_handshakes_per_uid,
                "ctl_connections_per_uid": self.cfg.max_zmq_peers_per_uid,
            },
            "connections": {"ctl": len(self.zpeers), "fd": len(self.conns), "ctl_paused": self.ctl_paused,
                            "ctl_pauses": self.ctl_pauses, "fd_shed": self.fdsock.shed if self.fdsock else 0},
            "rendezvous_latency_ms": {
                "count": len(lat),
                "p50": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
                "max": round(lat[-1] * 1e3, 3) if lat else None,
                "last": round(self.registry.rendezvous_latencies[-1] * 1e3, 3) if lat else None,
            },
            "open_fds": count_fds(),
            "domain": self.domain_status(brief=True),
        }

    def domain_status(self, brief: bool = False) -> dict | None:
        """The domain this daemon is a node of: its peers' states and links (None: no domain)."""
        if self.domain is None:
            return None
        st = self.domain.status()
        if brief:
            return {"domain": st["domain"], "node": st["node"],
                    "nodes": {n["name"]: n["state"] for n in st["nodes"]}, "name_collisions": st["name_collisions"]}
        st["federation"] = self.fed.status()
        return st


def _zmq_peer(frame: zmq.Frame) -> tuple[int, int, int] | None:
    """(uid, gid, pid) of an ipc peer as libzmq reports it ('host:uid:gid:pid'), if it does."""
    try:
        addr = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    parts = str(addr).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None


def _keeper_info(runtime_dir: Path) -> tuple[int | None, float | None]:
    """(pid, linger) of the fd keeper serving ``runtime_dir``, asked on a connection of its
    own; (None, None) when it does not answer within a second."""
    from a2ad.daemon.keeper import KEEPER_SOCK

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(1.0)
        s.connect(str(Path(runtime_dir) / KEEPER_SOCK))
        fdpass.send_frame(s, {"op": "ping"}, timeout=1.0)
        reply, extra = fdpass.recv_frame(s, timeout=1.0)
        fdpass.close_all(extra)
    except (OSError, errors.A2ADError):
        return None, None
    finally:
        s.close()
    if not isinstance(reply, dict):
        return None, None
    pid = reply.get("pid")
    return (pid if isinstance(pid, int) else None), reply.get("linger")

