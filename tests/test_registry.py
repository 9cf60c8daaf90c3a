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
