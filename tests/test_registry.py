"""The registry's answers to a rendezvous that ends badly (a timeout names only the ranks
absent at that moment; a spec mismatch names who asked for the other value) and its per-uid
caps on jobs, fds and bytes. Real daemons, real client processes and sockets; the cross-user
cases fork a client that becomes another uid."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from a2ad import errors, protocol
from a2ad.connection import DaemonClient
from helpers import wait_for

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)


def _held_join(runtime_dir, job: str, rank: int, ep_size: int, timeout: float, spec=SPEC):
    """A join sent on its own connection, its reply left waiting (returned: client, socket)."""
    c = DaemonClient(runtime_dir, timeout=10)
    sock = c._socket()
    sock.send(protocol.encode_request("join", 1, job=job, ep_rank=rank, ep_size=ep_size, spec=spec, pid=os.getpid(),
                                      device="host", timeout=timeout))
    return c, sock


def _ranks_joining(daemon, job: str) -> list[int]:
    jobs = {j["name"]: j for j in daemon.request("jobs")["jobs"]}
    if job not in jobs:
        return []
    return [r["rank"] for r in jobs[job]["ranks"] if r["state"] == "joining"]


# ------------------------------------------------------------ rendezvous timeouts
def test_a_rendezvous_timeout_names_only_the_ranks_absent_at_that_moment(daemon):
    """Ranks 0 and 1 of a 3-rank job wait with the same timeout; the daemon is held stopped
    past both deadlines, so both time out in one pass of its timers. Each is told that rank 2
    is missing, and neither names the other, whose wait ended at that same moment."""
    held = [_held_join(daemon.runtime_dir, "tmo", r, 3, timeout=1.0) for r in (0, 1)]
    try:
        wait_for(lambda: _ranks_joining(daemon, "tmo") == [0, 1], 10, "ranks 0 and 1 waiting in the rendezvous")
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        for rank, (_, sock) in zip((0, 1), held):
            assert sock.poll(10000), f"rank {rank} heard nothing"
            reply = protocol.decode_reply(sock.recv())
            assert reply.code == "rendezvous_timeout", reply
            assert reply.payload["missing_ranks"] == [2], (rank, reply)
            assert "waiting for rank(s) [2]" in reply.message, reply.message
    finally:
        for c, _ in held:
            c.close()


def test_a_rank_that_left_before_the_timeout_is_named_missing(daemon):
    """The other side of the same rule: a rank that was gone when the timeout came (its own,
    shorter wait ended earlier) is absent at that moment and is named."""
    c0, s0 = _held_join(daemon.runtime_dir, "tmo2", 0, 3, timeout=3.0)
    c1, s1 = _held_join(daemon.runtime_dir, "tmo2", 1, 3, timeout=0.5)
    try:
        assert s1.poll(10000), "rank 1 heard nothing"
        r1 = protocol.decode_reply(s1.recv())
        assert r1.code == "rendezvous_timeout" and r1.payload["missing_ranks"] == [2], r1
        assert s0.poll(10000), "rank 0 heard nothing"
        r0 = protocol.decode_reply(s0.recv())
        assert r0.code == "rendezvous_timeout" and r0.payload["missing_ranks"] == [1, 2], r0
    finally:
        c0.close()
        c1.close()


# ------------------------------------------------------------------ spec mismatch
def test_a_spec_mismatch_names_the_rank_and_node_that_asked(daemon):
    """Both the mismatching join and the rank already waiting hear which rank (and pid, on
    which node) asked for the other value."""
    node = socket.gethostname().split(".")[0]
    waiting, sock = _held_join(daemon.runtime_dir, "mm2", 0, 3, timeout=60.0)
    try:
        wait_for(lambda: _ranks_joining(daemon, "mm2") == [0], 10, "rank 0 waiting in the rendezvous")
        with DaemonClient(daemon.runtime_dir, timeout=10) as c:
            with pytest.raises(errors.SpecMismatch) as ei:
                c.request("join", job="mm2", ep_rank=2, ep_size=3, spec=dict(SPEC, top_k=4), pid=os.getpid(),
                          device="host", timeout=60.0)
        said = f"the join was rank 2 (pid {os.getpid()}) on node {node}"
        assert said in ei.value.message and "top_k differs (job has 2, join asked for 4)" in ei.value.message, \
            ei.value.message
        assert ei.value.details["rank"] == 2 and ei.value.details["node"] == node, ei.value.details
        assert sock.poll(5000), "the waiting rank heard nothing"
        reply = protocol.decode_reply(sock.recv())
        assert reply.code == "spec_mismatch" and said in reply.message, reply.message
        assert reply.payload["rank"] == 2 and reply.payload["node"] == node and reply.payload["field"] == "top_k"
    finally:
        waiting.close()


# ------------------------------------------------------------------- per-uid caps
UID_A, UID_B = 12346, 12347
NOGROUP_GID = 65534


def _nogroup() -> str | None:
    import grp

    try:
        return grp.getgrgid(NOGROUP_GID).gr_name
    except KeyError:
        return None


def _attach_as(uid: int, runtime_dir, prefix: str, n: int):
    """Fork a client that becomes ``uid`` (gid nogroup) and attaches up to ``n`` one-rank jobs
    PREFIX0.. through the raw protocol, stopping at the first refusal; it reports each
    attempt (["ok"] or [code, message, details]) on a pipe, then holds its jobs until its
    pipe of orders closes. Returns (pid, results file, orders fd)."""
    import json

    from a2ad import fdpass

    results_r, results_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: every module it needs is imported already
        code = 1
        try:
            os.close(results_r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(NOGROUP_GID)
            os.setuid(uid)
            c = DaemonClient(runtime_dir, timeout=10)
            out, held = [], []
            for i in range(n):
                try:
                    r = c.request("join", job=f"{prefix}{i}", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(),
                                  device="host", timeout=10.0)
                except errors.A2ADError as exc:
                    out.append([exc.code, exc.message, exc.details])
                    break
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(c.fd_path))
                fdpass.send_frame(s, {"v": 1, "ticket": r["ticket"]})
                answer, fds = fdpass.recv_frame(s, timeout=10)
                out.append(["ok"] if answer.get("ok") else ["fd_refused", str(answer), {}])
                held.append((s, fds))
            os.write(results_w, (json.dumps(out) + "\n").encode())
            os.read(go_r, 1)  # EOF: the test is done with us
            code = 0
        except BaseException as exc:
            os.write(results_w, (json.dumps([["child_error", repr(exc), {}]]) + "\n").encode())
        finally:
            os._exit(code)
    os.close(results_w)
    os.close(go_r)
    return pid, os.fdopen(results_r), go_w


def _results(f, timeout: float = 60.0) -> list:
    import json
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(f, selectors.EVENT_READ)
    try:
        assert sel.select(timeout), f"the other uid's client reported nothing in {timeout} s"
    finally:
        sel.close()
    return json.loads(f.readline())


def _end_child(pid: int, f, go_w: int) -> None:
    os.close(go_w)
    f.close()
    end = time.monotonic() + 10
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _tiny_job_bytes() -> int:
    from a2ad.daemon.backends.host import HostBackend

    return HostBackend().row_stride(protocol.normalize_spec(SPEC, 1)["workspace_size_per_rank"], "host")


@pytest.mark.parametrize("cap", ["jobs", "fds", "bytes"])
def test_one_uid_attaching_many_tiny_jobs_stops_at_its_cap_and_another_is_still_served(daemon_factory, cap):
    """A uid attaching one-rank jobs is refused at its cap, and the refusal names the cap; a
    second uid is served as before, and so is an admin (root). Each tiny job holds 4 fds here:
    its control block's memfd and the descriptor its mapping keeps, its row and its rank's lease
    connection."""
    if os.geteuid() != 0 or _nogroup() is None:
        pytest.skip("needs root and a group with gid 65534 to run clients as other uids")
    option, value, fits = {
        "jobs": ("--max-jobs-per-uid", "4", 4),
        "fds": ("--max-fds-per-uid", "11", 2),  # 4 + 4 fit; a third job's 4 more do not
        "bytes": ("--max-bytes-per-uid", str(_tiny_job_bytes() * 5 // 2), 2),
    }[cap]
    d = daemon_factory("--group", _nogroup(), option, value)
    a = _attach_as(UID_A, d.runtime_dir, "a", fits + 3)
    try:
        got = _results(a[1])
        assert [r[0] for r in got] == ["ok"] * fits + ["limit_exceeded"], got
        code, message, details = got[-1]
        assert option in message and f"uid {UID_A}" in message, message
        assert details["cap"] == option and details["limit"] == int(value), details
        b = _attach_as(UID_B, d.runtime_dir, "b", 1)
        try:
            assert _results(b[1]) == [["ok"]], "another uid was not served"
        finally:
            _end_child(*b)
        st = d.request("status")
        assert st["limits"][f"{cap}_per_uid"] == int(value), st["limits"]
        owners = [j["owner_uid"] for j in st["jobs"]]
        assert owners.count(UID_A) == fits and owners.count(UID_B) == 1, owners
        with DaemonClient(d.runtime_dir, timeout=10) as c:  # an admin is not capped
            for i in range(fits + 1):
                c.request("join", job=f"root{i}", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(), device="host",
                          timeout=10.0)
    finally:
        _end_child(*a)
