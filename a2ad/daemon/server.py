"""The a2ad daemon: one thread, one poll loop over the ZeroMQ ROUTER (requests), the
companion fd socket (handle delivery and leases), pidfds of joining processes, and
timers (rendezvous deadlines, grace periods, ticket expiry).

Nothing here is on the data path: once a client has mapped the workspaces, the
daemon is not involved in dispatch or combine.
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

from a2ad import __version__, errors, layout as L, protocol, runtime
from a2ad.daemon import persist as statefile
from a2ad.daemon.backends import make_backend
from a2ad.daemon.backends.base import Backend
from a2ad.control import ControlBlock
from a2ad.daemon import metrics, sdnotify
from a2ad.fdpass import peer_credentials, send_frame
from a2ad.daemon.fdstore import FdStore, NullStore, cb_name, make_store, ws_name
from a2ad.daemon.registry import TICKET_TTL, Job, PendingJoin, RankSlot, free_job, new_control_block, new_secret, spec_mismatch

log = logging.getLogger("a2ad")

#: The daemon caps every client's rendezvous timeout at this many seconds by default.
DEFAULT_MAX_RENDEZVOUS = 600.0
HANDSHAKE_TIMEOUT = 10.0


@dataclass
class Config:
    runtime_dir: Path
    backend: str = "auto"
    group: str | None = None
    grace: float = 30.0
    max_rendezvous_timeout: float = DEFAULT_MAX_RENDEZVOUS
    max_job_bytes: int = 1 << 40
    max_total_bytes: int = 1 << 42
    allow_uids: set[int] = field(default_factory=set)
    allow_gids: set[int] = field(default_factory=set)
    #: serve GET /metrics on 127.0.0.1:PORT from the poll loop (None: off)
    metrics_port: int | None = None
    #: auto | systemd | keeper | none: where workspace fds survive a daemon restart
    fd_store: str = "auto"
    #: Wait for the previous daemon to hand over the runtime folder (upgrade successor).
    takeover: bool = False
    #: The `a2ad serve` arguments, so that an upgrade can start a successor just like us.
    argv: list[str] = field(default_factory=list)


class FdConn:
    """One connection on fd.sock: first a ticket handshake, then (once fds are
    delivered) the rank's lease, which ends at EOF."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int):
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.buf = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.slot: RankSlot | None = None
        self.job: str | None = None

    def fileno(self) -> int:
        return self.sock.fileno()


