"""Domain peers that lie, flood or collide, against real daemons federated on loopback.

A node of a domain holds the domain's key, so it is authenticated; what it says is still
checked. The lying peer here is a small test-side node: it holds a configured node's real
CURVE keys (derived from the domain config's key, as every daemon derives them), listens on
that node's address (what the daemons send it) and connects to a daemon's port (what it
sends), speaking the domain protocol message by message. That is the seam a compromised or
buggy daemon would use.

- a coordinator's release table with a bad device and size is refused (the held join stays
  held; a good release of the same attempt is then obeyed, so the fake peer really was the
  coordinator);
- ``decide``, ``prepare`` and ``release`` from a node that is not the job's coordinator are
  refused and logged (the join keeps waiting, the tentative job is kept);
- a node reporting another node's rank (or the receiving daemon's own) as its own is not
  believed: dropping the claim later aborts nothing;
- per-peer report state is bounded in count and bytes, extra fields are not stored, and all
  of it is freed when the peer is counted lost (the daemon's RSS is printed);
- two daemons running as the same node: detected, logged, shown by ``a2ad-ctl status`` and
  the metrics, no flapping; cleared once one of them stops;
- a frame of exactly the message cap gets through; one over it is logged and dropped while
  the link stays; one over the socket's own limit closes the link, logged;
- the report and release-table checks, field by field.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from a2ad import errors, layout as L
from a2ad.daemon import domain as D
from a2ad.daemon.core import federation as F
from helpers import DaemonProcess, free_port, rss_kib, wait_for
from test_domain import KEY, Cluster, _attach_in_thread, _rank_states, ctl, write_domain

DOM = "testdom"


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(names, **kw) -> Cluster:
        (tmp_path / f"c{len(made)}").mkdir()
        c = Cluster(tmp_path / f"c{len(made)}", names, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


class FakeNode:
    """Node ``name`` of the cluster's domain, played by the test: a ROUTER on its configured
    address (CURVE server with its real keys: the daemons' links to it authenticate it), a
    DEALER to ``target``'s port for what it sends, and a thread sending heartbeats on a
    second connection so that the daemon counts it up. ``close`` ends all of it."""

    def __init__(self, cluster: Cluster, name: str, target: str, heartbeat: float = 0.1):
        self.name, self.target = name, target
        self.boot = os.urandom(8)
        self.ctx = zmq.Context()
        pub, sec = D.node_keypair(KEY.encode(), DOM, name)
        server = D.node_keypair(KEY.encode(), DOM, target)[0]
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.curve_server = True
        self.router.curve_secretkey, self.router.curve_publickey = sec, pub
        self.router.bind(f"tcp://127.0.0.1:{cluster.ports[name]}")

        def dealer():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = sec, pub, server
            return s

        self.dealer = dealer()
        self.monitor = self.dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.dealer.connect(f"tcp://127.0.0.1:{cluster.ports[target]}")
        self._hb = dealer()
        self._hb.connect(f"tcp://127.0.0.1:{cluster.ports[target]}")
        self.beating = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat,), daemon=True)
        self._thread.start()
        self.seen: list[dict] = []

    def envelope(self, t: str, **fields) -> dict:
        return {"v": D.DOMAIN_PROTOCOL, "dom": DOM, "from": self.name, "boot": self.boot, "t": t, **fields}

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self.beating:
                self._hb.send(msgpack.packb(self.envelope("hb"), use_bin_type=True))

    def send(self, t: str, **fields) -> None:
        self.dealer.send(msgpack.packb(self.envelope(t, **fields), use_bin_type=True))

    def send_raw(self, data: bytes) -> None:
        self.dealer.send(data)

    def receive(self, pred, timeout: float, what: str) -> dict:
        """The first message from the daemon (newest kept in ``seen``) that ``pred`` accepts."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.router.poll(50):
                frames = self.router.recv_multipart()
                msg = msgpack.unpackb(frames[-1], raw=False)
                if msg.get("t") != "hb":
                    self.seen.append(msg)
                    if pred(msg):
                        return msg
        raise AssertionError(f"node {self.name} (test side) did not receive {what} within {timeout} s")

    def report_of(self, job: str, timeout: float = 15.0, pred=lambda m: True) -> dict:
        return self.receive(lambda m: m.get("t") == "job" and m.get("job") == job and not m.get("gone") and pred(m),
                            timeout, f"a report of job {job}")

    def disconnections(self) -> int:
        from zmq.utils.monitor import recv_monitor_message

        n = 0
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                n += 1
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        for s in (self.monitor, self.dealer, self._hb, self.router):
            s.close(0)
        self.ctx.term()


def _job(prefix: str, first: str, nodes: str) -> str:
    """A job name whose coordinator order over ``nodes`` starts with ``first``."""
    return next(f"{prefix}-{i}" for i in range(1000) if F.coordinator_order(f"{prefix}-{i}", nodes)[0] == first)


def _body(report: dict, **over) -> dict:
    """The job-wide fields of ``report`` (as a daemon sent it), for the fake node's own report."""
    keys = ("ep_size", "spec", "owner_uid", "backend", "row_stride", "size_per_rank", "confirmed", "generation",
            "rendezvous_count", "needs_rearm", "abort", "abort_rank")
    return dict({k: report[k] for k in keys}, **over)


def _rank(rank: int, size: int, handle: bytes, state: int = L.RANK_JOINING, waiting: str | None = "join", **over) -> dict:
    return dict({"rank": rank, "state": state, "waiting": waiting, "pid": os.getpid(), "device": "host", "deaths": 0,
                 "attaches": 0 if state == L.RANK_JOINING else 1, "size": size, "handle_type": "shm", "handle": handle,
                 "handle_error": None}, **over)


def _report_of(c: Cluster, node: str, job: str, pred=lambda info: True, timeout: float = 15.0) -> dict:
    """What ``node``'s report of ``job`` holds (its job-wide fields, its daemon instance and
    report number), read from its job_info: a node that neither coordinates a job nor holds
    rows of it is sent no reports of it, so the test's node cannot read them off the wire."""
    def ready():
        try:
            info = c.daemons[node].request("job_info", job=job)
        except errors.NoSuchJob:
            return None
        return info if info["domain"]["report"] is not None and pred(info) else None

    info = wait_for(ready, timeout, f"node {node}'s report of job {job}")
    dom = info["domain"]
    return {"ep_size": info["ep_size"], "spec": info["spec"], "owner_uid": info["owner_uid"], "backend": "host",
            "row_stride": info["row_stride"], "size_per_rank": info["size_per_rank"], "confirmed": not dom["tentative"],
            "generation": info["generation"], "rendezvous_count": dom["rendezvous_count"],
            "needs_rearm": info["state"] == "needs-rearm", "abort": 0, "abort_rank": -1,
            "boot": bytes.fromhex(dom["report"][0]), "seq": dom["report"][1],
            "ranks": [{"rank": r["rank"], "state": r["state"], "handle": os.urandom(32)} for r in info["ranks"]
                      if r.get("node") == node]}


def _peer(c: Cluster, node: str, peer: str) -> dict:
    return {x["name"]: x for x in c.domain(node)["nodes"]}[peer]


# ============================================================== the coordinator's release table
def test_a_bad_release_table_is_refused(cluster, monkeypatch):
    """The fake node c is the job's coordinator and runs its rendezvous with node a: decide,
    prepare, then a release whose table gives rank 1 ``device=12345, size=0``. Node a drops
    it (logged, counted) and keeps the join held; the same attempt's good release is obeyed
    and rank 0 maps c's row."""
    c = cluster(["a", "c"])
    job = _job("rel", "c", "ac")
    c.start("a")
    fake = FakeNode(c, "c", "a")
    got: dict = {}
    try:
        wait_for(lambda: c.states("a")["c"] == "up", 10, "the test's node c up for a")
        monkeypatch.setenv("A2AD_SHM_DIR", str(c.shm))
        th = _attach_in_thread(job, 0, 2, c.dirs["a"], got, timeout=30)
        rep = fake.report_of(job, pred=lambda m: any(r["rank"] == 0 and r["state"] == L.RANK_JOINING for r in m["ranks"]))
        handle = os.urandom(32)
        row = c.shm / ("a2ad-" + handle.hex())
        with open(row, "wb") as f:
            f.truncate(rep["row_stride"])
        fake.send("job", job=job, seq=1, gone=False, **_body(rep, confirmed=True),
                  ranks=[_rank(1, rep["row_stride"], handle)])
        fake.send("decide", job=job, decision={k: rep[k] for k in ("ep_size", "spec", "owner_uid", "backend", "row_stride")})
        attempt = 7
        for _ in range(50):
            rep = fake.report_of(job, pred=lambda m: m["confirmed"])
            fake.send("prepare", job=job, attempt=attempt, generation=rep["generation"], rearm=False,
                      seqs={"a": [rep["boot"], rep["seq"]], "c": [fake.boot, 1]})
            ans = fake.receive(lambda m: m.get("t") == "prepared" and m.get("attempt") == attempt, 10, "prepared")
            if ans["ok"]:
                break
            attempt += 1
        assert ans["ok"], ans
        table = [{"rank": 0, "node": "a", "device": "host", "size": rep["row_stride"], "handle_type": "shm",
                  "handle": rep["ranks"][0]["handle"]},
                 {"rank": 1, "node": "c", "device": 12345, "size": 0, "handle_type": "shm", "handle": handle}]
        bad0 = _peer(c, "a", "c")["bad_messages"]
        fake.send("release", job=job, attempt=attempt, generation=rep["generation"], rendezvous_count=1, table=table)
        time.sleep(0.5)
        assert 0 not in got, got  # still held
        wait_for(lambda: _peer(c, "a", "c")["bad_messages"] > bad0, 10, "a dropping the bad release")
        assert _rank_states(c.daemons["a"], job)[0] == ("joining", "a")
        log = c.daemons["a"].log()
        assert "bad release" in log and "device" in log, log[-3000:]
        info = c.daemons["a"].request("job_info", job=job)
        assert info["ranks"][1]["device"] == "host", info["ranks"][1]
        # the same attempt, with a table that checks out: obeyed
        table[1].update(device="host", size=rep["row_stride"])
        fake.send("release", job=job, attempt=attempt, generation=rep["generation"], rendezvous_count=1, table=table)
        th.join(30)
        att = got[0]
        assert not isinstance(att, Exception), att
        att.workspace[1, 4096] = 9
        with open(row, "rb") as f:
            f.seek(4096)
            assert f.read(1) == b"\x09"
        att.close()
    finally:
        for a in got.values():
            if not isinstance(a, Exception):
                a.close()
        fake.close()
    print(f"\nbad release table, as node a logged it: "
          f"{next(x for x in c.daemons['a'].log().splitlines() if 'bad release' in x).split('a2ad: ')[-1]}")


# =========================================================== only the coordinator decides
def test_decide_prepare_release_from_a_non_coordinator_are_refused(cluster):
    """Job coordinated by node b (configured, not started: a counts it possibly up for the
    10 s loss bound). The fake node c sends a decide with another spec, a prepare, a
    release, a refusal of a's join and a rank refusal: each refused and logged by a; rank 0's join keeps waiting and ends in a
    RendezvousTimeout, not in the SpecMismatch or BackendError the lies would have caused."""
    c = cluster(["a", "b", "c"], interval=0.5, misses=20)
    job = _job("nc", "b", "abc")
    c.start("a")
    fake = FakeNode(c, "c", "a")
    got: dict = {}
    try:
        wait_for(lambda: c.states("a")["c"] == "up", 10, "the test's node c up for a")
        th = _attach_in_thread(job, 0, 2, c.dirs["a"], got, timeout=6)
        rep = _report_of(c, "a", job)
        assert c.daemons["a"].request("job_info", job=job)["domain"]["coordinator"] == "b"
        # c neither coordinates the job nor holds rows of it: a sends it no report of it
        with pytest.raises(AssertionError, match="did not receive"):
            fake.report_of(job, timeout=1.0)
        decision = {k: rep[k] for k in ("ep_size", "spec", "owner_uid", "backend", "row_stride")}
        decision["spec"] = dict(decision["spec"], top_k=2)
        fake.send("decide", job=job, decision=decision)
        fake.send("prepare", job=job, attempt=5, generation=rep["generation"], rearm=True,
                  seqs={"a": [rep["boot"], rep["seq"]]})
        ans = fake.receive(lambda m: m.get("t") == "prepared", 10, "a's answer to the prepare")
        assert ans["ok"] is False and "coordinator" in ans["why"], ans
        fake.send("release", job=job, attempt=5, generation=rep["generation"] + 1, rendezvous_count=1,
                  table=[{"rank": 0, "node": "a", "device": "host", "size": rep["row_stride"], "handle_type": "shm",
                          "handle": rep["ranks"][0]["handle"]}])
        # a refusal of another node's join, and a rank refusal: the coordinator's to send, too
        fake.send("refuse", job=job, kind="spec", field="top_k", job_value=2, requested=1, node="a",
                  decision=decision, message=None)
        fake.send("refuse_rank", job=job, rank=0, holder="c")
        wait_for(lambda: c.daemons["a"].log().count("not the job's coordinator") >= 5, 10, "a logging the refusals")
        time.sleep(0.3)
        info = c.daemons["a"].request("job_info", job=job)
        assert info["ranks"][0]["state"] == "joining" and info["domain"]["tentative"], info
        assert info["generation"] == 0 and info["spec"]["top_k"] == 1, info
        th.join(30)
        assert isinstance(got[0], errors.RendezvousTimeout), got
        log = c.daemons["a"].log()
        for t in ("decide", "prepare", "release", "refuse", "refuse_rank"):
            assert re.search(rf"refused a '{t}' of job {job} from node c, which is not the job's coordinator", log), log[-3000:]
        assert c.daemons["a"].request("domain")["federation"]["refused_messages"] >= 5
    finally:
        fake.close()


# ============================================================ a node is believed about its own ranks
def test_a_node_is_believed_only_about_its_own_ranks(cluster, monkeypatch):
    """Ranks 0 (node a) and 1 (node b) of a raise job are attached. The fake node c reports
    both as its own, then drops them: neither a nor b believes it (logged), the job is not
    aborted and its ranks stay where they are."""
    c = cluster(["a", "b", "c"])
    monkeypatch.setenv("A2AD_SHM_DIR", str(c.shm))
    job = _job("own", "a", "abc")
    c.start("a")
    c.start("b")
    fake = FakeNode(c, "c", "a")
    got: dict = {}
    try:
        c.wait_up("ab")
        wait_for(lambda: c.states("a")["c"] == "up", 10, "the test's node c up for a")
        ths = [_attach_in_thread(job, 0, 2, c.dirs["a"], got), _attach_in_thread(job, 1, 2, c.dirs["b"], got)]
        for th in ths:
            th.join(30)
        assert all(not isinstance(got[r], Exception) for r in (0, 1)), got
        rep = _report_of(c, "a", job, pred=lambda i: all(r["state"] == "attached" for r in i["ranks"]))
        size = rep["row_stride"]
        claims = [_rank(r, size, os.urandom(32), state=L.RANK_ATTACHED, waiting=None) for r in (0, 1)]
        fake.send("job", job=job, seq=1, gone=False, **_body(rep), ranks=claims)
        fake.send("job", job=job, seq=2, gone=False, **_body(rep), ranks=[])
        fake.send("job", job=job, seq=3, gone=True)
        time.sleep(0.5)
        info = c.daemons["a"].request("job_info", job=job)
        assert info["abort"] == "none", info
        wait_for(lambda: c.daemons["a"].log().count("which is node") >= 1, 10, "a refusing c's claims")
        assert [(r["state"], r.get("node")) for r in info["ranks"]] == [("attached", "a"), ("attached", "b")], info["ranks"]
        log = c.daemons["a"].log()
        assert "node c reports rank 1 as its own, which is node b's: not believed" in log, log[-3000:]
        assert "node c reports rank 0 as its own, which is this node's: not believed" in log, log[-3000:]
        # the data plane never noticed
        got[0].workspace[0, 5000] = 3
        assert int(got[1].workspace[0, 5000]) == 3
        assert got[0].control.abort_word == 0 and got[1].control.abort_word == 0
    finally:
        for a in got.values():
            if not isinstance(a, Exception):
                a.close()
        fake.close()


# ============================================================= per-peer state: bounded, freed
def test_per_peer_reports_are_bounded_and_freed_when_the_peer_is_lost(cluster):
    """The fake node c floods a with reports: 100 of nearly 1 MiB each with extra fields
    (kept whole before: +100 MiB), then legitimately large reports past the per-peer byte
    bound, then small ones past the count bound. Extra fields are not stored, the bounds
    hold (each refusal logged), and all of it goes once c is counted lost."""
    c = cluster(["a", "c"])
    c.start("a")
    fake = FakeNode(c, "c", "a")
    pid = c.daemons["a"].pid
    try:
        wait_for(lambda: c.states("a")["c"] == "up", 10, "the test's node c up for a")
        spec = {"max_num_tokens": 4, "top_k": 1, "num_experts": 2, "workspace_size_per_rank": 1 << 16,
                "on_peer_loss": "raise"}
        base = {"ep_size": 64, "spec": dict(spec, num_experts=64), "owner_uid": os.getuid(), "backend": "host",
                "row_stride": 1 << 16, "size_per_rank": 1 << 16, "confirmed": True, "generation": 0,
                "rendezvous_count": 0, "needs_rearm": False, "abort": 0, "abort_rank": -1}
        rss0 = rss_kib(pid)

        def held():
            return c.domain("a")["federation"]["peer_reports"].get("c", {"jobs": 0, "bytes": 0})

        pad = b"p" * (D.MAX_MESSAGE - 4096)
        for i in range(100):
            fake.send("job", job=f"pad-{i}", seq=1, gone=False, **base, ranks=[], pad=pad, more={"x": pad[:1000]})
        wait_for(lambda: held()["jobs"] == 100, 60, "a holding 100 reports of c")
        rss1 = rss_kib(pid)
        assert held()["bytes"] < 100 * 4096, held()
        # large but valid: 64 ranks, each with a long handle error
        big = [_rank(r, 1 << 16, None, handle_error="e" * F.MAX_HANDLE_ERROR) for r in range(64)]
        n_big = F.MAX_PEER_REPORT_BYTES // (64 * F.MAX_HANDLE_ERROR) + 20
        for i in range(n_big):
            fake.send("job", job=f"big-{i}", seq=1, gone=False, **base, ranks=big)
        wait_for(lambda: "over the bound of" in c.daemons["a"].log(), 60, "a refusing reports over the byte bound")
        fake.send("hb")
        time.sleep(0.5)
        h = held()
        assert h["bytes"] <= F.MAX_PEER_REPORT_BYTES and h["jobs"] < 100 + n_big, h
        rss2 = rss_kib(pid)
        for i in range(n_big):  # c says it holds them no more: their bytes are freed
            fake.send("job", job=f"big-{i}", seq=2, gone=True)
        wait_for(lambda: held()["jobs"] == 100, 30, "a freeing the large reports c no longer holds")
        # small ones, past the count bound
        for i in range(F.MAX_PEER_JOBS + 10):
            fake.send("job", job=f"n-{i}", seq=1, gone=False, **base, ranks=[])
        wait_for(lambda: held()["jobs"] == F.MAX_PEER_JOBS, 120, "a holding as many reports of c as the bound")
        time.sleep(0.5)
        assert held()["jobs"] == F.MAX_PEER_JOBS
        log = c.daemons["a"].log()
        assert f"node c already has {F.MAX_PEER_JOBS} job reports here" in log, log[-2000:]
        rss3 = rss_kib(pid)
        fake.beating = False  # c goes silent: counted lost after the bound, its reports freed
        wait_for(lambda: c.states("a")["c"] == "down", 10, "a counting c lost")
        wait_for(lambda: held()["jobs"] == 0 and c.domain("a")["federation"]["jobs"] == 0, 10,
                 "a freeing c's reports")
        rss4 = rss_kib(pid)
    finally:
        fake.close()
    print(f"\nnode a's RSS: {rss0 // 1024} MiB before; {rss1 // 1024} MiB after 100 reports of ~1 MiB with extra "
          f"fields; {rss2 // 1024} MiB after {n_big} large ones (byte bound {F.MAX_PEER_REPORT_BYTES >> 20} MiB); "
          f"{rss3 // 1024} MiB at the count bound ({F.MAX_PEER_JOBS}); {rss4 // 1024} MiB once c was lost "
          f"(held reports 0)")
    assert rss1 - rss0 < 50 * 1024, (rss0, rss1)


# ==================================================================== a node-name collision
def test_two_daemons_as_one_node_are_detected(cluster):
    """A second daemon runs as node b (its config gives b another port, the key is the
    same): node a detects the collision, logs it once, shows it in status and metrics, stays
    with one instance (no flapping); once the second stops, the collision clears."""
    c = cluster(["a", "b"])
    c.start("a")
    c.start("b")
    c.wait_up("ab")
    ports2 = dict(c.ports, b=free_port())
    cfg2 = write_domain(c.tmp, ports2, tag="-b2")
    d2 = Path(tempfile.mkdtemp(prefix="a2ad-b2-"))
    c.dirs["b2"] = d2
    b2 = DaemonProcess(d2, "--backend", "host", "--grace", "5", "--domain", str(cfg2), "--node", "b",
                       env={**os.environ, "A2AD_SHM_DIR": str(c.shm)})
    c.daemons["b2"] = b2
    b2.start(timeout=30)
    wait_for(lambda: "two daemons run as node b" in c.daemons["a"].log(), 15, "a detecting the collision")
    t0 = time.monotonic()
    time.sleep(3)
    log = c.daemons["a"].log()
    restarts = log.count("node b restarted")
    assert restarts <= 2, log[-3000:]
    peer = _peer(c, "a", "b")
    assert peer["name_collision"] and peer["state"] == "up" and peer["collision_drops"] > 0, peer
    st = ctl(c.dirs["a"], "status")
    assert st.returncode == 0 and "two daemons run as node b" in st.stdout, st.stdout + st.stderr
    js = ctl(c.dirs["a"], "status", "--json")
    assert '"name_collisions": [\n' in js.stdout or '"name_collisions": ["b"]' in js.stdout.replace("\n", ""), js.stdout
    metrics = c.daemons["a"].request("metrics")["text"]
    assert 'a2ad_domain_peer_name_collision{node="b"} 1.0' in metrics, metrics
    print(f"\n{time.monotonic() - t0:.1f} s with two daemons as node b: 'node b restarted' logged {restarts} time(s); "
          f"{peer['collision_drops']} messages of the second instance dropped\n"
          f"{next(x for x in log.splitlines() if 'two daemons run as node b' in x).split('a2ad: ')[-1]}\n"
          f"a2ad-ctl status: {[x for x in st.stdout.splitlines() if 'two daemons' in x][0].strip()}")
    b2.stop()
    wait_for(lambda: 'a2ad_domain_peer_name_collision{node="b"} 0.0' in c.daemons["a"].request("metrics")["text"],
             10, "the collision to clear")
    # whichever of the two a listened to, the one left is node b for it now
    wait_for(lambda: _peer(c, "a", "b")["state"] == "up" and not _peer(c, "a", "b")["name_collision"], 10,
             "a hearing the remaining daemon as node b")
    assert "two daemons run as node b" not in ctl(c.dirs["a"], "status").stdout


# ======================================================================= the frame cap
def test_frame_cap_counts_curve_overhead_and_oversize_is_logged(cluster):
    """A message of exactly MAX_MESSAGE bytes (what a sender's check allows) arrives; one a
    byte over is dropped and logged, and the link stays; one over the socket's own limit
    closes the link, and that is logged."""
    c = cluster(["a", "c"])
    c.start("a")
    fake = FakeNode(c, "c", "a")
    try:
        wait_for(lambda: c.states("a")["c"] == "up", 10, "the test's node c up for a")
        wait_for(lambda: fake.monitor.poll(0), 5, "the link's handshake")
        fake.disconnections()

        def padded(total: int) -> bytes:
            n = total - len(msgpack.packb(fake.envelope("sync", jobs=[], pad=b""), use_bin_type=True))
            for k in range(n, n - 8, -1):  # the bin header grows with the length
                data = msgpack.packb(fake.envelope("sync", jobs=[], pad=b"x" * k), use_bin_type=True)
                if len(data) == total:
                    return data
            raise AssertionError(total)

        rx0 = _peer(c, "a", "c")["messages_received"]
        fake.send_raw(padded(D.MAX_MESSAGE))
        wait_for(lambda: _peer(c, "a", "c")["messages_received"] == rx0 + 1, 10, "a receiving the 1 MiB message")
        bad0 = _peer(c, "a", "c")["bad_messages"]
        fake.send_raw(padded(D.MAX_MESSAGE + 1))
        wait_for(lambda: _peer(c, "a", "c")["bad_messages"] == bad0 + 1, 10, "a dropping the message over the cap")
        fake.send("sync", jobs=[])
        wait_for(lambda: _peer(c, "a", "c")["messages_received"] == rx0 + 2, 10, "a message after it")
        assert fake.disconnections() == 0
        log = c.daemons["a"].log()
        assert f"a frame of {D.MAX_MESSAGE + 1} bytes, over the {D.MAX_MESSAGE}-byte cap" in log, log[-2000:]
        # past the socket's own limit libzmq closes the connection: that is logged too
        fake.send_raw(b"x" * (D.MAX_DOMAIN_FRAME + 1))
        wait_for(lambda: f"sent a frame over the {D.MAX_DOMAIN_FRAME}-byte socket limit" in c.daemons["a"].log(), 10,
                 "a logging the closed connection")
        wait_for(lambda: fake.disconnections() >= 1, 10, "the test node's link closed")
        assert c.daemons["a"].request("hello")["pid"] == c.daemons["a"].pid
    finally:
        fake.close()


# ================================================================ the checks, one by one
def test_report_and_release_table_checks():
    """What a report and a release table are checked against, field by field; a report is
    kept as its checked copy (extra fields dropped, in the report and in its rank records)."""
    from types import SimpleNamespace

    spec = {"max_num_tokens": 4, "top_k": 1, "num_experts": 2, "workspace_size_per_rank": 10000,
            "on_peer_loss": "raise"}
    rank = _rank(1, 12288, b"h" * 32)
    good = {"job": "j", "seq": 3, "gone": False, "ep_size": 2, "spec": spec, "owner_uid": 1000, "backend": "host",
            "row_stride": 12288, "size_per_rank": 10000, "confirmed": True, "generation": 4, "rendezvous_count": 1,
            "needs_rearm": False, "abort": 0, "abort_rank": -1, "ranks": [dict(rank, colour="red")], "pad": b"x" * 100,
            "t": "job", "v": 1}
    kept = F._check_report(good)
    assert "pad" not in kept and "t" not in kept and set(kept["ranks"][0]) == set(F.RANK_FIELDS)
    assert set(kept) == {"job", "seq", "gone", *F.REPORT_FIELDS, "ranks", "admits_known"}
    assert F._check_report({"job": "j", "seq": 4, "gone": True, "junk": 1}) == {"job": "j", "seq": 4, "gone": True}

    def bad(match, **over):
        with pytest.raises(ValueError, match=match):
            F._check_report(dict(good, **over))

    def bad_rank(match, **over):
        bad(match, ranks=[dict(rank, **over)])

    bad_rank("bad device", device=12345)
    bad_rank("bad device", device="")
    bad_rank("bad device", device="x" * 129)
    bad_rank(r"bad row size \(must be in \[10000, 12288\]\)", size=0)
    bad_rank("bad row size", size=12289)
    bad_rank("bad rank", rank=2)
    bad_rank("bad state", state=True)
    bad_rank("bad state", state=99)
    bad_rank("bad pid", pid=0)
    bad_rank("bad counts", deaths=-1)
    bad_rank("bad handle", handle=b"")
    bad_rank("bad handle", handle=b"h" * 257)
    bad_rank("bad handle type", handle_type="")
    bad_rank("bad handle error", handle_error="e" * (F.MAX_HANDLE_ERROR + 1))
    bad("bad ranks", ranks=[rank, rank, rank])
    bad("bad rank", ranks=[rank, dict(rank)])
    bad("bad size_per_rank", size_per_rank=9999)
    bad("bad row_stride", row_stride=9999)
    bad("bad abort word", abort=77)
    bad("bad abort rank", abort_rank=2)
    bad("bad backend", backend="h" * 17)
    bad("bad generation", generation=-1)
    bad("bad owner_uid", owner_uid=2**40)
    bad("spec not normalized", spec={k: v for k, v in spec.items() if k != "on_peer_loss"})
    bad("seq", seq=0)
    # re-admissions across nodes: a rank's readmit flag, the report's [rank, deaths] pairs;
    # both absent (a daemon from before them) read as none
    assert kept["admits"] == [] and kept["ranks"][0]["readmit"] is False and kept["admits_known"] is False
    newer = F._check_report(dict(good, admits=[[1, 3]], ranks=[dict(rank, readmit=True)]))
    assert newer["admits"] == [[1, 3]] and newer["admits_known"] is True and newer["ranks"][0]["readmit"] is True
    bad_rank("bad readmit", readmit=1)
    bad("bad admits", admits={"1": 3})
    bad("bad admits", admits=[[0, 1]] * 3)
    bad(r"bad admits entry \(a \[rank, deaths\] pair\)", admits=[[2, 0]])
    bad("bad admits entry", admits=[[0, -1]])
    bad("bad admits entry", admits=[[0, 1, 2]])
    job = SimpleNamespace(ep_size=2, size_per_rank=10000, row_stride=12288)
    table = [{"rank": r, "node": "a", "device": "host", "size": 12288, "handle_type": "shm", "handle": b"h" * 32}
             for r in range(2)]
    F._check_table(table, job, ["a", "b"])
    for r1, match in ((dict(device=12345), "rank 1's device 12345"), (dict(size=0), "rank 1's row size 0"),
                      (dict(node="zz"), "rank 1's node 'zz' is not a node of the domain"),
                      (dict(rank=0), r"rank 0"), (dict(handle="str"), "rank 1's handle")):
        with pytest.raises(ValueError, match=match):
            F._check_table([table[0], dict(table[1], **r1)], job, ["a", "b"])
    with pytest.raises(ValueError, match="not 2 records"):
        F._check_table(table[:1], job, ["a", "b"])


def test_a_replacement_across_nodes_needs_every_node_with_live_ranks_to_answer_readmissions():
    """Federation.readmit_capable: a replacement is let in without a re-arm only when every
    other node with live ranks of the job sends reports that carry ``admits`` (a daemon from
    before re-admissions across nodes neither lists nor answers them: during a rolling
    upgrade the replacement comes back through a re-arm instead); a node whose ranks are all
    dead does not count, nor does one whose report is not kept here."""
    from types import SimpleNamespace

    spec = {"max_num_tokens": 4, "top_k": 1, "num_experts": 2, "workspace_size_per_rank": 10000,
            "on_peer_loss": "degrade"}
    base = {"job": "j", "seq": 3, "gone": False, "ep_size": 3, "spec": spec, "owner_uid": 1000, "backend": "host",
            "row_stride": 12288, "size_per_rank": 10000, "confirmed": True, "generation": 0, "rendezvous_count": 1,
            "needs_rearm": False, "abort": 0, "abort_rank": -1, "ranks": []}
    new, old = F._check_report(dict(base, admits=[])), F._check_report(base)
    from a2ad.daemon.core.policy import readmit_nodes

    fed = object.__new__(F.Federation)
    fed.jobs = {"j": F.FedJob("j", views={"b": new, "c": old})}
    slots = [SimpleNamespace(node=None, live=True), SimpleNamespace(node="b", live=True),
             SimpleNamespace(node="c", live=True)]
    job = SimpleNamespace(name="j", slots=slots)

    def capable():  # (the registry names the nodes with live ranks of the job)
        return fed.readmit_capable(job.name, readmit_nodes(job))

    assert not capable()  # node c's daemon predates them
    slots[2].live = False
    assert capable()  # c holds no live rank: only b must answer, and it does
    slots[1].node = "d"
    assert capable()  # no report of d's kept here: nothing says it predates them
    slots[2].live = True
    assert not capable()
