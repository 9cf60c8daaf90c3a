"""Integration: a real daemon process, real client processes, real sockets and shared memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from a2ad import errors, fdpass, protocol
from a2ad.client import attach
from helpers import fd_count, run_ranks, wait_for

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)


# ------------------------------------------------------------ rank functions
def pattern_rank(rank, runtime_dir, job, ep_size, hold):
    """Write a pattern into every peer's row, wait, check what every peer wrote into ours."""
    with attach(job, rank, ep_size, runtime_dir=runtime_dir, timeout=60, **SPEC) as att:
        ws = att.workspace
        assert ws.shape == (ep_size, att.size_per_rank) and ws.stride(0) == att.row_stride
        base = att.aux.payload_data
        # every row's aux was initialized by the daemon
        for q in range(ep_size):
            assert int(ws[q, att.aux.flag_val]) == 1
        for q in range(ep_size):
            ws[q, base + 64 * rank : base + 64 * rank + 64] = (rank * 7 + q) % 251
        att.control.record_status(rank, 0, rank, 0, 0, 0)  # touch the control block mapping
        # publish "done writing" in the control-block-free way: a flag in our own row
        ws[rank, base + 64 * ep_size] = 1
        wait_for(lambda: all(int(ws[q, base + 64 * ep_size]) == 1 for q in range(ep_size)), 30, "all ranks written")
        got = [int(ws[rank, base + 64 * p]) for p in range(ep_size)]
        assert got == [(p * 7 + rank) % 251 for p in range(ep_size)], got
        assert all(bool((ws[rank, base + 64 * p : base + 64 * p + 64] == got[p]).all()) for p in range(ep_size))
        time.sleep(hold)
        return {"handle_type": att.handle_type, "generation": att.generation}


def join_only(rank, runtime_dir, job, ep_size, timeout, spec=None):
    with attach(job, rank, ep_size, runtime_dir=runtime_dir, timeout=timeout, **(spec or SPEC)):
        return "attached"


def attach_and_sleep(rank, runtime_dir, job, ep_size, seconds):
    att = attach(job, rank, ep_size, runtime_dir=runtime_dir, timeout=60, **SPEC)
    time.sleep(seconds)
    att.close()
    return "done"


# ------------------------------------------------------------------- tests
@pytest.mark.full
def test_eight_ranks_exchange_patterns(daemon):
    res = run_ranks(pattern_rank, range(8), args=(str(daemon.runtime_dir), "eight", 8, 0.0), timeout=180)
    assert len(res) == 8 and all(r["handle_type"] == "memfd" for r in res.values())
    st = daemon.request("status")
    assert st["counters"]["attaches"] == 8 and st["counters"]["deaths"] == 0


@pytest.mark.full
def test_two_jobs_at_once(daemon):
    import multiprocessing as mp
    import threading

    out = {}

    def run(job, n):
        out[job] = run_ranks(pattern_rank, range(n), args=(str(daemon.runtime_dir), job, n, 0.5), timeout=120)

    threads = [threading.Thread(target=run, args=("job-x", 2)), threading.Thread(target=run, args=("job-y", 3))]
    [t.start() for t in threads]
    # while both run, status shows two jobs at some point
    seen = wait_for(lambda: len(daemon.request("jobs")["jobs"]) == 2, 60, "two jobs listed")
    [t.join(150) for t in threads]
    assert seen and len(out["job-x"]) == 2 and len(out["job-y"]) == 3


def test_spec_mismatch_names_field_and_values(daemon):
    # rank 0 waits in the background; rank 1 arrives with another top_k
    holder = _background_join(daemon, "mm", 0, 2, SPEC)
    try:
        wait_for(lambda: _rank_state(daemon, "mm", 0) == "joining", 30, "rank 0 joining")
        bad = dict(SPEC, top_k=4)
        with pytest.raises(errors.SpecMismatch) as ei:
            attach("mm", 1, 2, runtime_dir=daemon.runtime_dir, timeout=5, **bad)
        assert ei.value.details["field"] == "top_k"
        assert ei.value.details["job_value"] == 2 and ei.value.details["requested"] == 4
        assert "top_k" in str(ei.value) and "2" in str(ei.value) and "4" in str(ei.value)
        with pytest.raises(errors.SpecMismatch) as ei:
            attach("mm", 1, 3, runtime_dir=daemon.runtime_dir, timeout=5, **SPEC)
        assert ei.value.details["field"] == "ep_size"
    finally:
        _stop(holder)


