"""Simulated nodes of a domain, many from one process, for domains larger than this machine
can run as real daemons.

Each simulated node holds a configured node's real CURVE keys (derived from the domain's
key as every daemon derives them), listens on that node's address (a ROUTER, CURVE server:
what the real daemons send it) and has a DEALER to every real daemon (what it sends), and
speaks the domain protocol as a daemon does for the part the tests need: heartbeats every
``heartbeat_interval``, its report of a job with its ranks (rows are real shared-memory
files, so real ranks on the real daemons map them), ``prepared`` for a prepare, its report
after a ``decide`` and after a ``release``. It sends what a daemon of this version sends:
its reports to the job's coordinator, and to the job's other holders only when they are
news for them (none are, in a rendezvous: the simulated nodes' ranks never die).

One thread drives every simulated node; ``close`` ends it and every socket. Counts of what
the simulated nodes received, by type, are in ``received``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgpack
import zmq

from a2ad import layout as L
from a2ad.daemon import domain as D
from a2ad.daemon.core.federation import coordinator_order


class SimNodes:
    def __init__(self, cfg: D.DomainConfig, names: list[str], real: list[str], shm: Path):
        self.cfg, self.names, self.real, self.shm = cfg, list(names), list(real), Path(shm)
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.MAX_SOCKETS, 8 * (len(names) * (len(real) + 1)) + 64)
        self.boot = {n: os.urandom(8) for n in names}
        self.routers: dict[zmq.Socket, str] = {}
        self.dealers: dict[tuple[str, str], zmq.Socket] = {}
        for n in names:
            pub, sec = D.node_keypair(cfg.key, cfg.name, n)
            r = self.ctx.socket(zmq.ROUTER)
            r.setsockopt(zmq.LINGER, 0)
            r.curve_server = True
            r.curve_secretkey, r.curve_publickey = sec, pub
            r.bind(cfg.node(n).address)
            self.routers[r] = n
            for t in real:
                d = self.ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.curve_secretkey, d.curve_publickey = sec, pub
                d.curve_serverkey = D.node_keypair(cfg.key, cfg.name, t)[0]
                d.connect(cfg.node(t).address)
                self.dealers[(n, t)] = d
        self.lock = threading.Lock()
        self.silent: set[str] = set()  # simulated nodes that stopped heartbeating (a loss)
        self.received: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        #: job -> {"spec": ..., "ranks": {node: [ranks]}, "seq": {node: n}, "state": {node: ...}}
        self.jobs: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sending
    def _send(self, node: str, to: str, t: str, **fields) -> None:
        env = {"v": D.DOMAIN_PROTOCOL, "dom": self.cfg.name, "from": node, "boot": self.boot[node], "t": t, **fields}
        try:
            self.dealers[(node, to)].send(msgpack.packb(env, use_bin_type=True), zmq.NOBLOCK)
            self.sent[t] = self.sent.get(t, 0) + 1
        except zmq.Again:
            pass

    def _report(self, job: str, node: str) -> None:
        j = self.jobs[job]
        j["seq"][node] = j["seq"].get(node, 0) + 1
        st = j["state"][node]
        ranks = [{"rank": r, "state": st["rank_state"], "waiting": st["waiting"], "pid": os.getpid(), "device": "host",
                  "deaths": 0, "attaches": st["attaches"], "size": j["row_stride"], "handle_type": "shm",
                  "handle": j["handles"][r], "handle_error": None} for r in j["ranks"][node]]
        body = {"job": job, "seq": j["seq"][node], "gone": False, "ep_size": j["ep_size"], "spec": j["spec"],
                "owner_uid": j["owner_uid"], "backend": "host", "row_stride": j["row_stride"],
                "size_per_rank": j["size_per_rank"], "confirmed": st["confirmed"], "generation": st["generation"],
                "rendezvous_count": st["rendezvous_count"], "needs_rearm": False, "abort": 0, "abort_rank": -1,
                "ranks": ranks}
        coord = coordinator_order(job, self.cfg.names)[0]
        self._send(node, coord, "job", **body)

    def join(self, job: str, info: dict, ranks: dict[str, list[int]]) -> None:
        """Simulated nodes join ``job`` (``info``: its job_info from a real daemon) with
        their ranks; each row is a shared-memory file a real rank can map."""
        with self.lock:
            handles = {}
            for rs in ranks.values():
                for r in rs:
                    h = os.urandom(32)
                    with open(self.shm / ("a2ad-" + h.hex()), "wb") as f:
                        f.truncate(info["row_stride"])
                    handles[r] = h
            self.jobs[job] = {"spec": info["spec"], "ep_size": info["ep_size"], "owner_uid": info["owner_uid"],
                              "row_stride": info["row_stride"], "size_per_rank": info["size_per_rank"],
                              "ranks": ranks, "handles": handles, "seq": {},
                              "state": {n: {"rank_state": L.RANK_JOINING, "waiting": "join", "attaches": 0,
                                            "confirmed": False, "generation": 0, "rendezvous_count": 0} for n in ranks}}
            for n in ranks:
                self._report(job, n)

    # ------------------------------------------------------------------ the loop
    def _handle(self, node: str, msg: dict) -> None:
        t = msg.get("t")
        self.received[t] = self.received.get(t, 0) + 1
        job = msg.get("job")
        j = self.jobs.get(job) if isinstance(job, str) else None
        if j is None or node not in j["ranks"]:
            return
        st = j["state"][node]
        src = msg["from"]
        if t == "decide":
            st["confirmed"] = True
            self._report(job, node)
        elif t == "prepare":
            st["confirmed"], st["generation"] = True, msg["generation"]
            self._report(job, node)
            self._send(node, src, "prepared", job=job, attempt=msg["attempt"], ok=True, why=None,
                       seq=[self.boot[node], j["seq"][node]])
        elif t == "release":
            st.update(rank_state=L.RANK_ATTACHED, waiting=None, attaches=st["attaches"] + 1,
                      rendezvous_count=msg["rendezvous_count"])
            self._report(job, node)

    def _run(self) -> None:
        poller = zmq.Poller()
        for r in self.routers:
            poller.register(r, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.cfg.heartbeat_interval
                with self.lock:
                    for n in self.names:
                        if n not in self.silent:
                            for t in self.real:
                                self._send(n, t, "hb")
            for sock, _ in poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
                node = self.routers[sock]
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = msgpack.unpackb(frames[-1], raw=False)
                    except Exception:
                        continue
                    with self.lock:
                        if node not in self.silent:
                            self._handle(node, msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in list(self.routers) + list(self.dealers.values()):
            s.close(0)
        self.ctx.term()
