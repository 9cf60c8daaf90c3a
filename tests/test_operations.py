"""Operations: the systemd notify protocol (READY, STATUS, WATCHDOG, STOPPING) against a real
notify socket, metrics through a2ad-ctl and the loopback HTTP port, drain, abort, journald
log lines, and the unit file checked by systemd-analyze."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from a2ad import errors, layout as L
from a2ad.daemon import sdnotify
from a2ad.client import attach
from helpers import REPO, DaemonProcess, NotifyListener, free_port, release_holders, run_ranks, wait_attached, wait_for

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)

HOLDER = r"""
import sys, json, time
from a2ad.client import attach
rt, job, rank, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
a = attach(job, rank, n, runtime_dir=rt, timeout=60, **spec)
print("ATTACHED", flush=True)
sys.stdin.read()   # hold the attachment until the test closes stdin (or kills us)
a.close()
"""


# --------------------------------------------------------------------------- helpers
def _holder(rt: Path, job: str, rank: int, n: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(rt), job, str(rank), str(n), json.dumps(SPEC)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO),
    )
    return p


def ctl(rt: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(rt), *args],
        capture_output=True, text=True, timeout=30, cwd=str(REPO),
    )


def parse_metrics(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} for every sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def m(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def scrape_ctl(rt: Path) -> dict:
    r = ctl(rt, "metrics")
    assert r.returncode == 0, r.stderr
    return parse_metrics(r.stdout)


def http_get(port: int, path: str = "/metrics", accept: str | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read().decode()


def _dead_count(d: DaemonProcess, job: str) -> int:
    st = d.request("job_info", job=job)
    return st["ranks_dead"]


# --------------------------------------------------------------------- sd_notify
@pytest.mark.parametrize("kind", ["path", pytest.param("abstract", marks=pytest.mark.full)])
def test_notify_ready_status_watchdog_stopping(runtime_dir, tmp_path, monkeypatch, kind):
    listener = NotifyListener(kind, tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1")
    holders = []
    try:
        d.start()
        # the environment was only for the daemon: clients and a2ad-ctl run without it
        monkeypatch.delenv("NOTIFY_SOCKET")
        monkeypatch.delenv("WATCHDOG_USEC")
        ready = listener.wait(lambda f: "READY" in f, 10, "READY=1")
        assert ready["READY"] == "1"
        assert ready["STATUS"] == "0 jobs, 0 ranks attached, 0 dead"
        # the first message is READY: nothing before the daemon is bound
        assert "READY" in listener.snapshot()[0][1]

        # WATCHDOG=1 every 100 ms (half of WATCHDOG_USEC), from the poll loop of an idle daemon
        t0 = time.monotonic()
        time.sleep(1.2)
        pings = [t for t, f, _ in listener.snapshot() if f.get("WATCHDOG") == "1" and t >= t0]
        assert len(pings) >= 5, f"only {len(pings)} watchdog pings in 1.2 s"
        gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
        assert gaps[len(gaps) // 2] < 0.2, f"median gap between pings {gaps[len(gaps) // 2]:.3f} s"

        # a service manager that does not read (its queue full) never stalls the daemon
        listener.paused = True
        time.sleep(1.5)  # ~15 pings: more than the socket queue holds
        t0 = time.monotonic()
        for _ in range(3):
            d.request("hello")
        assert time.monotonic() - t0 < 1.0, "requests stalled behind a full notify socket"
        listener.paused = False
        n = len(listener.snapshot())
        wait_for(lambda: len(listener.snapshot()) > n + 2, 5, "watchdog pings after the queue drained")

        # STATUS= follows the jobs
        holders = [_holder(runtime_dir, "notified", r, 2) for r in range(2)]
        wait_attached(*holders)
        listener.wait(lambda f: f.get("STATUS") == "1 job, 2 ranks attached, 0 dead", 10, "2 ranks attached")
        holders[1].kill()
        holders[1].wait(10)
        listener.wait(lambda f: f.get("STATUS") == "1 job, 1 rank attached, 1 dead", 10, "1 dead")
        assert ctl(runtime_dir, "drain").returncode == 0
        listener.wait(lambda f: f.get("STATUS", "").endswith(", draining"), 10, "draining in STATUS")

        # SIGTERM: STOPPING=1, then exit 0
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 0, d.log()
        stopping = listener.wait(lambda f: "STOPPING" in f, 5, "STOPPING=1")
        assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("stopping:")
    finally:
        release_holders(*holders, kill=True)  # the daemon is gone: nothing to leave
        d.stop()
        listener.close()


def test_notify_unit_level(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready("x") is False and sdnotify.watchdog() is False
    n = sdnotify.Notifier()
    assert not n.enabled and n.poll_timeout_ms(1000) == 1000

    # WATCHDOG_USEC is honoured only for this pid
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert sdnotify.watchdog_interval() is None

    # fds travel with SCM_RIGHTS (what FDSTORE=1 needs), to a path and to an abstract name
    for kind in ("path", "abstract"):
        listener = NotifyListener(kind, tmp_path)
        try:
            monkeypatch.setenv("NOTIFY_SOCKET", listener.env)
            fd = os.memfd_create("a2ad-test")
            try:
                assert sdnotify.notify("FDSTORE=1\nFDNAME=ws-test-0", [fd]) is True
                got = listener.wait(lambda f: "FDSTORE" in f, 5, "FDSTORE=1")
                assert got["FDNAME"] == "ws-test-0"
                fds = [fds for _, f, fds in listener.snapshot() if "FDSTORE" in f][0]
                assert len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino
            finally:
                os.close(fd)
        finally:
            listener.close()
        if kind == "path":
            os.unlink(listener.env)
    # a notify socket nobody listens on: False, never an exception
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody.sock"))
    assert sdnotify.notify("READY=1") is False


# ------------------------------------------------------------------------ metrics
def test_metrics_via_ctl_and_http(runtime_dir):
    port = free_port()
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--metrics-port", str(port))
    holders = []
    try:
        d.start()
        assert f"metrics on http://127.0.0.1:{port}/metrics" in d.log()
        before = scrape_ctl(runtime_dir)
        assert m(before, "a2ad_up") == 1 and m(before, "a2ad_jobs") == 0
        assert m(before, "a2ad_rendezvous_latency_seconds_count") == 0

        holders = [_holder(runtime_dir, "metered", r, 2) for r in range(2)]
        wait_attached(*holders)
        job = d.request("job_info", job="metered")
        for source in ("ctl", "http"):
            if source == "ctl":
                s = scrape_ctl(runtime_dir)
            else:
                status, ctype, text = http_get(port)
                assert status == 200 and ctype.startswith("text/plain")
                s = parse_metrics(text)
            assert m(s, "a2ad_jobs") == 1, source
            assert m(s, "a2ad_jobs_by_state", state="ready") == 1, source
            assert m(s, "a2ad_ranks", state="attached") == 2 and m(s, "a2ad_ranks", state="dead") == 0, source
            assert m(s, "a2ad_joins_total") == 2 and m(s, "a2ad_attaches_total") == 2, source
            assert m(s, "a2ad_rendezvous_total") == 1 and m(s, "a2ad_deaths_total") == 0, source
            assert m(s, "a2ad_rendezvous_latency_seconds_count") == 1, source
            assert m(s, "a2ad_rendezvous_latency_seconds_bucket", le="+Inf") == 1, source
            assert 0 <= m(s, "a2ad_rendezvous_latency_seconds_sum") < 10, source
            assert m(s, "a2ad_workspace_bytes", device="host", gpu="") >= 2 * job["size_per_rank"], source
            assert m(s, "a2ad_job_bytes") == job["bytes"], source
            assert m(s, "a2ad_draining") == 0, source
            assert m(s, "a2ad_build_info", version=__import__("a2ad").__version__, protocol="1", backend="host") == 1
            assert m(s, "a2ad_process_open_fds") > 0, source
            for kind in ("timeout", "aborted", "left_behind"):  # every kind a status record can say
                assert m(s, "a2ad_rank_wait_failures", kind=kind) == 0, (source, kind)

        # one rank dies: the dead count and the death counter say so, the job is aborted
        holders[1].kill()
        holders[1].wait(10)
        wait_for(lambda: _dead_count(d, "metered") == 1, 10, "rank 1 dead")
        for s in (scrape_ctl(runtime_dir), parse_metrics(http_get(port)[2])):
            assert m(s, "a2ad_ranks", state="dead") == 1 and m(s, "a2ad_ranks", state="attached") == 1
            assert m(s, "a2ad_deaths_total") == 1
            assert sum(v for (name, _), v in s.items() if name == "a2ad_jobs_aborted") == 1
            assert m(s, "a2ad_jobs_by_state", state="ready") == 0

        # destroyed while rank 0 still maps it: the memory counts as released but mapped
        assert ctl(runtime_dir, "destroy", "metered").returncode == 0
        s = parse_metrics(http_get(port)[2])
        assert m(s, "a2ad_jobs") == 0 and m(s, "a2ad_job_bytes") == 0
        assert m(s, "a2ad_released_mapped_bytes") == job["bytes"] and m(s, "a2ad_released_mapped_processes") == 1
        release_holders(holders[0], kill=True)
        s = scrape_ctl(runtime_dir)
        assert m(s, "a2ad_released_mapped_bytes") == 0 and m(s, "a2ad_released_mapped_processes") == 0
    finally:
        release_holders(*holders)
        d.stop()


def test_metrics_http_protocol_and_slow_clients(runtime_dir):
    port = free_port()
    d = DaemonProcess(runtime_dir, "--backend", "host", "--metrics-port", str(port))
    try:
        d.start()
        # OpenMetrics when the scraper asks for it
        status, ctype, text = http_get(port, accept="application/openmetrics-text; version=1.0.0")
        assert status == 200 and ctype.startswith("application/openmetrics-text") and text.endswith("# EOF\n")
        with pytest.raises(urllib.error.HTTPError) as ei:
            http_get(port, "/nope")
        assert ei.value.code == 404
        ei.value.close()
        # a client that connects and never finishes its request does not stall the daemon
        stuck = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            stuck[0].sendall(b"GET /metr")
            t0 = time.monotonic()
            assert ctl(runtime_dir, "ping").returncode == 0
            status, _, text = http_get(port)
            assert status == 200 and "a2ad_up 1.0" in text
            assert time.monotonic() - t0 < 10
            # an oversized request header is refused, not buffered forever
            big = socket.create_connection(("127.0.0.1", port))
            big.settimeout(10)
            big.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (20 << 10))
            reply = big.recv(200)
            big.close()
            assert reply.startswith(b"HTTP/1.1 431"), reply
        finally:
            for s in stuck:
                s.close()
        # the listener is on loopback only
        conns = Path("/proc/net/tcp").read_text().splitlines()[1:]
        listening = [c.split()[1] for c in conns if c.split()[3] == "0A"]
        assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening
    finally:
        d.stop()


def test_metrics_port_in_use_fails_startup(runtime_dir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        d = DaemonProcess(runtime_dir, "--backend", "host", "--metrics-port", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError) as ei:
            d.start()
        assert "exited with 1" in str(ei.value) and "cannot start" in str(ei.value)
        d.stop()


# ------------------------------------------------------------------ drain, abort
def join_only(rank, runtime_dir, job, ep_size):
    with attach(job, rank, ep_size, runtime_dir=runtime_dir, timeout=60, **SPEC) as att:
        return att.generation


def test_drain_refuses_new_jobs_only(runtime_dir):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60")
    try:
        d.start()
        rt = str(runtime_dir)
        run_ranks(join_only, range(2), args=(rt, "existing", 2), timeout=120)  # now in its grace period
        r = ctl(runtime_dir, "drain")
        assert r.returncode == 0 and "draining" in r.stdout and d.request("status")["draining"] is True
        assert m(scrape_ctl(runtime_dir), "a2ad_draining") == 1
        with pytest.raises(errors.Draining):
            attach("fresh", 0, 2, runtime_dir=rt, timeout=10, **SPEC)
        assert "fresh" not in [j["name"] for j in d.request("jobs")["jobs"]]
        # the existing job's ranks may come back while draining
        run_ranks(join_only, range(2), args=(rt, "existing", 2), timeout=120)
        r = ctl(runtime_dir, "drain", "--off")
        assert r.returncode == 0 and "not draining" in r.stdout and d.request("status")["draining"] is False
        run_ranks(join_only, range(2), args=(rt, "fresh", 2), timeout=120)
    finally:
        d.stop()


def wait_for_abort(rank, runtime_dir, job, ep_size, marker_dir):
    with attach(job, rank, ep_size, runtime_dir=runtime_dir, timeout=60, **SPEC) as att:
        Path(marker_dir, f"ready-{rank}").touch()
        end = time.monotonic() + 60
        while att.control.abort_word == L.ABORT_NONE and time.monotonic() < end:
            time.sleep(0.01)
        return att.control.abort_word, att.control.abort_rank


def test_abort_sets_the_abort_word(runtime_dir, tmp_path):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1")
    try:
        d.start()
        out = {}
        t = threading.Thread(
            target=lambda: out.update(res=run_ranks(wait_for_abort, range(2), args=(str(runtime_dir), "ab", 2, str(tmp_path)), timeout=120))
        )
        t.start()
        wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)), 60, "both ranks attached")
        r = ctl(runtime_dir, "abort", "ab")
        assert r.returncode == 0 and r.stdout.startswith("job ab aborted"), r
        t.join(120)
        assert out["res"] == {0: (L.ABORT_OPERATOR, -1), 1: (L.ABORT_OPERATOR, -1)}
        r = ctl(runtime_dir, "abort", "no-such-job")
        assert r.returncode == 1 and "no_such_job" in r.stderr
    finally:
        d.stop()


HAS_DATA_PLANE = (REPO / "client" / "moe_alltoall.py").exists()


def dispatch_until_aborted(rank, runtime_dir, job, marker_dir):
    import torch

    from a2ad.client import MoeAlltoAll

    class Mapping:
        moe_ep_rank, moe_ep_size = rank, 2

    a2a = MoeAlltoAll(Mapping(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=16,
                      job=job, runtime_dir=runtime_dir, timeout=60)
    try:
        Path(marker_dir, f"ready-{rank}").touch()
        if rank == 1:  # never dispatches: rank 0 waits for it until the abort
            wait_for(lambda: Path(marker_dir, "done").exists(), 90, "the test to finish")
            return None
        experts = torch.tensor([[0, 2], [1, 3], [2, 3], [0, 1]], dtype=torch.int32)
        hidden = torch.randn(4, 16).to(torch.bfloat16)
        t0 = time.monotonic()
        try:
            a2a.dispatch(experts, [hidden], runtime_max_tokens_per_rank=4)
            result = ["returned", time.monotonic() - t0]
        except Exception as exc:
            result = [type(exc).__name__, time.monotonic() - t0]
        Path(marker_dir, "result-0").write_text(json.dumps(result))
        return result
    finally:
        try:
            a2a.close()
        except Exception:
            pass


@pytest.mark.skipif(not HAS_DATA_PLANE, reason="client/moe_alltoall.py (the host data plane) is not in this checkout")
def test_abort_wakes_a_rank_waiting_in_dispatch(runtime_dir, tmp_path):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1")
    try:
        d.start()
        out = {}

        def run():
            try:
                out["res"] = run_ranks(dispatch_until_aborted, range(2), args=(str(runtime_dir), "abd", str(tmp_path)), timeout=150)
            except BaseException as exc:  # surfaced below
                out["err"] = exc

        t = threading.Thread(target=run)
        t.start()
        try:
            wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)), 60, "both ranks constructed")
            time.sleep(0.5)  # rank 0 is inside dispatch, waiting for rank 1
            assert ctl(runtime_dir, "abort", "abd").returncode == 0
            wait_for(lambda: (tmp_path / "result-0").exists() or not t.is_alive(), 20, "rank 0 to leave its wait")
        finally:
            (tmp_path / "done").touch()
            t.join(150)
        assert "err" not in out, out.get("err")
        name, waited = out["res"][0]
        assert name == "PeerLost", out["res"]
        assert waited < 30, f"rank 0 waited {waited:.1f} s: the abort did not end the wait (timeout 60 s)"
    finally:
        d.stop()


# ------------------------------------------------------------------------- logs
def test_log_lines_journald_friendly_and_one_per_event(runtime_dir):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "0.2")
    d.log_path.touch()
    st = os.stat(d.log_path)
    old = os.environ.get("JOURNAL_STREAM")
    os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"  # stderr "is" the journal
    try:
        d.start()
    finally:
        if old is None:
            del os.environ["JOURNAL_STREAM"]
        else:
            os.environ["JOURNAL_STREAM"] = old
    try:
        run_ranks(join_only, range(2), args=(str(runtime_dir), "logged", 2), timeout=120)
        wait_for(lambda: "job logged freed" in d.log(), 20, "the job to be freed")
    finally:
        assert d.stop() == 0
    lines = [ln for ln in d.log().splitlines() if ln.startswith("<")]
    assert lines, d.log()
    for ln in lines:  # '<priority>message': no timestamp (journald adds it), no level word
        assert ln[1] in "01234567" and ln[2] == ">", ln
        assert not ln[3:7].isdigit(), f"timestamp in a journal line: {ln}"
    text = "\n".join(lines)

    def one(fragment: str, count: int = 1) -> None:
        n = sum(1 for ln in lines if fragment in ln)
        assert n == count, f"{n} lines with {fragment!r} (want {count}):\n{text}"

    one("<6>job logged created")
    one(": rank 0 joined")
    one(": rank 1 joined")
    one("job logged: rank 0 attached")
    one("job logged: rank 1 attached")
    one("job logged: rendezvous done")
    assert any("rendezvous done" in ln and " ms " in ln for ln in lines), "rendezvous latency logged"
    one("job logged: rank 0 (pid")
    one("job logged: rank 1 (pid")
    one("<6>job logged freed")
    assert sum(1 for ln in lines if "(pid" in ln and ") left" in ln) == 2


def test_log_lines_timestamped_outside_systemd(daemon):
    first = daemon.log().splitlines()[0]
    assert first[:4].isdigit() and " a2ad[" in first and " INFO " in first, first


# ----------------------------------------------------------------------- the unit
UNIT = REPO / "systemd" / "a2ad.service"


def _unit_settings(path: Path) -> list[tuple[str, str, str]]:
    section, out = "", []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def test_unit_file_settings():
    s = _unit_settings(UNIT)
    svc = {k: v for sec, k, v in s if sec == "Service"}
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert int(svc["WatchdogSec"]) > 0 and svc["Restart"] == "on-failure"
    assert svc["RuntimeDirectory"] == "a2ad" and svc["RuntimeDirectoryPreserve"] == "yes"
    assert int(svc["FileDescriptorStoreMax"]) >= 1024
    assert "--group a2ad" in svc["ExecStart"] and "--runtime-dir /run/a2ad" in svc["ExecStart"]
    for key in ("PrivateDevices", "MemoryDenyWriteExecute"):  # would take the GPUs away
        assert key not in svc
    assert svc["DevicePolicy"] == "closed"
    allowed = [v for sec, k, v in s if k == "DeviceAllow"]
    assert "char-nvidia-frontend rw" in allowed and "char-nvidia-uvm rw" in allowed
    doc = dict((k, v) for sec, k, v in s if sec == "Unit")["Documentation"]
    assert doc == "file:///usr/share/doc/a2ad/OPERATIONS.md" and (REPO / "docs" / "OPERATIONS.md").exists()
    users = (REPO / "systemd" / "a2ad.sysusers.conf").read_text()
    assert any(ln.split()[:2] == ["u", "a2ad"] for ln in users.splitlines() if ln and not ln.startswith("#"))


def _verify(path: Path) -> subprocess.CompletedProcess:
    # offline check; --man=no: the Documentation= URL need not resolve on this machine
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (scripts/setup.sh installs Debian's systemd package as root)")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    r = _verify(UNIT)
    # verify exits 0 even for unknown keys or bad values (it only warns), so any
    # diagnostic about our unit counts as a failure
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "a2ad" in ln]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr
    # ... and the check does catch a broken copy
    bad = tmp_path / "a2ad.service"
    bad.write_text(UNIT.read_text().replace("WatchdogSec=30", "WatchdogSec=30\nNoSuchKey=1"))
    r = _verify(bad)
    assert "NoSuchKey" in r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_creates_the_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(REPO / "systemd" / "a2ad.sysusers.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert any(ln.startswith("a2ad:") for ln in (tmp_path / "etc" / "passwd").read_text().splitlines())
    assert any(ln.startswith("a2ad:") for ln in (tmp_path / "etc" / "group").read_text().splitlines())
