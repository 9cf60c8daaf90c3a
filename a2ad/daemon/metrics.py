"""The daemon's metrics, through prometheus-client.

``render(daemon, peer)`` returns the Prometheus text exposition (what ``a2ad-ctl metrics``
prints). ``registry(daemon)`` builds a CollectorRegistry whose collector reads the
daemon's state at scrape time; nothing is updated on the daemon's hot paths except the
rendezvous-latency histogram (``LatencyHistogram.observe``, a few integer additions).

``MetricsHTTP`` serves ``GET /metrics`` on 127.0.0.1 from inside the daemon's own poll
loop. Why not a thread: the collector walks the daemon's job table, which the loop
mutates without locks; reading it from another thread would need a lock around every
loop iteration. Instead the HTTP sockets live in a private epoll set whose single fd sits
in the daemon's poller; ``service()`` does non-blocking accept/recv/send only, with a
deadline and a size cap per connection, so a slow or hostile scraper cannot stall the
loop, and the render happens in the thread that owns the state.

Idle connections cannot lock scrapers out either: at most ``MAX_CONNECTIONS`` are held,
and a new one arriving over the cap evicts the oldest connection still waiting for its
request (one already being answered is never evicted); a request must arrive within
``REQUEST_TIMEOUT`` of the connect and a reply be taken within ``REPLY_TIMEOUT``.
"""

from __future__ import annotations

import bisect
import errno
import logging
import selectors
import socket
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from a2ad import __version__, errors, layout as L, protocol

log = logging.getLogger("a2ad")

#: Upper bounds (seconds) of the rendezvous-latency histogram: from the last join of a job
#: to the release of all its ranks (allocation of the last rank's workspace included).
RENDEZVOUS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_COUNTER_HELP = {
    "joins": "Join requests accepted (a rank entered a rendezvous).",
    "attaches": "Ranks that redeemed their ticket: attached, their workspace handles then sent (one that could not be sent is a death too).",
    "detaches": "Ranks that left cleanly.",
    "deaths": "Ranks that died (lease closed without a leave, or gone before attaching).",
    "rendezvous": "Rendezvous completed (all ranks of a job released together).",
    "bad_requests": "Malformed or invalid requests answered with an error.",
    "rearms": "Job-wide re-arms: flags reset and generation bumped after a rank was lost or replaced.",
    "readmits": "Replacements let back into a degraded job while its other ranks kept serving.",
    "mask_restores": "Times a degrade job's published active mask was found changed by a client and put back.",
}

_JOB_STATES = ("rendezvous", "ready", "degraded", "needs-rearm", "grace")


class LatencyHistogram:
    """Cumulative bucket counts, sum and count: what a Prometheus histogram needs, kept by
    the daemon from its start (unlike the bounded list of recent latencies in status)."""

    def __init__(self, buckets=RENDEZVOUS_BUCKETS):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out