JOINER = r"""
import sys, json, time
from a2ad.client import attach
rt, job, rank, n, spec, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]), float(sys.argv[6])
try:
    a = attach(job, rank, n, runtime_dir=rt, timeout=60, **spec)
    print("ATTACHED", flush=True)
    time.sleep(hold)
    a.close()
    print("CLOSED", flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, e, flush=True)
"""


def test_hello_offers_the_lines_word_and_the_join_takes_it_as_a_bool(daemon):
    """The daemon lists "lines" in its hello's features (the client then says in its join
    that it combines through lines tails); the join's schema takes the word as a bool only,
    and a join with it is seated (the host backend's rows have no tail: lines_tail 0)."""
    assert {"watch", "lines"} <= set(daemon.request("hello")["features"])
    join = dict(job="lw", ep_rank=0, ep_size=1, spec=dict(SPEC), pid=os.getpid(), device="host", timeout=5.0)
    with pytest.raises(errors.InvalidField, match="lines") as ei:
        daemon.request("join", **join, lines="yes")
    assert ei.value.details["field"] == "lines"
    reply = daemon.request("join", **join, lines=True)
    assert reply["lines_tail"] == 0 and reply["ticket"]


def _background_join(daemon, job, rank, n, spec, hold=60.0):
    return subprocess.Popen(
        [sys.executable, "-c", JOINER, str(daemon.runtime_dir), job, str(rank), str(n), json.dumps(spec), str(hold)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _stop(p):
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _rank_state(daemon, job, rank):
    try:
        return daemon.request("job_info", job=job)["ranks"][rank]["state"]
    except errors.NoSuchJob:
        return None


def test_rank_taken(daemon):
    holders = [_background_join(daemon, "taken", r, 2, SPEC) for r in range(2)]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "ATTACHED"
        with pytest.raises(errors.RankTaken, match="rank 1"):
            attach("taken", 1, 2, runtime_dir=daemon.runtime_dir, timeout=5, **SPEC)
    finally:
        for h in holders:
            _stop(h)


def test_rendezvous_timeout_lists_missing_ranks(daemon):
    t0 = time.monotonic()
    with pytest.raises(errors.RendezvousTimeout) as ei:
        attach("lonely", 1, 4, runtime_dir=daemon.runtime_dir, timeout=1.0, **SPEC)
    assert 0.9 <= time.monotonic() - t0 < 6
    assert ei.value.missing_ranks == [0, 2, 3]
    assert "[0, 2, 3]" in str(ei.value)


@pytest.mark.full
def test_daemon_serves_others_while_a_rendezvous_waits(daemon):
    waiter = _background_join(daemon, "slow", 0, 2, SPEC)
    try:
        wait_for(lambda: _rank_state(daemon, "slow", 0) == "joining", 30, "rank 0 joining")
        t0 = time.monotonic()
        for _ in range(20):
            daemon.request("status")
        assert time.monotonic() - t0 < 2.0
        # and another job can complete meanwhile
        res = run_ranks(join_only, range(2), args=(str(daemon.runtime_dir), "fast", 2, 30), timeout=90)
        assert set(res.values()) == {"attached"}
        assert _rank_state(daemon, "slow", 0) == "joining"
    finally:
        _stop(waiter)


def test_kill9_during_rendezvous_marks_dead_and_frees(daemon_factory):
    daemon = daemon_factory("--grace", "5")
    base_fds = fd_count(daemon.pid)
    victim = _background_join(daemon, "rdv", 0, 2, SPEC)
    wait_for(lambda: _rank_state(daemon, "rdv", 0) == "joining", 30, "rank 0 joining")
    _stop(victim)
    wait_for(lambda: _rank_state(daemon, "rdv", 0) == "dead", 5, "rank 0 dead")
    out = subprocess.run(
        [sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "job", "rdv"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0 and "dead" in out.stdout, out.stdout + out.stderr
    # after the grace period the job goes away and the daemon's fds come back
    wait_for(lambda: _rank_state(daemon, "rdv", 0) is None, 15, "job freed after grace")
    wait_for(lambda: fd_count(daemon.pid) <= base_fds, 5, f"daemon fds back to {base_fds}")


def test_kill9_after_attach_marks_dead_and_frees(daemon_factory):
    daemon = daemon_factory("--grace", "5")
    base_fds = fd_count(daemon.pid)
    procs = [_background_join(daemon, "att", r, 2, SPEC, hold=120) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ATTACHED"
        assert daemon.request("job_info", job="att")["ranks_attached"] == 2
        procs[1].kill()
        procs[1].wait()
        wait_for(lambda: _rank_state(daemon, "att", 1) == "dead", 5, "rank 1 dead")
        info = daemon.request("job_info", job="att")
        assert info["ranks"][0]["state"] == "attached" and info["ranks"][1]["deaths"] == 1
        out = subprocess.run(
            [sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "--json", "status"],
            capture_output=True, text=True, timeout=30,
        )
        st = json.loads(out.stdout)
        assert st["jobs"][0]["ranks_dead"] == 1 and st["counters"]["deaths"] == 1
    finally:
        for p in procs:
            _stop(p)
    wait_for(lambda: _rank_state(daemon, "att", 0) is None, 15, "job freed after grace")
    wait_for(lambda: fd_count(daemon.pid) <= base_fds, 5, f"daemon fds back to {base_fds}")


RECOVERER = r"""
import sys, json
from a2ad.client import attach
rt, job, rank, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
a = attach(job, rank, n, runtime_dir=rt, timeout=60, **spec)
print("ATTACHED", a.generation, flush=True)
for line in sys.stdin:
    if line.strip() == "recover":
        try:
            print("RECOVERED", a.recover(timeout=30), a.control.abort_word, flush=True)
        except Exception as e:
            print("ERROR", type(e).__name__, e, flush=True)
    else:
        break
a.close()
"""


def test_dead_rank_is_replaced_and_the_job_rearmed(daemon):
    procs = [
        subprocess.Popen([sys.executable, "-c", RECOVERER, str(daemon.runtime_dir), "repl", str(r), "2", json.dumps(SPEC)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().split() == ["ATTACHED", "0"]
        procs[1].kill()
        procs[1].wait()
        wait_for(lambda: _rank_state(daemon, "repl", 1) == "dead", 5, "rank 1 dead")
        info = daemon.request("job_info", job="repl")
        assert info["state"] == "needs-rearm" and info["abort"] == "peer lost"
        # the survivor quiesces and waits; the replacement's join completes the re-arm
        procs[0].stdin.write("recover\n")
        procs[0].stdin.flush()
        wait_for(lambda: daemon.request("job_info", job="repl")["ranks"][0]["recovering"], 10, "survivor recovering")
        with attach("repl", 1, 2, runtime_dir=daemon.runtime_dir, timeout=10, **SPEC) as att:
            assert att.ep_rank == 1 and att.generation == 1
            assert att.control.abort_word == 0 and att.control.generation == 1
            assert int(att.workspace[1, att.aux.flag_val]) == 1  # re-armed rows
            assert procs[0].stdout.readline().split() == ["RECOVERED", "1", "0"]
            info = daemon.request("job_info", job="repl")
            assert info["ranks"][1]["state"] == "attached" and info["ranks"][1]["attaches"] == 2
            assert info["ranks"][1]["deaths"] == 1 and info["generation"] == 1 and info["state"] == "ready"
    finally:
        for p in procs:
            p.stdin.close()
            _stop(p)


def test_destroy_frees_now_and_clients_learn_it(daemon):
    procs = [_background_join(daemon, "gone", r, 2, SPEC, hold=2) for r in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ATTACHED"
    out = subprocess.run(
        [sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "destroy", "gone"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert daemon.request("jobs")["jobs"] == []
    with pytest.raises(errors.NoSuchJob):
        daemon.request("job_info", job="gone")
    for p in procs:  # their close() after destroy completes without hanging
        assert p.stdout.readline().strip() == "CLOSED"
        p.wait(10)
        p.stdout.close()


def test_forged_reused_and_foreign_tickets(daemon):
    # a real ticket, obtained by a process that then holds it unredeemed
    import zmq

    def raw_join(sock, rank, pid):
        sock.send(protocol.encode_request("join", rank + 1, job="tix", ep_rank=rank, ep_size=1,
                                          spec=dict(SPEC), pid=pid, device="host", timeout=10.0))
        assert sock.poll(10000)
        return protocol.decode_reply(sock.recv())

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{daemon.runtime_dir}/ctl.sock")
    # a join that claims another pid is refused (zmq reports the real one)
    rep = raw_join(s, 0, 1)
    assert not rep.ok and rep.code == "permission_denied"
    rep = raw_join(s, 0, os.getpid())
    assert rep.ok
    ticket = rep.payload["ticket"]

    def redeem(t):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(daemon.runtime_dir / "fd.sock"))
        fdpass.send_frame(c, {"v": 1, "ticket": t})
        ans, fds = fdpass.recv_frame(c, timeout=5)
        return c, ans, fds

    # forged ticket
    c, ans, fds = redeem(b"\x00" * 32)
    assert not ans["ok"] and ans["code"] == "bad_ticket" and fds == []
    c.close()
    # a process that did not join cannot redeem the real ticket
    code = (
        "import socket,sys\nfrom a2ad import fdpass\n"
        f"c=socket.socket(socket.AF_UNIX); c.connect({str(daemon.runtime_dir / 'fd.sock')!r})\n"
        f"fdpass.send_frame(c, {{'v': 1, 'ticket': bytes.fromhex({ticket.hex()!r})}})\n"
        "ans, fds = fdpass.recv_frame(c, timeout=5); print(ans['code'], len(fds))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["permission_denied", "0"], out.stdout + out.stderr
    # the rightful owner redeems it once
    c, ans, fds = redeem(ticket)
    assert ans["ok"] and len(fds) == 2
    for fd in fds:
        os.close(fd)
    # reuse fails
    c2, ans2, fds2 = redeem(ticket)
    assert not ans2["ok"] and ans2["code"] == "bad_ticket" and fds2 == []
    c2.close()
    c.close()  # the lease ends: rank 0 counts as dead (no leave)
    wait_for(lambda: _rank_state(daemon, "tix", 0) in ("dead", None), 5, "lease closed")
    s.close()


def test_garbage_on_the_fd_socket(daemon):
    for junk in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x03abc", b"\x00\x00\x00\x01\xc1"):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(daemon.runtime_dir / "fd.sock"))
        c.sendall(junk)
        ans, fds = fdpass.recv_frame(c, timeout=5)
        assert not ans["ok"] and fds == []
        c.close()
    # a connection that says nothing is dropped after the handshake timeout, not held forever
    assert daemon.request("hello")["pid"] == daemon.pid


def test_client_never_hangs_without_a_daemon(runtime_dir):
    t0 = time.monotonic()
    with pytest.raises(errors.DaemonUnavailable):
        attach("x", 0, 1, runtime_dir=runtime_dir, timeout=30, **SPEC)
    assert time.monotonic() - t0 < 1.0


def test_client_gets_an_error_when_the_daemon_dies_mid_rendezvous(daemon):
    import threading

    result = {}

    def go():
        t0 = time.monotonic()
        try:
            attach("dies", 0, 2, runtime_dir=daemon.runtime_dir, timeout=2.0, **SPEC)
        except errors.A2ADError as exc:
            result["exc"] = exc
        result["t"] = time.monotonic() - t0

    th = threading.Thread(target=go)
    th.start()
    wait_for(lambda: _rank_state(daemon, "dies", 0) == "joining", 30, "rank 0 joining")
    daemon.kill9()
    th.join(30)
    assert not th.is_alive()
    assert isinstance(result["exc"], errors.DaemonUnavailable)
    assert result["t"] < 2.0 + 5.0 + 1.0  # its timeout plus the reply margin


def test_second_daemon_on_same_folder_refuses(daemon):
    out = subprocess.run(
        [sys.executable, "-m", "a2ad.tools.cli", "serve", "--runtime-dir", str(daemon.runtime_dir), "--backend", "host"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode != 0 and "already serving" in out.stderr
    assert daemon.request("hello")["pid"] == daemon.pid  # the first one still owns the endpoint


def test_sigterm_shuts_down_cleanly(daemon):
    run_ranks(join_only, range(2), args=(str(daemon.runtime_dir), "bye", 2, 30), timeout=90)
    assert daemon.stop() == 0
    assert sorted(os.listdir(daemon.runtime_dir)) == []  # sockets and lock removed
    assert "shutting down" in daemon.log() and "stopped" in daemon.log()


def test_runtime_dir_is_private(daemon):
    assert (daemon.runtime_dir.stat().st_mode & 0o777) == 0o700
    for name in ("ctl.sock", "fd.sock"):
        assert ((daemon.runtime_dir / name).stat().st_mode & 0o077) == 0


def test_limits_refuse_big_jobs(daemon_factory):
    d = daemon_factory("--max-job-bytes", "1M", "--grace", "1")
    with pytest.raises(errors.LimitExceeded, match="per-job limit"):
        attach("big", 0, 1, runtime_dir=d.runtime_dir, timeout=5,
               max_num_tokens=1024, top_k=2, num_experts=8, workspace_size_per_rank=8 << 20)
    assert d.request("hello")["pid"] == d.pid


def test_ctl_commands(daemon):
    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), *args],
                              capture_output=True, text=True, timeout=30)

    p = ctl("ping")
    assert p.returncode == 0 and f"pid {daemon.pid}" in p.stdout
    p = ctl("status")
    assert p.returncode == 0 and "backend       host" in p.stdout and "jobs          0" in p.stdout
    p = ctl("--json", "status")
    assert json.loads(p.stdout)["pid"] == daemon.pid
    p = ctl("jobs")
    assert p.returncode == 0 and p.stdout.strip() == "no jobs"
    p = ctl("job", "nope")
    assert p.returncode == 1 and "no_such_job" in p.stderr
    p = ctl("metrics")
    assert p.returncode == 0 and "a2ad_up 1" in p.stdout
    daemon.stop()
    p = ctl("status")
    assert p.returncode == 3 and "no a2ad daemon" in p.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="setting supplementary groups needs root")
def test_supplementary_group_members_are_allowed(runtime_dir):
    """The allow-list accepts a process whose supplementary groups include an allowed gid
    (read from /proc of a real process), not only its primary gid."""
    from a2ad.daemon.auth import Auth, Peer

    gid = 4242
    auth = Auth(allow_gids={gid})
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=lambda: os.setgroups([gid]))
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=lambda: os.setgroups([]))
    try:
        auth.check_connect(Peer(12345, 999, member.pid))  # not in the allow-list but for its group: allowed
        with pytest.raises(errors.PermissionDenied, match="uid 12345"):
            auth.check_connect(Peer(12345, 999, stranger.pid))
        auth.check_connect(Peer(12345, gid, stranger.pid))  # primary gid allowed
        auth.check_connect(Peer(os.getuid(), 999, stranger.pid))  # the daemon's own uid
    finally:
        for p in (member, stranger):
            p.kill()
            p.wait()


@pytest.mark.full
def test_destroyed_job_memory_is_reported_until_importers_unmap(daemon):
    procs = [_background_join(daemon, "held", r, 2, SPEC, hold=120) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ATTACHED"
        job_bytes = daemon.request("job_info", job="held")["bytes"]
        daemon.request("destroy", job="held")
        mem = daemon.request("status")["memory"]
        # freed by the daemon, but both ranks still map it: reported as released-but-mapped
        assert mem["job_bytes"] == 0
        assert mem["released_mapped_bytes"] == job_bytes and mem["released_mapped_processes"] == 2
        assert mem["released_mapped_jobs"][0]["job"] == "held"
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "status"],
                             capture_output=True, text=True, timeout=30)
        assert "released but still mapped by clients" in out.stdout
        _stop(procs[0])
        wait_for(lambda: daemon.request("status")["memory"]["released_mapped_processes"] == 1, 10, "one importer left")
        _stop(procs[1])
        wait_for(lambda: daemon.request("status")["memory"]["released_mapped_bytes"] == 0, 10, "no importer left")
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), "status"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "memory" in out.stdout, out.stdout + out.stderr
        assert "released but still mapped" not in out.stdout  # nothing to say once it is 0
    finally:
        for p in procs:
            _stop(p)
