"""Multi-node domains, on one machine: several real ``a2ad serve`` daemons, each playing one
node of a domain (its own runtime folder, its own TCP port on 127.0.0.1 picked free at test
time, one domain config file), real client processes attached to their own node's daemon,
real sockets and shared memory (host backend: a row another daemon holds is mapped by its
shared-memory name, in a per-test folder).

- a 6-rank job over 3 daemons runs 100 rounds checked against client/reference.py;
- a spec mismatch across nodes is refused on every node, naming the field and both values;
  simultaneous first joins with different specs agree on one winner; a rank joined on two
  nodes stays with the first (RankTaken on the other);
- a daemon with another domain key cannot join the domain (refused and logged on both
  sides; its messages never reach the registry), and a peer's key that is not a node's is
  refused by the ZAP handler; hostile messages from a node are dropped and logged;
- kill -9 of one daemon and its ranks: the others raise (raise job) or degrade (degrade job)
  within the heartbeat bound (printed); the daemon restarts, rejoins, a replacement pair of
  ranks joins, verified traffic resumes;
- a job that spans nodes whose rows have no fabric handle is refused on every node with the
  reason; a job of one node still runs;
- the rendezvous time of a 64-rank job over 4 daemons (scripts/domain_rendezvous.py);
- the CUDA fabric paths up to the driver call (no GPU here): the IMEX refusal text, the
  backend's fallback, export/import argument plumbing.

Every wait is bounded, and every daemon and rank process is stopped even when a test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from a2ad import errors, layout as L, protocol
from helpers import REPO, DaemonProcess, RankReports, free_port, reap_keeper, wait_for

HB_INTERVAL, HB_MISSES = 0.25, 4  # a node is counted lost after 1 s of silence
LOSS_BOUND = HB_INTERVAL * HB_MISSES
HIDDEN, TOP_K, EXPERTS, MAX_T = 32, 2, 12, 8
KEY = "k" * 20 + "-a2ad-domain-test-key-" + "q" * 10


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def write_domain(folder: Path, nodes: dict[str, int], key: str = KEY, name: str = "testdom",
                 interval: float = HB_INTERVAL, misses: int = HB_MISSES, tag: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kf = folder / f"domain{tag}.key"
    kf.write_text(key + "\n")
    kf.chmod(0o600)
    lines = ["[domain]", f'name = "{name}"', f'key_file = "{kf.name}"', f"heartbeat_interval = {interval}",
             f"heartbeat_misses = {misses}", ""]
    for n, port in nodes.items():
        lines += ["[[node]]", f'name = "{n}"', f'address = "tcp://127.0.0.1:{port}"', ""]
    path = folder / f"domain{tag}.toml"
    path.write_text("\n".join(lines))
    return path


def ctl(runtime_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), *args],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))


class Cluster:
    """The daemons of one domain on this machine. ``close`` stops every one (SIGTERM, then
    SIGKILL), reaps their fd keepers and removes their folders, whatever state they are in."""

    start_timeout = 30.0  # for a daemon to answer once started

    def __init__(self, tmp: Path, names, **domain_kw):
        self.tmp = tmp
        self.shm = tmp / "shm"
        self.shm.mkdir()
        self.ports = {n: free_port() for n in names}
        self.config = write_domain(tmp, self.ports, **domain_kw)
        self.dirs = {n: Path(tempfile.mkdtemp(prefix=f"a2ad-{n}-")) for n in names}
        self.daemons: dict[str, DaemonProcess] = {}

    def start(self, node: str, config: Path | None = None, env: dict | None = None, *args: str) -> DaemonProcess:
        d = DaemonProcess(self.dirs[node], "--backend", "host", "--grace", "5", "--domain", str(config or self.config),
                          "--node", node, *args, env={**os.environ, "A2AD_SHM_DIR": str(self.shm), **(env or {})})
        self.daemons[node] = d
        d.start(timeout=self.start_timeout)
        return d

    def domain(self, node: str) -> dict:
        return self.daemons[node].request("domain")

    def links(self, node: str) -> dict[str, dict]:
        """What ``node``'s daemon says of each of its peer links (its ``domain`` status), by peer."""
        return {x["name"]: x for x in self.domain(node)["nodes"]}

    def log_lines(self, nodes, keys) -> list[str]:
        """The lines of the logs of ``nodes``' daemons that contain any of ``keys``, each as
        ``node: line``."""
        out = []
        for n in nodes:
            try:
                lines = self.daemons[n].log().splitlines()
            except OSError as exc:
                out.append(f"{n}: (log unreadable: {exc})")
                continue
            out += [f"{n}: {ln}" for ln in lines if any(k in ln for k in keys)]
        return out

    def states(self, node: str) -> dict[str, str]:
        return {n["name"]: n["state"] for n in self.domain(node)["nodes"]}

    def wait_up(self, nodes, timeout: float = 20.0) -> None:
        for n in nodes:
            wait_for(lambda: all(self.states(n)[m] in ("up", "self") for m in nodes), timeout,
                     f"node {n} to see {sorted(nodes)} up")

    def close(self) -> None:
        for d in self.daemons.values():
            try:
                d.stop(timeout=10)
            except Exception:
                d.kill9()
        for rd in self.dirs.values():
            reap_keeper(rd)
            shutil.rmtree(rd, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(names, **kw) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", names, **kw)
        made.append(c)
        return c

    (tmp_path / "c0").mkdir()
    yield make
    for c in made:
        c.close()


def _att_kw(rd, **kw):
    return dict(dict(runtime_dir=rd, max_num_tokens=4, top_k=1, num_experts=6, workspace_size_per_rank=1 << 16,
                     timeout=20), **kw)


def _attach_in_thread(job, rank, ep, rd, into, **kw):
    from a2ad.client import attach

    def run():
        try:
            a = attach(job, rank, ep, **_att_kw(rd, **kw))
            into[rank] = a
        except Exception as exc:  # noqa: BLE001 - the test looks at what came back
            into[rank] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _rank_states(d: DaemonProcess, job: str) -> dict[int, tuple[str, str | None]]:
    try:
        info = d.request("job_info", job=job)
    except errors.NoSuchJob:
        return {}
    return {r["rank"]: (r["state"], r.get("node")) for r in info["ranks"]}


# ============================================================================ units
def test_config_file_and_keys(tmp_path):
    from a2ad.daemon import domain as D

    path = write_domain(tmp_path, {"n1": 7001, "n2": 7002, "n3": 7003}, interval=0.5, misses=3)
    cfg = D.load_config(path)
    assert cfg.name == "testdom" and cfg.names == ["n1", "n2", "n3"] and cfg.loss_bound == 1.5
    assert cfg.node("n2").address == "tcp://127.0.0.1:7002" and cfg.node("n2").bind == "tcp://127.0.0.1:7002"
    with pytest.raises(D.DomainConfigError, match="node 'n9' is not in domain"):
        cfg.node("n9")
    # keys: deterministic, one pair per node, depending on the key and the domain's name
    pub, sec = D.node_keypair(cfg.key, cfg.name, "n1")
    assert (pub, sec) == D.node_keypair(KEY.encode(), "testdom", "n1")
    import zmq

    assert zmq.curve_public(sec) == pub and len(pub) == 40
    assert D.node_keypair(cfg.key, cfg.name, "n2")[0] != pub
    assert D.node_keypair(b"another key of enough length, 32+ bytes", cfg.name, "n1")[0] != pub
    assert D.node_keypair(cfg.key, "otherdom", "n1")[0] != pub

    def bad(text: str, match: str, key_mode=0o600):
        p = tmp_path / "bad.toml"
        p.write_text(text)
        p.chmod(0o600)
        (tmp_path / "k").write_text(KEY)
        (tmp_path / "k").chmod(key_mode)
        with pytest.raises(D.DomainConfigError, match=match):
            D.load_config(p)

    node = '[[node]]\nname = "a"\naddress = "tcp://127.0.0.1:7001"\n'
    bad('[domain]\nname = "d"\n' + node, "exactly one of key_file")
    bad('[domain]\nname = "d"\nkey = "short"\n' + node, "needs at least 32")
    bad('[domain]\nname = "d"\nkey_file = "k"\n' + node, "must be readable by its owner only", key_mode=0o644)
    bad('[domain]\nname = "d"\nkey_file = "k"\n', "at least one")
    bad('[domain]\nname = "d"\nkey_file = "k"\n' + node + node, "listed twice")
    bad('[domain]\nname = "d"\nkey_file = "k"\n[[node]]\nname = "a"\naddress = "http://x:1"\n', "tcp://HOST:PORT")
    bad('[domain]\nname = "d"\nkey_file = "k"\nheartbeat_misses = 0\n' + node, "heartbeat_misses")
    bad('[domain]\nname = "d"\nkey_file = "k"\ncolour = 1\n' + node, "unknown key")
    bad('[domain]\nname = "bad name"\nkey_file = "k"\n' + node, "name must be")
    bad("[domain\n", "not valid TOML")
    # the example in the repository reads, apart from its key file
    ex = (REPO / "examples" / "domain.toml").read_text().replace("/etc/a2ad/domain.key", str(tmp_path / "k"))
    (tmp_path / "k").chmod(0o600)
    (tmp_path / "ex.toml").write_text(ex)
    cfg = D.load_config(tmp_path / "ex.toml")
    assert len(cfg.nodes) == 4 and cfg.heartbeat_interval == 1.0


def test_serve_refuses_a_bad_domain_setup(tmp_path):
    """A node missing from the file, a file that does not exist, --node without --domain: the
    daemon exits 1 saying so."""
    rd = Path(tempfile.mkdtemp(prefix="a2ad-bad-"))
    try:
        path = str(write_domain(tmp_path, {"a": free_port()}))
        for argv, text in ((["--domain", path, "--node", "zz"], "node 'zz' is not in domain 'testdom'"),
                           (["--domain", str(tmp_path / "none.toml"), "--node", "a"], "cannot read it"),
                           (["--node", "a"], "--node names this node in a --domain file")):
            p = subprocess.run([sys.executable, "-m", "a2ad.tools.cli", "serve", "--runtime-dir", str(rd),
                                "--backend", "host", *argv], capture_output=True, text=True, timeout=60, cwd=str(REPO))
            assert p.returncode == 1 and text in p.stderr, p.stderr
    finally:
        reap_keeper(rd)
        shutil.rmtree(rd, ignore_errors=True)


def test_state_file_records_remote_ranks():
    """A domain job's record: this node's name, its rows' fabric handles, the other nodes'
    ranks as they last reported them; a record that puts a row on a remote rank is refused."""
    from a2ad.daemon import persist
    from a2ad.daemon.backends.base import Allocation
    from a2ad.daemon.core.registry import Job, RankSlot

    slots = [RankSlot(rank=0, state=L.RANK_ATTACHED, pid=11, uid=0, device="host", lease=b"l" * 32,
                      alloc=Allocation(fd=-1, size=4096, device="host", handle_type="shm",
                                       extra={"fabric_handle": b"h" * 32})),
             RankSlot(rank=1, state=L.RANK_ATTACHED, pid=12, device="host", node="b",
                      remote={"size": 4096, "handle_type": "shm", "handle": b"g" * 32, "handle_error": None})]
    job = Job(name="rec", ep_size=2, spec={"max_num_tokens": 4, "top_k": 1, "num_experts": 2,
                                           "workspace_size_per_rank": 4096}, size_per_rank=4096, row_stride=4096,
              aux=L.aux_layout(2, 4), control_fd=-1, control=None, slots=slots, domain=True, this_node="a")
    rec = persist.job_record(job)
    assert persist.check_job_record(rec) is None, persist.check_job_record(rec)
    assert rec["domain"] == {"node": "a", "confirmed": True}
    assert rec["slots"][0]["alloc"]["fabric"] == b"h" * 32 and "node" not in rec["slots"][0]
    assert rec["slots"][1]["node"] == "b" and rec["slots"][1]["remote"]["handle"] == b"g" * 32
    assert rec["slots"][1]["lease"] is None and rec["slots"][1]["alloc"] is None
    bad = dict(rec, slots=[rec["slots"][0], dict(rec["slots"][1], alloc={"size": 4096, "handle_type": "shm"})])
    assert "a remote rank has no row here" in persist.check_job_record(bad)
    assert "bad domain" in persist.check_job_record(dict(rec, domain={"node": 3}))


# ======================================================= keys, the ZAP handler, hostile peers
def test_wrong_domain_key_cannot_join(cluster):
    """Nodes a and b share the key; c is configured with the same nodes and another key. The
    handshakes fail on both sides (logged), c stays down for a and b, a job c takes part in
    never reaches their registries, and a key that is no node's is refused by the ZAP handler."""
    import zmq

    from a2ad.daemon import domain as D

    c = cluster(["a", "b", "c"])
    wrong = write_domain(c.tmp, c.ports, key="w" * 44, tag="-wrong")
    c.start("a")
    c.start("b")
    c.start("c", config=wrong)
    c.wait_up(["a", "b"])
    time.sleep(LOSS_BOUND + 0.5)
    for n in ("a", "b"):
        st = c.domain(n)
        peer = {x["name"]: x for x in st["nodes"]}["c"]
        assert peer["state"] == "down" and peer["messages_received"] == 0 and peer["heartbeats_received"] == 0, peer
        assert st["refused_connections"] > 0 and peer["handshake_failures"] > 0, st
    assert set(c.states("c").values()) == {"self", "down"}
    for n in ("a", "c"):
        log = c.daemons[n].log()
        assert "refused a connection on tcp://127.0.0.1" in log and "CURVE handshake failed" in log, log[-2000:]
    # a job between a and c: c's join never reaches a (a counts its rank 1 as missing)
    got: dict = {}
    t0 = _attach_in_thread("wk", 0, 2, c.dirs["a"], got, timeout=3)
    t1 = _attach_in_thread("wk", 1, 2, c.dirs["c"], got, timeout=3)
    t0.join(30)
    t1.join(30)
    assert isinstance(got[0], errors.RendezvousTimeout) and got[0].missing_ranks == [1], got
    assert isinstance(got[1], errors.RendezvousTimeout) and got[1].missing_ranks == [0], got
    # a client that knows a's public key but holds no node's key: the ZAP handler says no
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        pub, sec = zmq.curve_keypair()
        s.curve_publickey, s.curve_secretkey = pub, sec
        s.curve_serverkey = D.node_keypair(KEY.encode(), "testdom", "a")[0]
        s.connect(f"tcp://127.0.0.1:{c.ports['a']}")  # the handshake itself asks a's ZAP handler
        wait_for(lambda: "its key is not one of this domain's nodes" in c.daemons["a"].log(), 10, "a ZAP refusal")
    finally:
        s.close(0)
        ctx.term()
    assert c.domain("a")["zap_requests"] >= 1
    metrics = c.daemons["a"].request("metrics")["text"]
    assert 'a2ad_domain_peer_up{node="b"} 1.0' in metrics and 'a2ad_domain_peer_up{node="c"} 0.0' in metrics
    assert "a2ad_domain_refused_connections_total" in metrics


def test_hostile_messages_from_a_node_are_dropped(cluster):
    """Something holding node c's key sends garbage, wrong envelopes, reports with bad fields,
    unknown types and an oversized frame to a: each is dropped and logged; a keeps serving and
    its job table is untouched."""
    import msgpack
    import zmq

    from a2ad.daemon import domain as D

    c = cluster(["a", "c"])
    c.start("a")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        pub, sec = D.node_keypair(KEY.encode(), "testdom", "c")
        s.curve_publickey, s.curve_secretkey = pub, sec
        s.curve_serverkey = D.node_keypair(KEY.encode(), "testdom", "a")[0]
        s.connect(f"tcp://127.0.0.1:{c.ports['a']}")
        env = {"v": 1, "dom": "testdom", "from": "c", "boot": b"12345678"}
        s.send(msgpack.packb(dict(env, t="hb")))  # a valid heartbeat: c is up for a
        wait_for(lambda: c.states("a")["c"] == "up", 10, "c up for a")
        bad = [b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb(dict(env, v=9, t="hb")),
               msgpack.packb(dict(env, dom="other", t="hb")), msgpack.packb(dict(env, t="hb", **{"from": "b"})),
               msgpack.packb(dict(env, t="nope")), msgpack.packb(dict(env, t="job", job="x", seq=1, gone=False, ep_size=2)),
               msgpack.packb(dict(env, t="job", job="../x", seq=1, gone=True)),
               msgpack.packb(dict(env, t="prepare", job="x", attempt="a", generation=1, rearm=True, seqs={})),
               msgpack.packb(dict(env, t="release", job="x", attempt=1, generation=1, rendezvous_count=1, table=[{"rank": -1}])),
               msgpack.packb(dict(env, t="refuse", job="x", kind="spec", field=3))]
        for frame in bad:
            s.send(frame)
        s.send(b"\x00" * (D.MAX_MESSAGE + 10))  # over the cap: logged and dropped, the link stays
        wait_for(lambda: c.links("a")["c"]["bad_messages"] >= 10, 15,
                 "a counting the bad messages")
    finally:
        s.close(0)
        ctx.term()
    assert c.daemons["a"].request("hello")["pid"] == c.daemons["a"].pid
    assert c.daemons["a"].request("jobs")["jobs"] == []
    log = c.daemons["a"].log()
    assert "dropped a message from node c" in log and "Traceback" not in log, log[-3000:]


# ============================================================ a 6-rank job over 3 daemons
def rounds_on_node(rank, dirs, shm, name, ep, plan):
    """Run verified rounds (tests/dataplane_cases.py) as ``rank``, attached to its own node's daemon."""
    import dataplane_cases as cases

    os.environ[protocol.SHM_DIR_ENV] = shm
    job = cases.JobSpec(runtime_dir=dirs[rank], name=name, backend="host", ep_size=ep, max_num_tokens=6, top_k=3,
                        num_experts=12, hidden=32, timeout=30.0)
    out = cases.run_rounds(rank, job, plan)
    out["generation"] = cases._OPEN[name].generation
    return out


def close_on_node(rank, name):
    import dataplane_cases as cases

    return cases.close_job(rank, name)


@pytest.fixture(scope="module")
def pool():
    from _helpers_dataplane import RankPool

    p = RankPool(8)
    yield p
    p.close()


@pytest.mark.full
def test_six_ranks_over_three_daemons_run_100_verified_rounds(cluster, pool):
    import dataplane_cases as cases

    c = cluster(["a", "b", "c"])
    for n in "abc":
        c.start(n)
    c.wait_up("abc")
    placement = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    dirs = {r: str(c.dirs[n]) for r, n in placement.items()}
    t0 = time.monotonic()
    try:
        out = pool.run(6, rounds_on_node, dirs, str(c.shm), "span6", 6, cases.Plan(seed=7, rounds=100), timeout=400)
        # what the daemons show while every rank still holds its attachment
        info = c.daemons["b"].request("job_info", job="span6")
        assert info["state"] == "ready" and [r["node"] for r in info["ranks"]] == [placement[r] for r in range(6)]
        assert info["domain"]["coordinator"] in "abc" and info["domain"]["nodes"] == ["a", "b", "c"]
        text = ctl(c.dirs["b"], "job", "span6")
        assert text.returncode == 0, text.stderr
        dom = ctl(c.dirs["a"], "domain")
        assert dom.returncode == 0, dom.stderr
        print(f"\n{text.stdout.strip()}\n\n{dom.stdout.strip()}")
        assert "NODE" in text.stdout and "coordinator" in text.stdout
        states = {line.split()[0]: line.split()[2] for line in dom.stdout.splitlines()[4:] if line.strip()}
        assert states == {"NODE": "STATE", "a": "self", "b": "up", "c": "up"}, dom.stdout
    finally:
        pool.run(6, close_on_node, "span6", timeout=60)
    assert all(o["rounds"] == 100 and o["generation"] == 0 for o in out)
    tokens = sum(o["tokens_received"] for o in out)
    print(f"6 ranks on 3 daemons (2 each): 100 rounds verified against the reference on every rank, "
          f"{tokens} tokens received in all, {time.monotonic() - t0:.1f} s")
    wait_for(lambda: all(not c.daemons[n].request("jobs")["jobs"] or
                         c.daemons[n].request("jobs")["jobs"][0]["state"] == "grace" for n in "abc"), 10,
             "every node's copy of the job in its grace period")
    metrics = c.daemons["a"].request("metrics")["text"]
    for line in ('a2ad_domain_peer_up{node="b"} 1.0', 'a2ad_domain_peer_up{node="c"} 1.0'):
        assert line in metrics, metrics
    assert 'a2ad_domain_peer_heartbeats_received_total{node="c"}' in metrics
    assert 'a2ad_domain_peer_last_heartbeat_age_seconds{node="b"}' in metrics


# ======================================================================== spec agreement
def test_spec_mismatch_across_nodes_is_refused_everywhere(cluster):
    c = cluster(["a", "b", "c"])
    for n in "abc":
        c.start(n)
    c.wait_up("abc")
    got: dict = {}
    ths = [_attach_in_thread("mm", 0, 3, c.dirs["a"], got)]
    wait_for(lambda: _rank_states(c.daemons["a"], "mm").get(0, ("",))[0] == "joining", 10, "rank 0 waiting on a")
    ths.append(_attach_in_thread("mm", 2, 3, c.dirs["c"], got))
    wait_for(lambda: _rank_states(c.daemons["a"], "mm").get(2) == ("joining", "c"), 10, "a seeing rank 2 wait on c")
    # rank 1 on b asks for top_k 2: every waiting rank, on every node, hears the mismatch
    ths.append(_attach_in_thread("mm", 1, 3, c.dirs["b"], got, top_k=2))
    for th in ths:
        th.join(30)
    for r in range(3):
        exc = got[r]
        assert isinstance(exc, errors.SpecMismatch), (r, exc)
        d = exc.details
        assert (d["field"], d["job_value"], d["requested"]) == ("top_k", 1, 2), (r, exc.message)
        assert "spec field top_k differs (job has 1, a join on node b asked for 2)" in exc.message, exc.message
    print(f"\nspec mismatch, as the rank on node a heard it: {got[0].message}")
    # simultaneous first joins with different specs: the nodes agree on one winner
    got2: dict = {}
    ths = [_attach_in_thread("race", 0, 2, c.dirs["a"], got2, top_k=1),
           _attach_in_thread("race", 1, 2, c.dirs["b"], got2, top_k=2)]
    for th in ths:
        th.join(30)
    excs = [got2[0], got2[1]]
    assert all(isinstance(e, errors.SpecMismatch) and e.details["field"] == "top_k" for e in excs), excs
    winners = {e.details["job_value"] for e in excs}
    assert len(winners) == 1 and {excs[0].details["requested"], excs[0].details["job_value"]} == {1, 2}, excs
    print(f"simultaneous first joins: the job's coordinator took top_k={winners.pop()}; both joins refused with it")


# ========================================================= rows without fabric handles
def test_a_spanning_job_without_fabric_handles_is_refused_on_every_node(cluster):
    """Node c cannot name its rows (its shared-memory folder does not exist): a job that
    spans a and c is refused on both with c's reason; a job whose ranks are all on c runs."""
    c = cluster(["a", "c"])
    c.start("a")
    c.start("c", env={"A2AD_SHM_DIR": str(c.tmp / "no-such-folder")})
    c.wait_up("ac")
    got: dict = {}
    ths = [_attach_in_thread("nofab", 0, 2, c.dirs["a"], got), _attach_in_thread("nofab", 1, 2, c.dirs["c"], got)]
    for th in ths:
        th.join(30)
    for r in (0, 1):
        assert isinstance(got[r], errors.BackendError), got
        assert "spans nodes a, c, but rank 1's workspace on node c has no fabric handle" in got[r].message
        assert "could not get a shared-memory name" in got[r].message and "no-such-folder" in got[r].message
    print(f"\n{got[0].message}")
    local: dict = {}
    ths = [_attach_in_thread("onlyc", r, 2, c.dirs["c"], local) for r in (0, 1)]
    for th in ths:
        th.join(30)
    try:
        assert all(not isinstance(local[r], Exception) for r in (0, 1)), local
        local[0].workspace[1, 4096] = 7
        assert int(local[1].workspace[1, 4096]) == 7
    finally:
        for a in local.values():
            if not isinstance(a, Exception):
                a.close()


# ======================================================== losing a node, and coming back
def serve_rank(rank, ep, runtime_dir, shm, job, policy, shared, results, seed, hold=False, experts_n=None,
               timeout=120.0):
    """Verified rounds as ``rank`` (attached to its own node's daemon) until the shared stop
    round; on PeerLost, recover and go on. Rank q's expert multiplies what it received by
    (q + 1): token t comes back as hidden[t] times the sum of (q + 1) over the distinct ranks
    of its experts that the combine counted (every rank in a raise job,
    ``last_round_active_ranks`` in a degrade job, whose ``last_round_degraded`` must mark
    exactly the tokens with an expert elsewhere). ``experts_n`` experts (default: one per
    rank). With ``hold`` the rank attaches only once ``shared["go"]`` is set; with
    ``shared["closing"]`` it closes only once that is set (or after 120 s); ``shared["gen"]``,
    where there is one, gets the generation of each recover. Reports ``(rank, kind, t,
    value)``: start, attached, lost, recovered, degraded (each new degraded view), full (the
    view whole again), done, error."""
    a2a = None
    try:
        os.environ[protocol.SHM_DIR_ENV] = shm
        import torch

        from a2ad.client import MoeAlltoAll, reference

        torch.set_num_threads(1)
        experts_n = experts_n or ep

        class M:
            moe_ep_rank, moe_ep_size = rank, ep

        if hold:
            end = time.monotonic() + 120
            while not shared["go"].value:
                if time.monotonic() > end:
                    raise TimeoutError("the test never let this rank attach")
                time.sleep(0.002)
        results.put((rank, "start", _now(), None))
        size = L.workspace_size_per_rank(ep, MAX_T, HIDDEN * 4, HIDDEN * 4)
        a2a = MoeAlltoAll(M(), MAX_T, TOP_K, experts_n, size, job=job, runtime_dir=runtime_dir, timeout=timeout,
                          on_peer_loss=policy)
        att = a2a.attachment
        flag = att.workspace[rank, att.aux.flag_val: att.aux.flag_val + 4].view(torch.int32)
        owner_of = torch.tensor([L.expert_owner(e, experts_n, ep) for e in range(experts_n)])
        weights = torch.arange(1, ep + 1, dtype=torch.float32)
        results.put((rank, "attached", _now(), a2a.generation))
        g = torch.Generator().manual_seed(seed)
        full = (1 << ep) - 1
        degraded_seen = 0
        while True:
            t = int(torch.randint(1, MAX_T + 1, (1,), generator=g))
            experts = torch.rand(t, experts_n, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
            hidden = torch.randint(-8, 9, (t, HIDDEN), generator=g).to(torch.float32)
            try:
                (recv,) = a2a.dispatch(experts, [hidden], MAX_T)
                out = a2a.combine(recv * float(rank + 1), MAX_T)
            except errors.PeerLost as exc:
                results.put((rank, "lost", _now(), exc.rank))
                gen = a2a.recover(timeout=120.0)
                results.put((rank, "recovered", _now(), gen))
                if "gen" in shared:
                    shared["gen"][rank] = gen
                continue
            rnd = int(flag) - 1
            active = a2a.last_round_active_ranks
            counted = full if active is None else sum(1 << q for q in active)
            cvec = torch.tensor([bool(counted >> q & 1) for q in range(ep)])
            owners = owner_of[experts.long()]
            hit = torch.zeros(t, ep, dtype=torch.bool)
            hit.scatter_(1, owners, True)
            weight = (hit & cvec).float() @ weights
            if not torch.equal(out, hidden * weight[:, None]):
                raise AssertionError(f"rank {rank} round {rnd} (ranks {L.mask_ranks(counted)}): combine differs")
            if policy == "degrade":
                lost = reference.lost_tokens(reference.route(experts, experts_n, ep), L.mask_ranks(counted))
                if not torch.equal(a2a.last_round_degraded, lost):
                    raise AssertionError(f"rank {rank} round {rnd}: indicator differs from the reference")
            if counted != full and counted != degraded_seen:  # every new degraded view, in order
                degraded_seen = counted
                results.put((rank, "degraded", _now(), L.mask_ranks(counted)))
            elif counted == full and degraded_seen:  # every rank back in the view
                degraded_seen = 0
                results.put((rank, "full", _now(), rnd))
            shared["done"][rank] += 1
            shared["round"][rank] = rnd
            stop = shared["stop"].value
            if stop and rnd + 1 >= stop:
                break
            time.sleep(0.002)
        results.put((rank, "done", _now(), shared["done"][rank]))
        # close once every rank is done: a rank that leaves while another is still in the
        # last round's combine would make that one raise PeerLeft
        end = time.monotonic() + 120
        while "closing" in shared and not shared["closing"].value and time.monotonic() < end:
            time.sleep(0.01)
        a2a.close()
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback

        where = _admission_state(a2a) if isinstance(exc, errors.PeerTimeout) and a2a is not None else ""
        results.put((rank, "error", _now(), f"{type(exc).__name__}: {exc}\n{where}{traceback.format_exc()}"))


def _admission_state(a2a) -> str:
    """What a rank that timed out read of the admission state: its node's mask and the admit
    entries that are not 0, the admit words of the rows, every rank's FLAG_VAL that differs
    from the most common one."""
    try:
        import torch

        att = a2a.attachment
        cb, ep, aux = att.control, att.ep_size, att.aux
        ws = att.workspace
        words = ws[:, aux.block_counters + 4 * L.SLOT_ADMIT_ROUND: aux.block_counters + 4 * L.SLOT_ADMIT_ROUND + 4]
        rows = words.contiguous().view(torch.int32)[:, 0].tolist()
        flags = ws[:, aux.flag_val: aux.flag_val + 4].contiguous().view(torch.int32)[:, 0].tolist()
        common = max(set(flags), key=flags.count)
        entries = {q: a for q, a in enumerate(cb.admit_rounds(ep)) if a}
        return (f"[admission state] mask {L.format_ranks(cb.active_mask & L.full_mask(ep))} (generation "
                f"{cb.mask_generation}); admit entries not 0: {entries}; row admit words not 0: "
                f"{ {q: a for q, a in enumerate(rows) if a} }; FLAG_VAL {common} but "
                f"{ {q: f for q, f in enumerate(flags) if f != common} }\n")
    except Exception as e:  # noqa: BLE001 - a diagnosis only
        return f"[admission state unreadable: {e!r}]\n"



def node_serve(rank, ep, runtime_dir, shm, job, policy, shared, results, seed):
    """``serve_rank`` with this file's 12 experts and a 60 s timeout."""
    serve_rank(rank, ep, runtime_dir, shm, job, policy, shared, results, seed, experts_n=EXPERTS, timeout=60.0)


class Ranks(RankReports):
    """Rank processes of one job, spread over the nodes; every wait on them is bounded and
    ``close`` ends every process still running (also when the test failed)."""

    def __init__(self, ep, job, policy, shm):
        self.ctx = mp.get_context("spawn")
        super().__init__(self.ctx)
        self.ep, self.job, self.policy, self.shm = ep, job, policy, str(shm)
        self.shared = {"done": self.ctx.Array("l", ep, lock=False), "round": self.ctx.Array("l", ep, lock=False),
                       "gen": self.ctx.Array("l", ep, lock=False), "stop": self.ctx.Value("l", 0, lock=False)}
        self.procs: dict[int, mp.Process] = {}

    def start(self, rank, runtime_dir, seed):
        p = self.ctx.Process(target=node_serve, args=(rank, self.ep, str(runtime_dir), self.shm, self.job, self.policy,
                                                      self.shared, self.results, seed), daemon=True)
        p.start()
        self.procs[rank] = p

    def kill(self, rank):
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def reap(self, rank):
        """Wait for a killed rank's process; what it reported before is forgotten (a replacement reports anew)."""
        self.procs[rank].join(10)
        self.forget(rank)

    def close(self):
        self.end_processes(self.procs.values())


def _job_coordinated_by(node: str, prefix: str) -> str:
    from a2ad.daemon.core.federation import coordinator_order

    return next(f"{prefix}-{i}" for i in range(1000) if coordinator_order(f"{prefix}-{i}", "abc")[0] == node)


def _six_ranks_on_three_nodes(cluster, prefix: str, seed: int, policy: str = "degrade", coordinator: str = "a"):
    """Daemons a, b and c up; a job of 6 ranks, 2 on each (``coordinator`` coordinates it),
    every rank attached at generation 0. Returns (cluster, ranks)."""
    ep, job = 6, _job_coordinated_by(coordinator, prefix)
    c = cluster(["a", "b", "c"])
    for n in "abc":
        c.start(n)
    c.wait_up("abc")
    grp = Ranks(ep, job, policy, c.shm)
    try:
        for r, n in {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}.items():
            grp.start(r, c.dirs[n], seed=seed + r)
        assert {v for _, v in grp.expect("attached", range(ep)).values()} == {0}
    except BaseException:
        grp.close()
        raise
    return c, grp


def serving_alone(grp, ranks: list[int], seen: dict | None = None) -> dict:
    """Until each of ``ranks`` reported a degraded round among ``ranks`` alone; the reports
    (``seen``: the first ones, already taken). A lost node's ranks are marked dead one at a
    time (mirror.remote_node_lost), so a rank may count a round between two of them: every
    view on the way keeps every rank of ``ranks``, and the time that counts is when a rank's
    view is ``ranks`` alone."""
    if seen is None:
        seen = grp.expect("degraded", ranks, timeout=30)
    for r in ranks:
        while seen[r][1] != ranks:
            assert set(ranks) <= set(seen[r][1]), (r, seen[r])
            seen[r] = grp.expect("degraded", [r], timeout=30)[r]
    return seen


def _every_rank_recovers_once(c, grp) -> tuple[dict, dict]:
    """Every rank raises PeerLost and recovers, all at one new generation (the nodes' log lines
    about aborts, losses and re-arms are printed when a rank does not raise); then all run
    verified rounds again. Returns the reports (lost, recovered)."""
    ep = grp.ep
    try:
        lost = grp.expect("lost", range(ep), timeout=30)
    except AssertionError:
        for n in "abc":
            print(f"--- node {n}:\n" + "\n".join(c.log_lines(
                n, ("abort", "re-arm", "lost", "resync", "counted", "did not run", "report", "serves on")))[-6000:])
        raise
    rec = grp.expect("recovered", range(ep), timeout=60)
    gens = {v for _, v in rec.values()}
    assert len(gens) == 1 and gens.pop() >= 1, rec
    grp.wait_rounds(range(ep), 20)
    grp.shared["stop"].value = max(grp.shared["round"][r] for r in range(ep)) + 10
    grp.expect("done", range(ep), timeout=120)
    return lost, rec


@pytest.mark.parametrize("policy,coordinator,slow_start", [pytest.param("raise", "c", False, marks=pytest.mark.full),
                                                          ("degrade", "a", False),
                                                          pytest.param("degrade", "a", True, marks=pytest.mark.full)],
                         ids=["raise", "degrade", "degrade-slow-start"])
def test_kill9_of_a_node_then_it_rejoins_with_replacements(cluster, policy, coordinator, slow_start):
    """Three daemons, 6 ranks (2 on each). kill -9 of node c's daemon and both its ranks while
    rounds run: the ranks on a and b raise PeerLost (raise job) or serve on without ranks 4
    and 5 (degrade job) within the heartbeat bound. Then c's daemon restarts on its runtime
    folder (re-adopting the job from its fd keeper), rejoins the domain, a replacement pair
    joins through it, and verified rounds resume on all 6 ranks: in the degrade case the
    replacements are let in at a round boundary while ranks 0-3 serve on (no re-arm: none of
    them raises or recovers, the generation stays 0). In the raise case node c is
    the job's coordinator: another node takes over while it is down, and c takes the job back
    when it returns (the recover rendezvous runs with whichever it is then).

    ``slow_start``: c's new daemon (``--takeover``) waits for its runtime folder's lock, held
    by the test for longer than the loss bound, before it adopts the job and listens: the
    time it could hear nobody is not the others' silence, so it counts neither a nor b lost
    and their ranks are not dropped (which would make the job re-arm)."""
    from a2ad import runtime
    from a2ad.daemon.core.federation import coordinator_order

    c, grp = _six_ranks_on_three_nodes(cluster, f"kill-{policy}", 10, policy, coordinator)
    ep, job = grp.ep, grp.job
    try:
        grp.wait_rounds(range(ep), 30)
        survivors = [0, 1, 2, 3]
        # node c goes: its daemon and its ranks, kill -9
        t_kill = _now()
        c.daemons["c"].kill9()
        grp.kill(4)
        grp.kill(5)
        grp.reap(4)
        grp.reap(5)
        if policy == "raise":
            seen = grp.expect("lost", survivors, timeout=30)
            what = "raised PeerLost"
        else:
            seen = serving_alone(grp, survivors)
            what = "served on without ranks 4 and 5"
            grp.wait_rounds(survivors, 20)
        delays = {r: t - t_kill for r, (t, _) in seen.items()}
        worst = max(delays.values())
        print(f"\n[{policy}] kill -9 of node c (daemon and ranks 4, 5): every rank on a and b {what} within "
              f"{worst * 1e3:.0f} ms (per rank {', '.join(f'{r}: {d * 1e3:.0f}' for r, d in sorted(delays.items()))} ms; "
              f"heartbeat every {HB_INTERVAL} s, lost after {LOSS_BOUND} s of silence)")
        assert worst < LOSS_BOUND + 2 * HB_INTERVAL + 1.0, delays
        for n in "ab":  # (one node's verdict may reach the other's ranks, through its report, before its own)
            wait_for(lambda: c.states(n)["c"] == "down", LOSS_BOUND + 2, f"node {n} counting c lost")
            info = c.daemons[n].request("job_info", job=job)
            assert info["domain"]["coordinator"] == next(x for x in coordinator_order(job, "abc") if x != "c")
            assert info["domain"]["lost_nodes"] == ["c"], info["domain"]
            assert [info["ranks"][r]["state"] for r in (4, 5)] == ["dead", "dead"], info["ranks"]
            if policy == "degrade":
                assert info["active_ranks"] == survivors and info["abort"] == "none", info
            else:
                assert info["abort"] == "peer lost", info
        # c comes back, rejoins the domain; a replacement pair joins through it
        t_restart = _now()
        if slow_start:
            lock = runtime.Lock(c.dirs["c"])
            started: list = []
            th = threading.Thread(target=lambda: started.append(c.start("c", None, None, "--takeover")))
            try:
                th.start()
                time.sleep(LOSS_BOUND + 1.5)  # the new daemon waits for the lock meanwhile
                assert th.is_alive() and not started
            finally:
                lock.release(remove=False)
                th.join(60)
            assert started, "c's daemon did not start once the lock was free"
        else:
            c.start("c")
        c.wait_up("abc")
        info = wait_for(lambda: (lambda i: i if i["domain"]["nodes"] == ["a", "b", "c"] else None)(
            c.daemons["c"].request("job_info", job=job)), 10, "c to hear a's and b's reports of the job again")
        assert [info["ranks"][r]["state"] for r in (4, 5)] == ["dead", "dead"], info["ranks"]
        grp.start(4, c.dirs["c"], seed=94)
        grp.start(5, c.dirs["c"], seed=95)
        att = grp.expect("attached", [4, 5], timeout=120)
        if policy == "degrade":
            # let back in at a round boundary while the others served on: no re-arm, nobody
            # raises or recovers, and every survivor's view is whole again
            back = grp.expect("full", survivors, timeout=120)
            assert {v for _, v in att.values()} == {0}, att
            assert not [i for i in grp.drain() + grp.backlog if i[1] in ("lost", "recovered")], grp.backlog
            for n in "abc":
                info = c.daemons[n].request("job_info", job=job)
                assert info["generation"] == 0 and info["abort"] == "none", (n, info)
                # (the coordinator hears of a rank's attach with its node's next report, within a
                # heartbeat; the other holders count it attached once its node answered its join)
                wait_for(lambda n=n: c.daemons[n].request("job_info", job=job)["active_ranks"] == list(range(ep)),
                         2 * HB_INTERVAL + 2, f"node {n} to count all {ep} ranks active")
            assert c.daemons["c"].request("job_info", job=job)["readmits"] == 2
            t_back = max(t for t, _ in back.values())
        else:
            rec = grp.expect("recovered", survivors, timeout=120)
            gens = {v for _, v in att.values()} | {v for _, v in rec.values()}
            assert len(gens) == 1 and gens.pop() >= 1, (att, rec)
            t_back = max(t for t, _ in list(att.values()) + list(rec.values()))
        grp.wait_rounds(range(ep), 40)
        grp.shared["stop"].value = max(grp.shared["round"][r] for r in range(ep)) + 10
        done = grp.expect("done", range(ep), timeout=120)
        total = sum(v for _, v in done.values())
        print(f"[{policy}] node c restarted, rejoined and re-adopted the job; the replacement pair attached and "
              f"all 6 ranks resumed {t_back - t_restart:.1f} s after the restart; {total} verified rounds in all")
        peer = c.links("a")["c"]
        assert peer["losses"] >= 1 and peer["ups"] >= 2 and peer["state"] == "up", peer
        assert c.daemons["a"].request("job_info", job=job)["domain"]["coordinator"] == coordinator
        if slow_start:
            # c did not count the time it waited for its folder as the others' silence (a loss
            # it counted at all, on a loaded machine, was of less than that)
            import re

            waits = [float(m.group(1)) for m in re.finditer(r"not heard from since this daemon started\D*([0-9.]+) s ago",
                                                            c.daemons["c"].log())]
            assert all(w < LOSS_BOUND + 1.0 for w in waits), waits
    finally:
        grp.close()


@pytest.mark.parametrize("when", ["serving", "just-attached"])
@pytest.mark.full
def test_a_node_counted_lost_whose_ranks_live_on_makes_the_job_recover(cluster, when):
    """Three daemons, a degrade job of 6 ranks (2 on each). Node c's daemon is stopped
    (SIGSTOP) past the loss bound while its ranks run on: a and b count c lost and their ranks
    serve on without ranks 4 and 5, which wait for them (or raise PeerLost "left behind",
    where one of them was pulling from a rank that went on without it). When c's daemon runs
    again its link never dropped, so nothing but its heartbeats tells it that the others
    forgot its reports: they carry their loss count, c sends its reports again, a and b find
    ranks 4 and 5 alive, and the whole job re-arms (every rank raises PeerLost once and
    recovers); then all 6 run verified rounds again, none of them ever verifying a round
    that differs. c itself, which only stalled, counts neither a nor b lost. "just-attached":
    c stops as soon as its ranks hold their attachments, before it reported them attached
    (its resync then sends a report that still says joining, and the next one decides)."""
    c, grp = _six_ranks_on_three_nodes(cluster, "stalled-node", 30)
    pid = None
    try:
        if when == "serving":
            grp.wait_rounds(range(grp.ep), 20)
        # (c may have counted a node lost once already while it was starting)
        before = c.links("c")
        pid = c.daemons["c"].pid
        os.kill(pid, signal.SIGSTOP)
        t_stop = _now()
        seen = serving_alone(grp, [0, 1, 2, 3])
        time.sleep(HB_INTERVAL * 2)
        os.kill(pid, signal.SIGCONT)
        t_cont, pid = _now(), None
        lost, rec = _every_rank_recovers_once(c, grp)
        print(f"\n[stalled node] c's daemon stopped {t_cont - t_stop:.1f} s: ranks 0-3 served on without 4 and 5 "
              f"{max(t for t, _ in seen.values()) - t_stop:.2f} s after; once it ran again every rank raised PeerLost "
              f"{max(t for t, _ in lost.values()) - t_cont:.2f} s and recovered {max(t for t, _ in rec.values()) - t_cont:.2f} s "
              "after")
        on_c = c.links("c")
        for n in "ab":
            assert on_c[n]["losses"] == before[n]["losses"], (n, on_c[n], before[n])
            assert on_c[n]["resyncs_asked"] > before[n]["resyncs_asked"], (n, on_c[n], before[n])
        for n in "ab":
            assert c.links(n)["c"]["losses"] >= 1
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        grp.close()


@pytest.mark.full
def test_a_node_that_hears_nobody_while_the_others_hear_it_makes_the_job_recover(cluster):
    """Three daemons, a degrade job of 6 ranks (2 on each). Node c's gate (the process that
    receives its domain traffic) is stopped past the loss bound: c hears nobody and counts a
    and b lost (its ranks 4 and 5 serve on without ranks 0-3), while a and b still hear c and
    keep its ranks. Once c hears them again, whatever view each rank had, no rank waits
    until its timeout: every rank raises PeerLost once and recovers (the job re-arms), and
    all 6 run verified rounds again."""
    c, grp = _six_ranks_on_three_nodes(cluster, "deaf-node", 50)
    gate = None
    try:
        grp.wait_rounds(range(grp.ep), 20)
        before = {n: c.links(n)["c"]["losses"] for n in "ab"}
        gate = c.domain("c")["gate"]["pid"]
        os.kill(gate, signal.SIGSTOP)
        t_stop = _now()
        wait_for(lambda: c.states("c")["a"] == "down" and c.states("c")["b"] == "down", LOSS_BOUND + 5,
                 "node c to count a and b lost")
        serving_alone(grp, [4, 5])
        time.sleep(HB_INTERVAL * 2)
        os.kill(gate, signal.SIGCONT)
        t_cont, gate = _now(), None
        lost, rec = _every_rank_recovers_once(c, grp)
        assert {n: c.links(n)["c"]["losses"] for n in "ab"} == before, "a or b counted c lost: the loss was not one-sided"
        print(f"\n[deaf node] c's gate stopped {t_cont - t_stop:.1f} s; once it ran again every rank raised PeerLost "
              f"{max(t for t, _ in lost.values()) - t_cont:.2f} s and recovered {max(t for t, _ in rec.values()) - t_cont:.2f} s "
              "after")
    finally:
        if gate is not None:
            os.kill(gate, signal.SIGCONT)
        grp.close()


# ============================================================ a 64-rank rendezvous, timed
@pytest.mark.full
def test_rendezvous_of_64_ranks_over_4_daemons():
    """scripts/domain_rendezvous.py: 4 daemons, 64 ranks (16 per daemon, threads of one
    process); the clock runs from the last rank's attach call (the other 63 already wait)
    until every rank holds its attachment; every rank then sees every other rank's mark."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "domain_rendezvous.py"), "--nodes", "4", "--ranks", "64",
                        "--repeat", "2"], capture_output=True, text=True, timeout=240, cwd=str(REPO))
    print("\n" + p.stdout.strip() + f"\n(the script took {time.monotonic() - t0:.1f} s)")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("every rank saw all 64 rows' marks: True") == 2, p.stdout


# ======================================= CUDA fabric handles, up to the driver call (no GPU)
MiB = 1 << 20


def test_cuda_fabric_export_and_import_reach_the_driver_as_expected(monkeypatch):
    """cuda_driver.export_fabric/import_fabric: the driver function, the handle type and the
    handle's bytes that the driver gets (the driver itself replaced by a recorder)."""
    from a2ad import cuda_driver as cd

    calls = []

    class FabricHandle:
        data = bytes(range(cd.FABRIC_HANDLE_SIZE))

    def record(name, *args, detail=""):
        calls.append((name, args))
        return FabricHandle() if name == "cuMemExportToShareableHandle" else 0xABC

    monkeypatch.setattr(cd, "_call", record)
    monkeypatch.setattr(cd, "_handle_type", lambda v: ("handle type", v))
    assert cd.export_fabric(77) == bytes(range(64))
    assert calls[-1] == ("cuMemExportToShareableHandle", (77, ("handle type", cd.CU_MEM_HANDLE_TYPE_FABRIC), 0))
    assert cd.import_fabric(b"\x07" * 64) == 0xABC
    name, args = calls[-1]
    assert name == "cuMemImportFromShareableHandle" and args[1] == ("handle type", cd.CU_MEM_HANDLE_TYPE_FABRIC)
    assert isinstance(args[0], bytearray) and bytes(args[0]) == b"\x07" * 64  # passed by address, as the driver wants
    with pytest.raises(ValueError, match="64 bytes"):
        cd.import_fabric(b"short")
    assert len(calls) == 2


def _stub_driver(monkeypatch, fabric_granted: bool):
    """The driver calls CudaBackend.allocate makes, below cuda_driver's own logic: cuMemCreate
    refuses the fabric type as a driver without an IMEX channel does (NOT_PERMITTED)."""
    from a2ad import cuda_driver as cd

    made = []

    def create(size, ordinal, handle_types):
        if handle_types & cd.CU_MEM_HANDLE_TYPE_FABRIC and not fabric_granted:
            raise cd.CudaError("cuMemCreate", cd.CUDA_ERROR_NOT_PERMITTED, f"{size} bytes, handle types {handle_types:#x}")
        made.append((size, ordinal, handle_types))
        return 1000 + len(made)

    monkeypatch.setattr(cd, "init", lambda: None)
    monkeypatch.setattr(cd, "_create", create)
    monkeypatch.setattr(cd, "_fabric_failed", {})
    monkeypatch.setattr(cd, "device_by_uuid", lambda uuid: 0)
    monkeypatch.setattr(cd, "uuid_of", lambda ordinal: "GPU-00000000-0000-0000-0000-000000000000")
    monkeypatch.setattr(cd, "granularity", lambda ordinal, types=1, recommended=False: 2 * MiB)
    monkeypatch.setattr(cd, "export_fd", lambda handle: os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    monkeypatch.setattr(cd, "export_fabric", lambda handle: bytes([handle % 256]) * cd.FABRIC_HANDLE_SIZE)
    monkeypatch.setattr(cd, "release", lambda handle: None)
    return made


def test_cuda_backend_without_an_imex_channel_says_so(monkeypatch, tmp_path):
    from a2ad import cuda_driver as cd
    from a2ad.daemon.backends import cuda as cb

    made = _stub_driver(monkeypatch, fabric_granted=False)
    be = cb.CudaBackend()
    be.enable_fabric()
    a = be.allocate(3 * MiB, "GPU-00000000-0000-0000-0000-000000000000")
    try:
        assert a.handle_type == "posix_fd" and a.fabric_handle is None and a.size == 4 * MiB
        assert made == [(4 * MiB, 0, cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)]  # fabric asked first, then this
        why = a.fabric_error
        assert "cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC: CUDA_ERROR_NOT_PERMITTED" in why, why
        assert "IMEX channel (/dev/nvidia-caps-imex-channels/channelN" in why and "nvidia-imex service" in why, why
        print(f"\n{why}")
    finally:
        be.release(a)
    # what the reason says about this node's channels
    assert "none is usable on this node" in cb.fabric_missing_reason("GPU-x", "r", folder=str(tmp_path))
    (tmp_path / "channel0").write_text("")
    assert cb.imex_channels(str(tmp_path)) == ["channel0"]
    assert f"this node has {tmp_path}/channel0, yet the driver refused" in cb.fabric_missing_reason(
        "GPU-x", "r", folder=str(tmp_path))
    # a driver that grants the fabric type: the row carries its 64-byte handle, kept across adoption
    made = _stub_driver(monkeypatch, fabric_granted=True)
    be = cb.CudaBackend()
    a = be.allocate(MiB, "GPU-00000000-0000-0000-0000-000000000000")
    try:
        assert a.handle_type == "fabric" and len(a.fabric_handle) == 64 and a.fabric_error is None
        assert made[0][2] == cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | cd.CU_MEM_HANDLE_TYPE_FABRIC
    finally:
        be.release(a)
    monkeypatch.setattr(cd, "import_fd", lambda fd: 4242)
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    b = be.adopt(fd, 2 * MiB, "GPU-00000000-0000-0000-0000-000000000000", "fabric", fabric=b"\x01" * 64)
    assert b.fabric_handle == b"\x01" * 64
    be.release(b)
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    b = be.adopt(fd, 2 * MiB, "GPU-00000000-0000-0000-0000-000000000000", "posix_fd")
    assert b.fabric_handle is None and "allocated without one" in b.fabric_error
    be.release(b)


def test_cuda_mapping_imports_a_remote_row_by_its_fabric_handle(monkeypatch):
    """CudaMapping with a local row (fd) and a remote one (fabric handle): the handle goes to
    import_fabric; when the driver refuses it (no IMEX channel), everything mapped so far is
    unmapped, released and the range freed before the error surfaces."""
    import contextlib

    from a2ad import cuda_driver as cd
    from a2ad.client.cuda_map import CudaMapping

    log = []
    monkeypatch.setattr(cd, "granularity", lambda ordinal, *a, **k: 2 * MiB)
    monkeypatch.setattr(cd, "on_device", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(cd, "reserve", lambda size, align: log.append(("reserve", size)) or 0x7F0000000000)
    monkeypatch.setattr(cd, "import_fd", lambda fd: log.append(("import_fd", fd)) or 11)

    def import_fabric(data):
        log.append(("import_fabric", bytes(data)))
        raise cd.CudaError("cuMemImportFromShareableHandle", cd.CUDA_ERROR_NOT_PERMITTED)

    monkeypatch.setattr(cd, "import_fabric", import_fabric)
    monkeypatch.setattr(cd, "map", lambda ptr, size, h: log.append(("map", ptr, h)))
    monkeypatch.setattr(cd, "set_access", lambda ptr, size, devs: log.append(("access", ptr, tuple(devs))))
    monkeypatch.setattr(cd, "synchronize", lambda: None)
    monkeypatch.setattr(cd, "unmap", lambda ptr, size: log.append(("unmap", ptr)))
    monkeypatch.setattr(cd, "release", lambda h: log.append(("release", h)))
    monkeypatch.setattr(cd, "address_free", lambda ptr, size: log.append(("free", ptr, size)))
    with pytest.raises(cd.CudaError, match="CUDA_ERROR_NOT_PERMITTED"):
        CudaMapping([5, b"\x09" * 64], MiB, 2 * MiB, device_ordinal=0)
    base = 0x7F0000000000
    assert log == [("reserve", 4 * MiB), ("import_fd", 5), ("map", base, 11), ("access", base, (0,)),
                   ("import_fabric", b"\x09" * 64), ("unmap", base), ("release", 11), ("free", base, 4 * MiB)], log


def test_join_reply_rows_and_host_row_names(tmp_path, monkeypatch):
    """The client's reading of a join reply's handles (fd, or fabric bytes for another node's
    row), and a host row opened by its name."""
    from a2ad.client.attach import _row_handles
    from a2ad.client.host_map import HostMapping, open_row

    ws = [{"kind": "workspace", "rank": 0, "fd": True}, {"kind": "workspace", "rank": 1, "fd": False, "fabric": b"h" * 32},
          {"kind": "workspace", "rank": 2}, {"kind": "control"}]
    assert _row_handles({"ep_size": 3, "handles": ws}) == [True, b"h" * 32, True]
    with pytest.raises(errors.ProtocolError, match="neither an fd nor a fabric handle"):
        _row_handles({"ep_size": 2, "handles": [ws[0], {"kind": "workspace", "rank": 1, "fd": False}]})
    with pytest.raises(errors.ProtocolError, match="rank order"):
        _row_handles({"ep_size": 2, "handles": [ws[1], ws[0]]})
    monkeypatch.setenv(protocol.SHM_DIR_ENV, str(tmp_path))
    handle = bytes(range(32))
    path = protocol.host_handle_path(handle)
    assert path == str(tmp_path / ("a2ad-" + handle.hex()))
    for bad in (b"x", "a" * 32, b"../" * 11):
        with pytest.raises(ValueError):
            protocol.host_handle_path(bad)
    with pytest.raises(errors.BackendError, match=protocol.SHM_DIR_ENV):
        open_row(handle, 4096)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8192)
    os.pwrite(fd, b"\x2a", 4100)
    m = HostMapping([fd, handle], 8192, 8192)
    try:
        assert int(m.tensor[1, 4100]) == 42 and int(m.tensor[0, 4100]) == 42  # one row, mapped twice
        m.tensor[1, 10] = 5
        assert os.pread(fd, 1, 10) == b"\x05"
    finally:
        m.close()
        os.close(fd)
    with pytest.raises(errors.BackendError, match="fewer than a row"):
        open_row(handle, 1 << 20)


def test_a_stopped_daemon_does_not_count_its_peers_lost(cluster):
    """Node b's daemon is stopped (SIGSTOP) for longer than the loss bound, then resumed: a
    counts b lost and then up again, as it should; b, which heard nothing because it did not
    run, counts nobody lost (its peers' heartbeats wait in its socket), its status says how
    long it stalled, and a's heartbeats, whose loss count grew, make it send a its reports
    again once."""
    c = cluster(["a", "b"])
    for n in "ab":
        c.start(n)
    c.wait_up("ab")
    # (either may have counted the other lost once already while it was starting)
    before_a, before_b = c.links("a")["b"], c.links("b")["a"]
    pid = c.daemons["b"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: c.states("a")["b"] == "down", LOSS_BOUND + 5, "a to count the stopped b lost")
        time.sleep(HB_INTERVAL * 2)
    finally:
        os.kill(pid, signal.SIGCONT)
    c.wait_up("ab")
    time.sleep(3 * HB_INTERVAL)  # b's ticks after the stall
    on_a, on_b, st_b = c.links("a")["b"], c.links("b")["a"], c.domain("b")
    link_lines = c.log_lines("ab", ("is lost", "is up", "did not run", "counted this node lost"))
    assert on_a["losses"] == before_a["losses"] + 1 and on_a["ups"] > before_a["ups"], (on_a, link_lines)
    assert on_b["losses"] == before_b["losses"] and on_b["state"] == "up", (on_b, link_lines)
    # b heard a's count of the loss the stop caused, and sent a its reports again
    assert on_b["resyncs_asked"] > before_b["resyncs_asked"], (on_b, link_lines)
    assert f"node a counted this node lost ({on_a['losses']} time(s))" in c.daemons["b"].log(), link_lines
    assert st_b["stalled_s"] >= LOSS_BOUND, st_b["stalled_s"]
    assert "did not run its loop for" in c.daemons["b"].log_tail(200)


@pytest.mark.full
def test_a_rank_death_reaches_every_node_one_hop_after_its_own(cluster):
    """kill -9 of one rank (its daemon lives): its daemon sees the lease close at once and
    tells the other daemons at once (no heartbeat involved). Printed: when its node-mate and
    the ranks on the other nodes raised PeerLost. Then a replacement joins and all resume."""
    ep, job = 4, "onehop"
    c = cluster(["a", "b", "c"])
    for n in "abc":
        c.start(n)
    c.wait_up("abc")
    placement = {0: "a", 1: "b", 2: "c", 3: "c"}
    grp = Ranks(ep, job, "raise", c.shm)
    try:
        for r, n in placement.items():
            grp.start(r, c.dirs[n], seed=40 + r)
        grp.expect("attached", range(ep))
        grp.wait_rounds(range(ep), 30)
        t_kill = _now()
        grp.kill(3)
        grp.reap(3)
        seen = grp.expect("lost", [0, 1, 2], timeout=20)
        assert all(v == 3 for _, v in seen.values()), seen
        local = seen[2][0] - t_kill
        remote = {r: seen[r][0] - t_kill for r in (0, 1)}
        print(f"\nkill -9 of rank 3 on node c: its node-mate (rank 2) raised PeerLost after {local * 1e3:.1f} ms, "
              f"the ranks on nodes a and b after {', '.join(f'{d * 1e3:.1f}' for d in remote.values())} ms "
              f"(the heartbeat bound, {LOSS_BOUND} s, plays no part)")
        assert max(remote.values()) < LOSS_BOUND / 2, (local, remote)
        grp.start(3, c.dirs["c"], seed=93)
        grp.expect("attached", [3], timeout=120)
        grp.expect("recovered", [0, 1, 2], timeout=120)
        grp.wait_rounds(range(ep), 20)
        grp.shared["stop"].value = max(grp.shared["round"][r] for r in range(ep)) + 5
        grp.expect("done", range(ep), timeout=60)
    finally:
        grp.close()


def test_a_rank_joined_on_two_nodes_stays_with_the_first(cluster, monkeypatch):
    """Rank 1 joins on node b, then again on node a: the job's coordinator (node c, which
    holds no rank) keeps it on b, a's join ends in RankTaken naming b, and the job's
    rendezvous runs with rank 0 on a and rank 1 on b."""
    c = cluster(["a", "b", "c"])
    for n in "abc":
        c.start(n)
    c.wait_up("abc")
    monkeypatch.setenv(protocol.SHM_DIR_ENV, str(c.shm))
    job = _job_coordinated_by("c", "twice")
    got: dict = {}
    first: dict = {}
    th_b = _attach_in_thread(job, 1, 2, c.dirs["b"], first)
    wait_for(lambda: job in c.domain("c")["federation"]["coordinating"], 10, "c holding b's report of rank 1")
    th_a = _attach_in_thread(job, 1, 2, c.dirs["a"], got)
    th_a.join(30)
    exc = got[1]
    assert isinstance(exc, errors.RankTaken) and "held on node b" in exc.message, exc
    th0 = _attach_in_thread(job, 0, 2, c.dirs["a"], got)
    th0.join(30)
    th_b.join(30)
    try:
        assert not isinstance(got[0], Exception) and not isinstance(first[1], Exception), (got, first)
        got[0].workspace[1, 4096] = 11
        assert int(first[1].workspace[1, 4096]) == 11
        info = c.daemons["a"].request("job_info", job=job)
        assert [(r["state"], r["node"]) for r in info["ranks"]] == [("attached", "a"), ("attached", "b")], info["ranks"]
        print(f"\na second join of rank 1, on node a: {exc.message}")
    finally:
        for a in (got.get(0), first.get(1)):
            if a is not None and not isinstance(a, Exception):
                a.close()