class DaemonCollector:
    """Reads a Daemon's state at collect() time.

    Series labelled with a job's name are only about the jobs in ``named_jobs(daemon)``
    (None: every job): ``a2ad-ctl metrics`` passes the asking uid's view (its own jobs, every
    job for an admin), as ``status`` does; the HTTP port, which knows nobody's identity,
    names no job unless the daemon runs with ``--metrics-job-names``. Totals (jobs by state,
    ranks, bytes, degraded jobs) count every job."""

    def __init__(self, daemon, named_jobs=None):
        self.d = daemon
        self.named_jobs = named_jobs

    def collect(self):
        d = self.d
        now = time.monotonic()
        jobs = list(d.jobs.values())

        up = GaugeMetricFamily("a2ad_up", "1 while the daemon serves.")
        up.add_metric([], 1)
        yield up
        info = GaugeMetricFamily("a2ad_build_info", "Version, wire protocol and backend of the daemon (value 1).",
                                 labels=["version", "protocol", "backend"])
        info.add_metric([__version__, str(protocol.PROTOCOL_VERSION), d.backend.name], 1)
        yield info
        up_s = GaugeMetricFamily("a2ad_uptime_seconds", "Seconds since the daemon started.")
        up_s.add_metric([], now - d.started)
        yield up_s
        drain = GaugeMetricFamily("a2ad_draining", "1 while the daemon refuses new jobs (a2ad-ctl drain).")
        drain.add_metric([], 1 if d.draining else 0)
        yield drain

        n_jobs = GaugeMetricFamily("a2ad_jobs", "Jobs the daemon holds.")
        n_jobs.add_metric([], len(jobs))
        yield n_jobs
        by_state = GaugeMetricFamily("a2ad_jobs_by_state", "Jobs by state (rendezvous, ready, degraded, needs-rearm, grace).",
                                     labels=["state"])
        counts = dict.fromkeys(_JOB_STATES, 0)
        for j in jobs:
            s = j.state_name()
            counts[s] = counts.get(s, 0) + 1
        for s, n in counts.items():
            by_state.add_metric([s], n)
        yield by_state

        ranks = GaugeMetricFamily("a2ad_ranks", "Rank slots of all jobs by state (this node's ranks only, in a domain).",
                                  labels=["state"])
        rcounts = dict.fromkeys(L.RANK_STATE_NAMES, 0)
        for j in jobs:
            for s in j.slots:
                if getattr(s, "node", None) is None:
                    rcounts[s.state] = rcounts.get(s.state, 0) + 1
        for state, n in rcounts.items():
            ranks.add_metric([L.RANK_STATE_NAMES.get(state, str(state))], n)
        yield ranks

        # the known counters from the start (at 0), then any the daemon added since
        counters = dict.fromkeys(_COUNTER_HELP, 0) | dict(d.counters)
        for key, value in counters.items():
            c = CounterMetricFamily(f"a2ad_{key}", _COUNTER_HELP.get(key, f"Count of {key.replace('_', ' ')} since start."))
            c.add_metric([], value)
            yield c

        yield self._rendezvous_histogram()

        # failures as the ranks and the daemon see them right now
        aborted = GaugeMetricFamily("a2ad_jobs_aborted", "Jobs whose control-block abort word is set, by reason.",
                                    labels=["reason"])
        acounts = {name: 0 for code, name in L.ABORT_NAMES.items() if code != L.ABORT_NONE}
        failing = GaugeMetricFamily(
            "a2ad_rank_wait_failures",
            "Ranks whose status record reports a failed wait (timeout: a peer never arrived; aborted: left on the abort "
            "word; left_behind: a peer went on without the rank while it pulled, degraded mode).",
            labels=["kind"],
        )
        fcounts = {"timeout": 0, "aborted": 0, "left_behind": 0}
        for j in jobs:
            word = j.control.abort_word
            if word != L.ABORT_NONE:
                name = L.ABORT_NAMES.get(word, f"reason{word}")
                acounts[name] = acounts.get(name, 0) + 1
            for s in j.slots:
                if getattr(s, "node", None) is not None:
                    continue  # another node's rank writes its status there
                code = j.control.status(s.rank).code
                if code == L.STATUS_TIMEOUT:
                    fcounts["timeout"] += 1
                elif code == L.STATUS_ABORTED:
                    fcounts["aborted"] += 1
                elif code == L.STATUS_LEFT_BEHIND:
                    fcounts["left_behind"] += 1
        for name, n in acounts.items():
            aborted.add_metric([name], n)
        for kind, n in fcounts.items():
            failing.add_metric([kind], n)
        yield aborted
        yield failing

        named = jobs if self.named_jobs is None else list(self.named_jobs(d))
        yield from self._degraded(jobs, named, now)

        yield from self._memory(jobs)

        conns = GaugeMetricFamily("a2ad_lease_connections", "Open fd-socket connections (leases and handshakes).")
        conns.add_metric([], len(d.conns))
        yield conns

        yield from self._domain(now)

    def _domain(self, now: float):
        """Per peer link of the domain (nothing without one)."""
        dom = getattr(self.d, "domain", None)
        if dom is None:
            return
        st = dom.status()
        peers = [p for p in st["nodes"] if p["state"] != "self"]
        up = GaugeMetricFamily("a2ad_domain_peer_up", "1 while the peer node's daemon is heard (heartbeats), else 0.",
                               labels=["node"])
        age = GaugeMetricFamily("a2ad_domain_peer_last_heartbeat_age_seconds",
                                "Seconds since the peer's last heartbeat (absent before the first).", labels=["node"])
        link = GaugeMetricFamily("a2ad_domain_peer_link_connected",
                                 "1 while this daemon's authenticated connection to the peer stands.", labels=["node"])
        collision = GaugeMetricFamily("a2ad_domain_peer_name_collision",
                                      "1 while two daemons are heard running as the peer's node name, else 0.",
                                      labels=["node"])
        for p in peers:
            collision.add_metric([p["name"]], 1 if p.get("name_collision") else 0)
            up.add_metric([p["name"]], 1 if p["state"] == "up" else 0)
            link.add_metric([p["name"]], 1 if p["link_connected"] else 0)
            if p["last_heartbeat_age_s"] is not None:
                age.add_metric([p["name"]], p["last_heartbeat_age_s"])
        yield up
        yield age
        yield link
        yield collision
        for key, help_text in (
            ("heartbeats_received", "Heartbeats received from the peer."),
            ("heartbeats_sent", "Heartbeats sent to the peer."),
            ("messages_received", "Domain messages (besides heartbeats) received from the peer."),
            ("messages_sent", "Domain messages (besides heartbeats) sent to the peer."),
            ("bad_messages", "Messages from the peer dropped as malformed or unusable."),
            ("send_drops", "Messages to the peer the link could not take (a full resend follows)."),
            ("losses", "Times the peer was counted lost (silent past the heartbeat bound)."),
            ("resyncs_asked", "Times the peer's heartbeats said it had counted this node lost (a full resync to it followed)."),
            ("handshake_failures", "Failed handshakes of this daemon's connection to the peer."),
            ("connects", "Handshakes of this daemon's connection to the peer that succeeded (each owes it a resync)."),
            ("name_collisions", "Times a second daemon was heard running as the peer's node name."),
            ("collision_drops", "Messages dropped from a second daemon running as the peer's node name."),
        ):
            fam = CounterMetricFamily(f"a2ad_domain_peer_{key}", help_text, labels=["node"])
            for p in peers:
                fam.add_metric([p["name"]], p[key])
            yield fam
        for way in ("sent", "received"):
            fam = CounterMetricFamily(f"a2ad_domain_messages_{way}_by_type",
                                      f"Domain messages {way} (all peers together; heartbeats are type hb), by type.",
                                      labels=["type"])
            for t, n in st["messages_by_type"][way].items():
                fam.add_metric([t], n)
            yield fam
            fam = CounterMetricFamily(f"a2ad_domain_bytes_{way}_by_type",
                                      f"Bytes of domain messages {way} (msgpack, before CURVE), by type.", labels=["type"])
            for t, n in st["bytes_by_type"][way].items():
                fam.add_metric([t], n)
            yield fam
        refused = CounterMetricFamily("a2ad_domain_refused_connections",
                                      "Connections to this node refused: a key that is not a node's of the domain.")
        refused.add_metric([], st["refused_connections"])
        yield refused

    def _degraded(self, jobs, named, now: float):
        """Per job of the degrade policy (on_peer_loss="degrade"): its active-rank mask, how
        many ranks serve, and since when it runs without some (0 while every rank serves)."""
        active = GaugeMetricFamily("a2ad_job_active_ranks",
                                   "Ranks of a degrade job that serve now (in the active mask and let in).",
                                   labels=["job"])
        mask = GaugeMetricFamily("a2ad_job_active_mask",
                                 "A degrade job's active-rank mask (bit q: rank q; exact up to 53 ranks: "
                                 "a2ad_job_active_mask_info holds it at any width).",
                                 labels=["job"])
        info = GaugeMetricFamily("a2ad_job_active_mask_info",
                                 "Always 1; labels: a degrade job's active-rank mask in hex (bit q: rank q) and "
                                 "its ranks as ranges (0-63,65,70-255), exact at any ep_size.",
                                 labels=["job", "mask", "ranks"])
        gen = GaugeMetricFamily("a2ad_job_mask_generation",
                                "Changes of a degrade job's active-rank mask since it was created.", labels=["job"])
        since = GaugeMetricFamily("a2ad_job_degraded_seconds",
                                  "Seconds a degrade job has run without some of its ranks (0 while all serve).",
                                  labels=["job"])
        n_degraded = 0
        named_ids = {id(j) for j in named}
        for j in jobs:
            if not getattr(j, "degrade", False):
                continue
            m = j.mask_summary(time.monotonic())
            if m["active_mask"] is None:
                continue
            n_degraded += 1 if m["degraded_s"] else 0
            if id(j) not in named_ids:
                continue  # counted above, not named
            active.add_metric([j.name], len(m["active_ranks"]))
            mask.add_metric([j.name], float(m["active_mask"]))
            info.add_metric([j.name, f"{m['active_mask']:#x}", L.format_ranks(m["active_mask"])], 1)
            gen.add_metric([j.name], m["mask_generation"])
            since.add_metric([j.name], m["degraded_s"] or 0.0)
        total = GaugeMetricFamily("a2ad_jobs_serving_degraded",
                                  "Degrade jobs running without some of their ranks right now.")
        total.add_metric([], n_degraded)
        yield total
        yield active
        yield mask
        yield info
        yield gen
        yield since

    def _rendezvous_histogram(self):
        h = getattr(self.d, "rendezvous_hist", None)
        if h is None:  # a daemon without the histogram: build one from its recent latencies
            h = LatencyHistogram()
            for v in getattr(self.d, "rendezvous_latencies", []):
                h.observe(v)
        fam = HistogramMetricFamily(
            "a2ad_rendezvous_latency_seconds",
            "Time from the last rank's join to the release of all ranks of a job.",
        )
        fam.add_metric([], h.cumulative(), h.sum)
        return fam

    def _memory(self, jobs):
        d = self.d
        ws = GaugeMetricFamily("a2ad_workspace_bytes", "Workspace bytes the daemon holds, per device "
                               "(device: 'host' or the GPU's UUID; gpu: CUDA ordinal, empty for host).",
                               labels=["device", "gpu"])
        ctx = GaugeMetricFamily("a2ad_daemon_context_bytes",
                                "GPU memory taken by the daemon's own CUDA context at its latest creation.",
                                labels=["device", "gpu"])
        try:
            desc = d.backend.describe()
        except Exception as exc:  # a scrape must not fail because the driver hiccupped
            log.debug("metrics: backend.describe failed: %s", exc)
            desc = {}
        devices = desc.get("devices")
        if devices:
            for dev in devices:
                labels = [str(dev.get("uuid") or ""), str(dev.get("ordinal", ""))]
                ws.add_metric(labels, dev.get("workspace_bytes") or 0)
                if dev.get("context_overhead_bytes") is not None:
                    ctx.add_metric(labels, dev["context_overhead_bytes"])
        else:
            held = sum(s.alloc.size for j in jobs for s in j.slots if s.alloc is not None)
            ws.add_metric(["host", ""], held)
        yield ws
        if ctx.samples:
            yield ctx
        total = GaugeMetricFamily("a2ad_job_bytes", "Bytes reserved by all jobs (ep_size x row stride each).")
        total.add_metric([], sum(j.job_bytes for j in jobs))
        yield total
        released = getattr(d, "_released_mapped", None)
        if released is not None:
            rm = released()
            rb = GaugeMetricFamily("a2ad_released_mapped_bytes",
                                   "Bytes of freed jobs that live processes may still map: the driver returns "
                                   "them only when the last importer unmaps.")
            rb.add_metric([], rm.get("released_mapped_bytes", 0))
            yield rb
            rp = GaugeMetricFamily("a2ad_released_mapped_processes",
                                   "Live processes that held a rank of a job when it was freed.")
            rp.add_metric([], rm.get("released_mapped_processes", 0))
            yield rp
        limits = GaugeMetricFamily("a2ad_memory_limit_bytes", "Configured memory limits.", labels=["scope"])
        limits.add_metric(["job"], d.cfg.max_job_bytes)
        limits.add_metric(["daemon"], d.cfg.max_total_bytes)
        yield limits