class Daemon:
    def __init__(self, config: Config, backend: Backend | None = None):
        self.cfg = config
        self.backend = backend or make_backend(config.backend)
        self.jobs: dict[str, Job] = {}
        self.tickets: dict[bytes, tuple[str, int]] = {}
        self.conns: dict[int, FdConn] = {}
        self.pidfds: dict[int, tuple[str, int]] = {}
        self.started = time.monotonic()
        self.draining = False
        self.stopping = False
        self.counters = {"joins": 0, "attaches": 0, "detaches": 0, "deaths": 0, "rendezvous": 0, "bad_requests": 0}
        self.rendezvous_latencies: list[float] = []
        self.rendezvous_hist = metrics.LatencyHistogram()
        #: READY/STATUS/WATCHDOG/STOPPING to systemd; a no-op outside it
        self.notifier = sdnotify.Notifier()
        self.metrics_http: metrics.MetricsHTTP | None = None
        self.allowed_uids = {os.getuid(), 0} | set(config.allow_uids)
        self.allowed_gids = set(config.allow_gids)
        self._ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.fd_listener: socket.socket | None = None
        self.lock: runtime.Lock | None = None
        self._wake_r = self._wake_w = None
        self.store: FdStore = NullStore()
        #: set by `upgrade`: leave jobs alive for the successor instead of freeing them
        self.handover = False
        #: memory of freed jobs still mapped by processes: [{job, bytes, pids}]
        self.released: list[dict] = []
        self._dirty = False

    # ------------------------------------------------------------------ setup
    def bind(self) -> None:
        rd = self.cfg.runtime_dir
        gid = runtime.prepare(rd, self.cfg.group)
        if gid is not None:
            self.allowed_gids.add(gid)
        self.lock = self._take_lock(rd)
        self.store = make_store(self.cfg.fd_store, rd)
        for name in (runtime.CTL_SOCK, runtime.FD_SOCK):
            try:
                (rd / name).unlink()
            except FileNotFoundError:
                pass
        sock_mode = 0o660 if gid is not None else 0o600
        old_umask = os.umask(0o777 & ~sock_mode)
        try:
            self._ctx = zmq.Context()
            self.router = self._ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)
            self.router.bind(runtime.ctl_endpoint(rd))
            self.fd_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.fd_listener.bind(str(rd / runtime.FD_SOCK))
            self.fd_listener.listen(128)
            self.fd_listener.setblocking(False)
        finally:
            os.umask(old_umask)
        if gid is not None:
            for name in (runtime.CTL_SOCK, runtime.FD_SOCK):
                os.chown(rd / name, -1, gid)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        if self.cfg.metrics_port is not None:
            self.metrics_http = metrics.MetricsHTTP(self, self.cfg.metrics_port)
            log.info("metrics on http://%s:%d/metrics", *self.metrics_http.address)
        self._adopt()
        log.info(
            "a2ad %s serving %s (backend %s, fd store %s, pid %d)",
            __version__, rd, self.backend.name, self.store.kind, os.getpid(),
        )
        self.notifier.ready(self)

    def _take_lock(self, rd: Path) -> runtime.Lock:
        end = time.monotonic() + (30.0 if self.cfg.takeover else 0.0)
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

    # ------------------------------------------------------------------- loop
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.fd_listener.fileno(), zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self.metrics_http is not None:
            poller.register(self.metrics_http.fileno(), zmq.POLLIN)
        registered: set[int] = set()
        while not self.stopping:
            # keep the poller in step with the live connections and pidfds
            want = set(self.conns) | set(self.pidfds)
            for fd in registered - want:
                poller.unregister(fd)
            for fd in want - registered:
                poller.register(fd, zmq.POLLIN)
            registered = want
            timeout_ms = max(0, int(self._next_timer() * 1000)) if self._next_timer() is not None else 1000
            events = dict(poller.poll(self.notifier.poll_timeout_ms(min(timeout_ms, 1000))))
            if self._wake_r.fileno() in events:
                try:
                    while self._wake_r.recv(64):
                        pass
                except BlockingIOError:
                    pass
            if self.router in events:
                self._drain_router()
            if self.fd_listener.fileno() in events:
                self._accept()
            for fd in list(events):
                if fd in self.conns:
                    self._on_conn_readable(self.conns[fd])
                elif fd in self.pidfds:
                    self._on_pid_exit(fd)
            if self.metrics_http is not None:
                self.metrics_http.service()
            self._run_timers()
            self.notifier.tick(self)
            if self._dirty:
                self._save_state()

    def _save_state(self) -> None:
        self._dirty = False
        try:
            statefile.save(self.cfg.runtime_dir, self.jobs, self.backend.name)
        except OSError as exc:
            log.error("could not write the state file: %s", exc)

    def _adopt(self) -> None:
        """Re-adopt the jobs of a previous daemon: its state file plus the fds its store kept."""
        try:
            fds = self.store.load()
        except errors.A2ADError as exc:
            log.error("fd store: %s", exc.message)
            fds = {}
        for name, fd in _handover_fds().items():  # from a predecessor's upgrade: these win
            if name in fds:
                os.close(fds[name])
            fds[name] = fd
        try:
            state = statefile.load(self.cfg.runtime_dir)
        except (ValueError, OSError, Exception) as exc:  # a corrupt file must not stop the daemon
            log.error("ignoring the state file: %s", exc)
            state = None
        used: set[str] = set()
        for rec in (state or {}).get("jobs", []):
            if state.get("backend") != self.backend.name:
                log.error("state file is from a %s daemon; this one runs %s: not adopting", state.get("backend"), self.backend.name)
                break
            try:
                job = self._adopt_job(rec, fds, used)
            except Exception as exc:
                log.error("could not re-adopt job %s: %s", rec.get("name"), exc)
                continue
            self.jobs[job.name] = job
        for name, fd in fds.items():
            if name not in used:
                os.close(fd)
                self.store.drop(name)
        if self.jobs:
            log.info("re-adopted %d job(s): %s", len(self.jobs), ", ".join(self.jobs))
        self._dirty = True

    def _adopt_job(self, rec: dict, fds: dict[str, int], used: set[str]) -> Job:
        name, ep_size = rec["name"], rec["ep_size"]
        cfd = fds.get(cb_name(name))
        if cfd is None:
            raise errors.BackendError("its control block was not kept")
        aux = L.aux_layout(ep_size, rec["spec"]["max_num_tokens"])
        control = ControlBlock.map_fd(cfd)
        job = Job(
            name=name, ep_size=ep_size, spec=rec["spec"], size_per_rank=rec["size_per_rank"],
            row_stride=rec["row_stride"], aux=aux, control_fd=cfd, control=control,
            slots=[RankSlot(rank=r) for r in range(ep_size)],
        )
        job.generation = rec["generation"]
        job.rearms = rec.get("rearms", 0)
        job.rendezvous_count = rec.get("rendezvous_count", 0)
        job.needs_rearm = rec.get("needs_rearm", False)
        used.add(cb_name(name))
        for srec, slot in zip(rec["slots"], job.slots):
            slot.pid, slot.uid, slot.device = srec["pid"], srec["uid"], srec["device"]
            slot.lease, slot.deaths, slot.attaches = srec["lease"], srec["deaths"], srec["attaches"]
            if srec["alloc"] is not None:
                fd = fds.get(ws_name(name, slot.rank))
                if fd is None:
                    raise errors.BackendError(f"rank {slot.rank}'s workspace was not kept")
                slot.alloc = self.backend.adopt(fd, srec["alloc"]["size"], srec["device"], srec["alloc"]["handle_type"])
                used.add(ws_name(name, slot.rank))
            state = srec["state"]
            if state == L.RANK_ATTACHED:
                state = L.RANK_ATTACHED if self._watch_pid(job, slot) else L.RANK_DEAD
                if state == L.RANK_DEAD:
                    slot.deaths += 1
                    job.needs_rearm = True
                    control.set_abort(L.ABORT_PEER_LOST, slot.rank)
            elif state == L.RANK_JOINING:
                state = L.RANK_EMPTY  # its join request died with the old daemon
            slot.state = state
            control.set_rank_state(slot.rank, state)
        if not job.live_ranks():
            job.grace_deadline = time.monotonic() + self.cfg.grace
        return job

    def upgrade(self) -> dict:
        """Start a successor daemon with our arguments and hand it the runtime folder."""
        import subprocess
        import sys

        self._save_state()
        if self.store.kind == "none":
            raise errors.BackendError("this daemon runs with --fd-store none: an upgrade would lose every job")
        argv = [a for a in self.cfg.argv if a != "--takeover"]
        # the fds go straight to the successor too (systemd's store would not hand them to a
        # process it did not start); the names say which is which
        fds = {}
        for job in self.jobs.values():
            fds[cb_name(job.name)] = job.control_fd
            for slot in job.slots:
                if slot.alloc is not None:
                    fds[ws_name(job.name, slot.rank)] = slot.alloc.fd
        env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")}
        env[HANDOVER_ENV] = ",".join(f"{name}={fd}" for name, fd in fds.items())
        proc = subprocess.Popen(
            [sys.executable, "-m", "a2ad.tools.cli", "serve", *argv, "--takeover"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            pass_fds=list(fds.values()),
            env=env,
        )
        if os.environ.get("NOTIFY_SOCKET"):
            from a2ad.daemon import sdnotify

            sdnotify.notify(f"MAINPID={proc.pid}")  # before the successor's READY=1 and watchdog
        log.info("upgrade: successor daemon started (pid %d), %d fds handed over", proc.pid, len(fds))
        self.handover = True
        self.stopping = True
        return {"successor_pid": proc.pid, "jobs": sorted(self.jobs)}

    def _next_timer(self) -> float | None:
        now = time.monotonic()
        times = []
        for job in self.jobs.values():
            if job.grace_deadline is not None:
                times.append(job.grace_deadline)
            for s in job.slots:
                if s.pending is not None:
                    times.append(s.pending.deadline)
                if s.recovering is not None:
                    times.append(s.recovering.deadline)
        for c in self.conns.values():
            if c.slot is None:
                times.append(c.deadline)
        if not times:
            return None
        return max(0.0, min(times) - now)

    # --------------------------------------------------------------- requests
    def _drain_router(self) -> None:
        from a2ad.daemon.commands import handle

        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) != 2:
                self.counters["bad_requests"] += 1
                self._send(identity, protocol.encode_error(-1, errors.BadMessage("a request is exactly one frame")))
                continue
            cred = _zmq_peer(frames[1])
            reply = handle(self, identity, frames[1].bytes, cred)
            if reply is not None:
                self._send(identity, reply)

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            self.router.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out on its side
            log.warning("could not reply to a client: %s", exc)

    def check_uid(self, uid: int | None, gid: int | None, pid: int | None = None) -> None:
        """Allow the daemon's uid, root, --allow-uid, and members of the allowed groups
        (primary gid, or a supplementary group of the connecting process)."""
        if uid is None:
            return
        if uid in self.allowed_uids or (gid is not None and gid in self.allowed_gids):
            return
        if pid and self.allowed_gids and self.allowed_gids & _supplementary_groups(pid):
            return
        raise errors.PermissionDenied(f"uid {uid} is not allowed to use this daemon")

    # ------------------------------------------------------------------- join
    def join(self, identity: bytes, rid: int, f: dict, cred: tuple[int, int, int] | None) -> dict | None:
        """Register a join; returns None when the reply is held for the rendezvous."""
        if cred is not None:
            uid, gid, pid = cred
            self.check_uid(uid, gid, pid)
            if pid and pid != f["pid"]:
                raise errors.PermissionDenied(f"join claims pid {f['pid']} but comes from pid {pid}")
        else:
            uid = None
        self.backend.check_device(f["device"])
        spec = protocol.normalize_spec(f["spec"], f["ep_size"])
        name, rank = f["job"], f["ep_rank"]
        job = self.jobs.get(name)
        if job is None:
            if self.draining:
                raise errors.Draining("the daemon is draining: no new jobs are accepted")
            job = self._create_job(name, f["ep_size"], spec, f["device"])
        else:
            spec_mismatch(job, f["ep_size"], spec)
        slot = job.slots[rank]
        if slot.live:
            raise errors.RankTaken(
                f"job {name!r} rank {rank} is held by live pid {slot.pid} ({L.RANK_STATE_NAMES[slot.state]})",
                holder_pid=slot.pid,
            )
        if slot.alloc is not None and slot.device != f["device"]:
            raise errors.InvalidField(
                f"job {name!r} rank {rank}'s workspace lives on {slot.device}; a replacement must declare the same device",
                field="device",
            )
        if slot.alloc is None:
            self._allocate(job, slot, f["device"])
        replacing = slot.state == L.RANK_DEAD or slot.attaches > 0
        try:
            pidfd = os.pidfd_open(f["pid"])
        except ProcessLookupError:
            raise errors.InvalidField(f"pid {f['pid']} is not a running process", field="pid") from None
        except OSError:
            pidfd = None  # no pidfd support: death during rendezvous is caught by the timeout
        slot.state = L.RANK_JOINING
        slot.pid, slot.uid, slot.device = f["pid"], uid, f["device"]
        slot.leaving = False
        slot.joined_at = time.monotonic()
        slot.lease = new_secret()
        slot.pidfd = pidfd
        if pidfd is not None:
            self.pidfds[pidfd] = (name, rank)
        timeout = min(f.get("timeout", 60.0), self.cfg.max_rendezvous_timeout)
        slot.pending = PendingJoin(identity=identity, request_id=rid, deadline=time.monotonic() + timeout)
        job.control.set_rank_state(rank, L.RANK_JOINING)
        job.grace_deadline = None
        if job.rendezvous_started is None:
            job.rendezvous_started = time.monotonic()
        self.counters["joins"] += 1
        log.info(
            "job %s: rank %d %s (pid %d, device %s); %d/%d ranks present",
            name, rank, "rejoined" if replacing else "joined", f["pid"], f["device"], len(job.live_ranks()), job.ep_size,
        )
        self._maybe_release(job)
        return None

    def _create_job(self, name: str, ep_size: int, spec: dict, device: str) -> Job:
        size = spec["workspace_size_per_rank"]
        aux = L.aux_layout(ep_size, spec["max_num_tokens"])
        if size < L.pad_up(aux.aux_data_size) + 1:
            raise errors.InvalidField(
                f"workspace_size_per_rank {size} is smaller than the aux region alone ({L.pad_up(aux.aux_data_size)} bytes "
                f"for ep_size {ep_size}, max_num_tokens {spec['max_num_tokens']})",
                field="spec.workspace_size_per_rank",
            )
        stride = self.backend.row_stride(size, device)
        job_bytes = ep_size * stride
        if job_bytes > self.cfg.max_job_bytes:
            raise errors.LimitExceeded(
                f"job {name!r} needs {job_bytes} bytes, over the per-job limit of {self.cfg.max_job_bytes}",
                needed=job_bytes,
                limit=self.cfg.max_job_bytes,
            )
        total = sum(j.job_bytes for j in self.jobs.values())
        if total + job_bytes > self.cfg.max_total_bytes:
            raise errors.LimitExceeded(
                f"job {name!r} needs {job_bytes} bytes; the daemon holds {total} of its {self.cfg.max_total_bytes} limit",
                needed=job_bytes,
                limit=self.cfg.max_total_bytes,
            )
        cfd, cb = new_control_block(ep_size)
        job = Job(
            name=name,
            ep_size=ep_size,
            spec=spec,
            size_per_rank=size,
            row_stride=stride,
            aux=aux,
            control_fd=cfd,
            control=cb,
            slots=[RankSlot(rank=r) for r in range(ep_size)],
        )
        self.jobs[name] = job
        self.store.put(cb_name(name), cfd)
        self._dirty = True
        log.info("job %s created: ep_size %d, %d bytes per rank, spec %s", name, ep_size, size, spec)
        return job

    def _allocate(self, job: Job, slot: RankSlot, device: str) -> None:
        stride = self.backend.row_stride(job.size_per_rank, device)
        if stride != job.row_stride:
            raise errors.BackendError(
                f"device {device} needs a row stride of {stride} bytes; job {job.name!r} uses {job.row_stride}"
            )
        alloc = self.backend.allocate(job.size_per_rank, device)
        try:
            self.backend.initialize(alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND)
        except BaseException:
            self.backend.release(alloc)
            raise
        slot.alloc = alloc
        self.store.put(ws_name(job.name, slot.rank), alloc.fd)

    def _maybe_release(self, job: Job) -> None:
        """Release every held join and recover once all ranks are present (and, when the
        job needs a re-arm, every attached rank is quiesced in `recover`)."""
        if job.missing_ranks() or not (job.pending() or job.recovering()):
            return
        if job.needs_rearm or job.control.abort_word:
            if any(s.state == L.RANK_ATTACHED and s.recovering is None for s in job.slots):
                return  # a survivor has not quiesced yet
            self._rearm(job)
        now = time.monotonic()
        latency = now - max(s.joined_at for s in job.pending()) if job.pending() else 0.0
        for slot in job.recovering():
            self._send(slot.recovering.identity, protocol.encode_reply(slot.recovering.request_id, {"generation": job.generation}))
            slot.recovering = None
        if not job.pending():
            log.info("job %s: all %d ranks resumed at generation %d", job.name, job.ep_size, job.generation)
            self._dirty = True
            return
        handles = [{"kind": "workspace", "rank": s.rank, "size": s.alloc.size, "device": s.device} for s in job.slots]
        handles.append({"kind": "control", "size": L.CONTROL_BLOCK_SIZE})
        for slot in job.pending():
            ticket = new_secret()
            self.tickets[ticket] = (job.name, slot.rank, "join")
            slot.ticket = ticket
            slot.ticket_expiry = now + TICKET_TTL
            payload = {
                "job": job.name,
                "ep_rank": slot.rank,
                "ep_size": job.ep_size,
                "spec": job.spec,
                "size_per_rank": job.size_per_rank,
                "row_stride": job.row_stride,
                "backend": self.backend.name,
                "handle_type": slot.alloc.handle_type,
                "generation": job.generation,
                "metainfo": job.aux.metainfo(),
                "handles": handles,
                "ticket": ticket,
                "lease": slot.lease,
            }
            self._send(slot.pending.identity, protocol.encode_reply(slot.pending.request_id, payload))
            slot.pending = None
        job.rendezvous_started = None
        job.rendezvous_count += 1
        self._dirty = True
        self.counters["rendezvous"] += 1
        self.rendezvous_latencies.append(latency)
        self.rendezvous_hist.observe(latency)
        del self.rendezvous_latencies[:-1000]
        log.info("job %s: rendezvous done (%d ranks, %.3f ms after the last join)", job.name, job.ep_size, latency * 1e3)

    def _rearm(self, job: Job) -> None:
        """Reset every rank's flags and counters to one agreed state and bump the generation.
        Only called while no rank can be inside dispatch or combine (all quiesced or joining)."""
        t0 = time.monotonic()
        with self.backend.batch():
            for slot in job.slots:
                self.backend.initialize(slot.alloc, job.aux.aux_bytes, job.aux.flag_val, L.INITIAL_ROUND)
        for r in range(job.ep_size):
            job.control.clear_status(r)
        job.generation += 1
        job.control.generation = job.generation
        job.control.clear_abort()
        job.needs_rearm = False
        job.rearms += 1
        self.counters["rearms"] = self.counters.get("rearms", 0) + 1
        self._dirty = True
        log.info("job %s: re-armed at generation %d in %.1f ms", job.name, job.generation, (time.monotonic() - t0) * 1e3)

    def _slot_for_lease(self, f: dict) -> tuple[Job, RankSlot]:
        job = self.jobs.get(f["job"])
        if job is None:
            raise errors.NoSuchJob(f"no job named {f['job']!r}")
        slot = job.slots[f["ep_rank"]] if f["ep_rank"] < job.ep_size else None
        if slot is None or slot.lease is None or f["lease"] != slot.lease:
            raise errors.PermissionDenied(f"job {job.name!r} rank {f['ep_rank']}: the lease does not match its holder")
        return job, slot

    def recover(self, identity: bytes, rid: int, f: dict) -> None:
        """Hold this (attached, quiesced) rank until the job is re-armed with all ranks present."""
        job, slot = self._slot_for_lease(f)
        if slot.state != L.RANK_ATTACHED:
            raise errors.PermissionDenied(
                f"job {job.name!r} rank {slot.rank} is {L.RANK_STATE_NAMES[slot.state]}, not attached: join again instead"
            )
        if not job.needs_rearm:
            job.needs_rearm = True
            if not job.control.abort_word:
                # tell the other ranks, inside or outside a wait, that they must recover too
                job.control.set_abort(L.ABORT_REARM, slot.rank)
            log.info("job %s: rank %d asks for a re-arm", job.name, slot.rank)
        timeout = min(f.get("timeout", 60.0), self.cfg.max_rendezvous_timeout)
        slot.recovering = PendingJoin(identity=identity, request_id=rid, deadline=time.monotonic() + timeout)
        self._maybe_release(job)

    def renew(self, f: dict, cred) -> dict:
        """A ticket for a new lease connection (after a daemon restart dropped the old one)."""
        job, slot = self._slot_for_lease(f)
        if cred is not None and cred[2] and cred[2] != f["pid"]:
            raise errors.PermissionDenied(f"renew claims pid {f['pid']} but comes from pid {cred[2]}")
        if slot.state != L.RANK_ATTACHED or slot.pid != f["pid"]:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank} is not attached to pid {f['pid']}")
        ticket = new_secret()
        self.tickets[ticket] = (job.name, slot.rank, "renew")
        slot.ticket = ticket
        slot.ticket_expiry = time.monotonic() + TICKET_TTL
        return {"ticket": ticket, "generation": job.generation}

    # ----------------------------------------------------------- fd socket
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.fd_listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            try:
                pid, uid, gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            conn = FdConn(sock, pid, uid, gid)
            self.conns[sock.fileno()] = conn

    def _close_conn(self, conn: FdConn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _on_conn_readable(self, conn: FdConn) -> None:
        try:
            data = conn.sock.recv(protocol.FD_FRAME_MAX + 4)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if conn.slot is not None:
            # a lease: EOF (or anything at all) ends the attachment
            if not data:
                self._detach(conn)
            return
        if not data:
            self._close_conn(conn)
            return
        conn.buf += data
        if len(conn.buf) < 4:
            return
        try:
            n = protocol.fd_frame_length(bytes(conn.buf[:4]))
        except errors.A2ADError as exc:
            self._refuse_conn(conn, exc)
            return
        if len(conn.buf) < 4 + n:
            return
        try:
            obj = protocol.unpack(bytes(conn.buf[4 : 4 + n]))
            self._redeem(conn, obj)
        except errors.A2ADError as exc:
            self._refuse_conn(conn, exc)

    def _refuse_conn(self, conn: FdConn, exc: errors.A2ADError) -> None:
        log.warning("fd socket: refused pid %d: %s", conn.pid, exc.message)
        try:
            send_frame(conn.sock, {"v": protocol.PROTOCOL_VERSION, "ok": False, "code": exc.code, "message": exc.message})
        except OSError:
            pass
        self._close_conn(conn)

    def _redeem(self, conn: FdConn, obj) -> None:
        if not isinstance(obj, dict) or obj.get("v") != protocol.PROTOCOL_VERSION:
            raise errors.BadMessage("fd-socket request must be a version-1 map")
        ticket = obj.get("ticket")
        if not isinstance(ticket, bytes) or ticket not in self.tickets:
            raise errors.BadTicket("unknown, expired or already used ticket")
        name, rank, kind = self.tickets[ticket]
        job = self.jobs.get(name)
        slot = job.slots[rank] if job else None
        want = L.RANK_JOINING if kind == "join" else L.RANK_ATTACHED
        if slot is None or slot.ticket != ticket or slot.state != want:
            self.tickets.pop(ticket, None)
            raise errors.BadTicket("the ticket's rank is no longer waiting for it")
        if conn.pid != slot.pid:
            # leave the ticket valid for its rightful owner
            raise errors.PermissionDenied(f"ticket belongs to pid {slot.pid}, not to pid {conn.pid}")
        self.check_uid(conn.uid, conn.gid, conn.pid)
        del self.tickets[ticket]
        slot.ticket = None
        if kind == "renew":
            send_frame(conn.sock, {"v": protocol.PROTOCOL_VERSION, "ok": True, "code": "ok", "message": "", "nfds": 0})
            self._drop_pidfd(slot)
            conn.slot, conn.job = slot, name
            slot.lease_conn = conn
            log.info("job %s: rank %d renewed its lease (pid %d)", name, rank, conn.pid)
            return
        fds = [s.alloc.fd for s in job.slots] + [job.control_fd]
        send_frame(conn.sock, {"v": protocol.PROTOCOL_VERSION, "ok": True, "code": "ok", "message": "", "nfds": len(fds)}, fds)
        conn.slot, conn.job = slot, name
        slot.lease_conn = conn
        slot.state = L.RANK_ATTACHED
        slot.attached_at = time.monotonic()
        slot.attaches += 1
        self._drop_pidfd(slot)
        job.control.set_rank_state(rank, L.RANK_ATTACHED)
        self._dirty = True
        self.counters["attaches"] += 1
        log.info("job %s: rank %d attached (pid %d)", name, rank, conn.pid)

    def _drop_pidfd(self, slot: RankSlot) -> None:
        if slot.pidfd is not None:
            self.pidfds.pop(slot.pidfd, None)
            os.close(slot.pidfd)
            slot.pidfd = None

    def _watch_pid(self, job: Job, slot: RankSlot) -> bool:
        """Watch a rank's process with a pidfd; False when it is already gone."""
        try:
            slot.pidfd = os.pidfd_open(slot.pid)
        except (ProcessLookupError, OSError):
            return False
        self.pidfds[slot.pidfd] = (job.name, slot.rank)
        return True

    def _detach(self, conn: FdConn) -> None:
        slot, name = conn.slot, conn.job
        self._close_conn(conn)
        job = self.jobs.get(name)
        if job is None or slot.lease_conn is not conn:
            return
        slot.lease_conn = None
        if slot.leaving:
            self._mark(job, slot, L.RANK_LEFT, "left")
        else:
            self._mark(job, slot, L.RANK_DEAD, "died (lease connection closed without leave)")

    def _on_pid_exit(self, pidfd: int) -> None:
        name, rank = self.pidfds.pop(pidfd)
        job = self.jobs.get(name)
        if job is not None:
            slot = job.slots[rank]
            if slot.pidfd == pidfd:
                slot.pidfd = None
                if slot.state == L.RANK_JOINING:
                    slot.pending = None
                    if slot.ticket is not None:
                        self.tickets.pop(slot.ticket, None)
                        slot.ticket = None
                    self._mark(job, slot, L.RANK_DEAD, "died before attaching")
                elif slot.state == L.RANK_ATTACHED and slot.lease_conn is None:
                    # adopted after a daemon restart, lease not renewed yet: the pidfd is the lease
                    slot.recovering = None
                    self._mark(job, slot, L.RANK_DEAD, "died (seen by its pidfd)")
        os.close(pidfd)

    def _mark(self, job: Job, slot: RankSlot, state: int, why: str) -> None:
        was_live = slot.state == L.RANK_ATTACHED
        slot.state = state
        job.control.set_rank_state(slot.rank, state)
        self._dirty = True
        if slot.recovering is not None:
            self._send(slot.recovering.identity, protocol.encode_error(
                slot.recovering.request_id, errors.PermissionDenied(f"rank {slot.rank} is {L.RANK_STATE_NAMES[state]}")))
            slot.recovering = None
        others_live = any(s.live for s in job.slots if s is not slot)
        if was_live and others_live:
            # the job's rounds can no longer agree: survivors must recover with a replacement
            job.needs_rearm = True
            if not job.control.abort_word:
                job.control.set_abort(L.ABORT_PEER_LOST, slot.rank)
        if state == L.RANK_DEAD:
            slot.deaths += 1
            self.counters["deaths"] += 1
            # peers spinning on this rank leave their waits at once
            job.control.set_abort(L.ABORT_PEER_LOST, slot.rank)
            job.needs_rearm = job.needs_rearm or job.rendezvous_count > 0
            log.warning("job %s: rank %d (pid %s) %s", job.name, slot.rank, slot.pid, why)
        else:
            self.counters["detaches"] += 1
            log.info("job %s: rank %d (pid %s) %s", job.name, slot.rank, slot.pid, why)
        if not job.live_ranks():
            job.grace_deadline = time.monotonic() + self.cfg.grace
            log.info("job %s: no ranks attached; freed in %.1f s unless one re-attaches", job.name, self.cfg.grace)

    def leave(self, f: dict) -> dict:
        job = self.jobs.get(f["job"])
        if job is None:
            raise errors.NoSuchJob(f"no job named {f['job']!r}")
        slot = job.slots[f["ep_rank"]]
        if slot.lease is None or f["lease"] != slot.lease or not slot.live:
            raise errors.PermissionDenied(f"job {job.name!r} rank {slot.rank}: the lease does not match its holder")
        slot.leaving = True
        if slot.lease_conn is not None:
            # the leave is complete when its reply goes out: the rank is free for a successor
            # at once, whether or not the client's socket close has arrived yet
            self._detach(slot.lease_conn)
        else:  # left before redeeming its ticket, or adopted after a restart without a lease
            if slot.ticket is not None:
                self.tickets.pop(slot.ticket, None)
                slot.ticket = None
            slot.pending = None
            self._drop_pidfd(slot)
            self._mark(job, slot, L.RANK_LEFT, "left")
        return {}

    # ----------------------------------------------------------------- timers
    def _run_timers(self) -> None:
        now = time.monotonic()
        for conn in list(self.conns.values()):
            if conn.slot is None and now >= conn.deadline:
                self._refuse_conn(conn, errors.BadTicket("no ticket was presented in time"))
        for ticket, (name, rank, kind) in list(self.tickets.items()):
            job = self.jobs.get(name)
            slot = job.slots[rank] if job else None
            if slot is None or now >= slot.ticket_expiry:
                self.tickets.pop(ticket, None)
                if slot is not None and slot.ticket == ticket:
                    slot.ticket = None
                if slot is not None and kind == "join" and slot.state == L.RANK_JOINING:
                    slot.ticket = None
                    self._mark(job, slot, L.RANK_DEAD, "never redeemed its ticket")
        for job in list(self.jobs.values()):
            for slot in job.slots:
                if slot.recovering is not None and now >= slot.recovering.deadline:
                    missing = [s.rank for s in job.slots if not s.live or (s.state == L.RANK_ATTACHED and s.recovering is None)]
                    err = errors.RendezvousTimeout(
                        f"job {job.name!r}: recovery timed out waiting for rank(s) {missing}", missing_ranks=missing
                    )
                    self._send(slot.recovering.identity, protocol.encode_error(slot.recovering.request_id, err))
                    log.warning("job %s: rank %d's recovery timed out; waiting for %s", job.name, slot.rank, missing)
                    slot.recovering = None
                if slot.pending is not None and now >= slot.pending.deadline:
                    missing = job.missing_ranks()
                    err = errors.RendezvousTimeout(
                        f"job {job.name!r}: rendezvous timed out waiting for rank(s) {missing}",
                        missing_ranks=missing,
                    )
                    self._send(slot.pending.identity, protocol.encode_error(slot.pending.request_id, err))
                    log.warning("job %s: rank %d's rendezvous timed out; missing %s", job.name, slot.rank, missing)
                    slot.pending = None
                    if slot.pidfd is not None:
                        self.pidfds.pop(slot.pidfd, None)
                        os.close(slot.pidfd)
                        slot.pidfd = None
                    slot.state = L.RANK_EMPTY
                    slot.lease = None
                    job.control.set_rank_state(slot.rank, L.RANK_EMPTY)
                    if not job.live_ranks():
                        job.grace_deadline = now + self.cfg.grace
            if job.grace_deadline is not None and now >= job.grace_deadline:
                self.free(job, "grace period over")

    # --------------------------------------------------------------- teardown
    def free(self, job: Job, why: str) -> None:
        self.jobs.pop(job.name, None)
        self._dirty = True
        job.control.set_abort(L.ABORT_DESTROYED, -1)
        holders = [s.pid for s in job.slots if s.state == L.RANK_ATTACHED and s.pid]
        if holders:
            self.released.append({"job": job.name, "bytes": job.job_bytes, "pids": holders})
        for slot in job.slots:
            for held in (slot.pending, slot.recovering):
                if held is not None:
                    self._send(
                        held.identity,
                        protocol.encode_error(held.request_id, errors.JobDestroyed(f"job {job.name!r} was destroyed")),
                    )
            slot.pending = slot.recovering = None
            if slot.alloc is not None:
                self.store.drop(ws_name(job.name, slot.rank))
            if slot.ticket is not None:
                self.tickets.pop(slot.ticket, None)
            if slot.lease_conn is not None:
                self._close_conn(slot.lease_conn)
                slot.lease_conn = None
            if slot.pidfd is not None:
                self.pidfds.pop(slot.pidfd, None)
        self.store.drop(cb_name(job.name))
        free_job(job, self.backend)
        log.info("job %s freed (%s)", job.name, why)

    def shutdown(self) -> None:
        self.notifier.stopping(self)
        if self.handover:
            log.info("handing %d job(s) over to the successor", len(self.jobs))
            self._save_state()
        else:
            log.info("shutting down: freeing %d job(s)", len(self.jobs))
            for job in list(self.jobs.values()):
                self.free(job, "daemon shutdown")
            self._dirty = False
            try:  # nothing is left to re-adopt
                (self.cfg.runtime_dir / runtime.STATE_FILE).unlink()
            except FileNotFoundError:
                pass
        for conn in list(self.conns.values()):
            self._close_conn(conn)
        if self.metrics_http is not None:
            self.metrics_http.close()
            self.metrics_http = None
        if self.router is not None:
            self.router.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self.fd_listener is not None:
            self.fd_listener.close()
        rd = self.cfg.runtime_dir
        for name in (runtime.CTL_SOCK, runtime.FD_SOCK):
            try:
                (rd / name).unlink()
            except FileNotFoundError:
                pass
        if self._wake_r is not None:
            signal.set_wakeup_fd(-1)
            self._wake_r.close()
            self._wake_w.close()
        if self.handover:
            for job in self.jobs.values():  # close our copies only; the store keeps theirs
                for slot in job.slots:
                    if slot.alloc is not None and slot.alloc.fd >= 0:
                        os.close(slot.alloc.fd)
                        slot.alloc.fd = -1
                    self._drop_pidfd(slot)
                job.control.close()
                os.close(job.control_fd)
        else:
            self.backend.close()
        self.store.close(clean=not self.handover)
        if self.lock is not None:
            self.lock.release()
        log.info("stopped")

    # ----------------------------------------------------------------- status
    def _released_mapped(self) -> dict:
        """Memory of freed jobs that live processes may still map (the driver returns it only
        when the last importer unmaps; a process that held a rank at free time counts)."""
        keep = []
        for rec in self.released:
            rec["pids"] = [p for p in rec["pids"] if _alive(p)]
            if rec["pids"]:
                keep.append(rec)
        self.released = keep
        return {
            "released_mapped_bytes": sum(r["bytes"] for r in keep),
            "released_mapped_processes": len({p for r in keep for p in r["pids"]}),
            "released_mapped_jobs": [{"job": r["job"], "bytes": r["bytes"], "pids": r["pids"]} for r in keep],
        }

    def status(self) -> dict:
        now = time.monotonic()
        lat = sorted(self.rendezvous_latencies)
        return {
            "version": __version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started, 3),
            "runtime_dir": str(self.cfg.runtime_dir),
            "backend": self.backend.describe(),
            "draining": self.draining,
            "jobs": [j.summary(now) for j in self.jobs.values()],
            "memory": {
                "job_bytes": sum(j.job_bytes for j in self.jobs.values()),
                **self._released_mapped(),
                "max_job_bytes": self.cfg.max_job_bytes,
                "max_total_bytes": self.cfg.max_total_bytes,
            },
            "counters": dict(self.counters),
            "fd_store": self.store.kind,
            "rendezvous_latency_ms": {
                "count": len(lat),
                "p50": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
                "max": round(lat[-1] * 1e3, 3) if lat else None,
            },
            "open_fds": _count_fds(),
        }


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


def _supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


HANDOVER_ENV = "A2AD_HANDOVER_FDS"


def _handover_fds() -> dict[str, int]:
    """Fds a predecessor passed on upgrade: ``$A2AD_HANDOVER_FDS`` = ``name=fd,...``."""
    raw = os.environ.pop(HANDOVER_ENV, "")
    out = {}
    for item in filter(None, raw.split(",")):
        name, _, fd = item.rpartition("=")
        try:
            fdn = int(fd)
            os.fstat(fdn)
        except (ValueError, OSError):
            log.error("upgrade handover: bad entry %r", item)
            continue
        os.set_inheritable(fdn, False)
        out[name] = fdn
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) maps nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _count_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