def _no_jobs(daemon) -> list:
    return []


def registry(daemon, named_jobs=None) -> CollectorRegistry:
    """A registry with the daemon's collector and the process collector
    (a2ad_process_*: CPU seconds, resident memory, open fds, start time). ``named_jobs``:
    see DaemonCollector (None: every job is named)."""
    from prometheus_client import ProcessCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector(daemon, named_jobs))
    ProcessCollector(namespace="a2ad", registry=reg)
    return reg


def render(daemon, peer=None) -> str:
    """The daemon's metrics in Prometheus text format; series that name a job only for the
    jobs ``peer`` may see (``registry.visible_jobs``), every job when ``peer`` is None."""
    named = None if peer is None else (lambda d: d.registry.visible_jobs(peer))
    return generate_latest(registry(daemon, named)).decode()


def http_named_jobs(daemon):
    """What the HTTP port names: every job with --metrics-job-names, else none."""
    return None if getattr(daemon.cfg, "metrics_job_names", False) else _no_jobs


# ---------------------------------------------------------------- HTTP /metrics
MAX_REQUEST = 16 << 10
MAX_CONNECTIONS = 32
#: seconds from the connect to a complete request header, whatever trickles in meanwhile
REQUEST_TIMEOUT = 3.0
#: seconds for the scraper to take the whole reply
REPLY_TIMEOUT = 10.0
LISTEN_BACKLOG = 128


class MetricsPortError(errors.A2ADError, OSError):
    """The metrics port cannot be bound (busy, or not allowed); the message names it."""


class _HttpConn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.out: memoryview | None = None
        self.accepted = time.monotonic()
        self.deadline = self.accepted + REQUEST_TIMEOUT


class MetricsHTTP:
    """GET /metrics on 127.0.0.1:port, serviced from the daemon's poll loop.

    Register ``fileno()`` (an epoll fd) for reading in the daemon's poller and call
    ``service()`` once per loop iteration; it never blocks."""

    def __init__(self, daemon, port: int, host: str = "127.0.0.1"):
        self.d = daemon
        self.sel = selectors.EpollSelector()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.listener.bind((host, port))
            except OSError as exc:
                why = "is in use by another process" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise MetricsPortError(
                    f"metrics port {host}:{port} {why}; pick another --metrics-port (0 picks a free one) "
                    "or leave it off", host=host, port=port, errno=exc.errno,
                ) from None
            self.listener.listen(LISTEN_BACKLOG)
            self.listener.setblocking(False)
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        except BaseException:
            self.listener.close()
            self.sel.close()
            raise
        self.address = self.listener.getsockname()
        self.conns: dict[int, _HttpConn] = {}

    def fileno(self) -> int:
        return self.sel.fileno()

    def service(self) -> None:
        for key, mask in self.sel.select(0):
            if key.data is None:
                self._accept()
            elif self.conns.get(key.data.sock.fileno()) is not key.data:
                continue  # closed earlier in this round (evicted by an accept)
            elif mask & selectors.EVENT_READ and key.data.out is None:
                self._read(key.data)
            elif mask & selectors.EVENT_WRITE:
                self._write(key.data)
        now = time.monotonic()
        for conn in list(self.conns.values()):
            if now >= conn.deadline:
                self._close(conn)

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        self.sel.close()
        self.listener.close()

    # ------------------------------------------------------------ internals
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave the rest in the backlog
                log.warning("metrics http: accept failed: %s", exc)
                return
            if len(self.conns) >= MAX_CONNECTIONS and not self._evict_idle():
                sock.close()  # every slot is busy answering: this one tries again later
                continue
            sock.setblocking(False)
            conn = _HttpConn(sock)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _evict_idle(self) -> bool:
        """Close the oldest connection that has not sent a whole request; False if none."""
        idle = [c for c in self.conns.values() if c.out is None]
        if not idle:
            return False
        self._close(min(idle, key=lambda c: c.accepted))
        return True

    def _close(self, conn: _HttpConn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _HttpConn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        end = conn.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbuf) > MAX_REQUEST:
                self._respond(conn, 431, b"request header too large\n")
            return
        self._respond(conn, *self._answer(bytes(conn.inbuf[:end])))

    def _answer(self, head: bytes) -> tuple:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, b"only GET\n", "text/plain; charset=utf-8", method == "HEAD"
        if target == "/":
            return 200, b"a2ad: metrics at /metrics\n", "text/plain; charset=utf-8", method == "HEAD"
        if target != "/metrics":
            return 404, b"not found; metrics are at /metrics\n", "text/plain; charset=utf-8", method == "HEAD"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        try:
            encoder, ctype = choose_encoder(accept)
            body = encoder(registry(self.d, http_named_jobs(self.d)))
        except Exception:
            log.exception("metrics http: render failed")
            return 500, b"internal error rendering metrics\n"
        return 200, body, ctype, method == "HEAD"

    def _respond(self, conn: _HttpConn, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                 head_only: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  431: "Request Header Fields Too Large", 500: "Internal Server Error"}[code]
        header = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n"
            + ("Allow: GET, HEAD\r\n" if code == 405 else "")
            + "\r\n"
        ).encode()
        conn.out = memoryview(header + (b"" if head_only else body))
        conn.deadline = time.monotonic() + REPLY_TIMEOUT
        self.sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _HttpConn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[n:]
        if not len(conn.out):
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(conn)
