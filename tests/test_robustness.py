"""Robustness and resource figures: fuzzing, attach/detach soak, rendezvous latency at 64 ranks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from a2ad import errors, protocol
from a2ad.client import attach
from helpers import fd_count, rss_kib, settled_fd_count, wait_for

SPEC = dict(max_num_tokens=16, top_k=2, num_experts=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64)


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "big", "neg", "str", "bytes", "float", "nan", "bool", "none"]
    if depth < 3:
        kinds += ["list", "map"]
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(-5, 70)
    if k == "big":
        return rng.choice([2**31, 2**40, 2**63 - 1, 2**64 - 1])
    if k == "neg":
        return -rng.randint(1, 2**62)
    if k == "str":
        return "".join(rng.choice("ab-_.:\x00é ") for _ in range(rng.randint(0, 80)))
    if k == "bytes":
        return rng.randbytes(rng.randint(0, 64))
    if k == "float":
        return rng.uniform(-1e9, 1e9)
    if k == "nan":
        return float(rng.choice(["nan", "inf", "-inf"]))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {rng.choice(["v", "id", "type", "job", "spec", "x"]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _fuzz_frame(rng: random.Random) -> list[bytes]:
    good = protocol.encode_request(
        "join", 1, job="fz", ep_rank=0, ep_size=1, spec=dict(SPEC), pid=os.getpid(), device="host", timeout=0.5
    )
    choice = rng.randrange(9)
    if choice == 0:  # raw garbage
        return [rng.randbytes(rng.randint(0, 300))]
    if choice == 1:  # bit flips in a valid join
        b = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return [bytes(b)]
    if choice == 2:  # truncated valid join
        return [good[: rng.randrange(len(good))]]
    if choice == 3:  # random structure with a valid envelope
        # every type but upgrade and shutdown, which (validly) replace or stop the daemon:
        # tested in test_failures and test_ctl
        types = [t for t in protocol.REQUESTS if t not in ("upgrade", "shutdown")] + ["nope"]
        obj = {"v": 1, "id": rng.randint(0, 99), "type": rng.choice(types)}
        for _ in range(rng.randint(0, 6)):
            obj[rng.choice(["job", "ep_rank", "ep_size", "spec", "pid", "device", "timeout", "lease", "zzz"])] = _random_value(rng)
        return [msgpack.packb(obj, use_bin_type=True)]
    if choice == 4:  # join with one spec field corrupted
        spec = dict(SPEC)
        spec[rng.choice(list(spec) + ["workspace_size_per_rank", "bogus"])] = _random_value(rng)
        return [msgpack.packb({"v": 1, "id": 5, "type": "join", "job": "fz", "ep_rank": 0, "ep_size": 1, "spec": spec,
                               "pid": os.getpid(), "device": "host"}, use_bin_type=True)]
    if choice == 5:  # several frames
        return [rng.randbytes(8) for _ in range(rng.randint(2, 4))]
    if choice == 6:  # oversized
        return [b"\x00" * (protocol.MAX_FRAME + rng.randint(1, 1000))]
    if choice == 7:  # random msgpack value
        return [msgpack.packb(_random_value(rng), use_bin_type=True)]
    return [msgpack.packb({"v": rng.choice([0, 2, "1", None]), "id": 1, "type": "hello"})]


@pytest.mark.slow
def test_fuzz_ten_thousand_messages_then_a_normal_join(daemon):
    rng = random.Random(1234)
    ctx = zmq.Context.instance()
    fds_before = fd_count(daemon.pid)
    sent = answered = expected = 0
    sock = None
    t0 = time.monotonic()
    codes = set(errors.CODES) | {"ok"}
    for i in range(10_000):
        if sock is None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{daemon.runtime_dir}/ctl.sock")
        frames = _fuzz_frame(rng)
        sock.send_multipart(frames)
        sent += 1
        if sum(len(f) for f in frames) > protocol.MAX_FRAME:
            # libzmq refuses the frame and drops this connection; no reply comes
            sock.close(0)
            sock = None
            continue
        expected += 1
        assert sock.poll(5000), f"no reply to fuzz frame {i} ({frames[0][:40]!r})"
        reply = protocol.decode_reply(sock.recv())
        answered += 1
        assert reply.code in codes
        if reply.ok and reply.payload.get("ticket"):
            # a fuzzed join that happened to be valid: leave it so the rank is free again
            sock.send(protocol.encode_request("leave", 0, job="fz", ep_rank=0, lease=reply.payload["lease"]))
            assert sock.poll(5000)
            sock.recv()
    if sock is not None:
        sock.close(0)
    elapsed = time.monotonic() - t0
    print(f"\nfuzz: sent {sent} frames, {answered} replies (all {expected} expected), {elapsed:.1f} s; "
          f"daemon fds {fds_before} -> {fd_count(daemon.pid)}")
    assert sent == 10_000 and answered == expected and expected > 8_000
    # fuzzed frames include valid commands, a drain among them: switch it off again
    daemon.request("drain", enable=False)
    # the daemon still serves: a normal job attaches
    with attach("after-fuzz", 0, 1, runtime_dir=daemon.runtime_dir, timeout=10, **SPEC) as att:
        assert att.workspace.shape[0] == 1
    st = daemon.request("status")
    assert st["counters"]["bad_requests"] > 1000
    for job in [j["name"] for j in st["jobs"]]:
        daemon.request("destroy", job=job)
    wait_for(lambda: fd_count(daemon.pid) <= fds_before, 10, f"daemon fds back to {fds_before}")


@pytest.mark.slow
@pytest.mark.full
def test_thousand_attach_detach_cycles_do_not_leak(daemon_factory):
    d = daemon_factory("--grace", "0")
    # warm up: first allocations and imports settle the daemon's footprint
    for _ in range(20):
        with attach("soak", 0, 1, runtime_dir=d.runtime_dir, timeout=10, **SPEC):
            pass
    wait_for(lambda: not d.request("jobs")["jobs"], 10, "warm-up job freed")
    fds0, rss0 = settled_fd_count(d.pid), rss_kib(d.pid)
    t0 = time.monotonic()
    for i in range(1000):
        with attach("soak", 0, 1, runtime_dir=d.runtime_dir, timeout=10, **SPEC) as att:
            att.workspace[0, att.aux.payload_data] = i % 256
    wait_for(lambda: not d.request("jobs")["jobs"], 10, "last job freed")
    elapsed = time.monotonic() - t0
    # libzmq closes a departed client's connection asynchronously: allow it a moment
    fds1 = wait_for(lambda: (n := fd_count(d.pid)) <= fds0 and n, 5, f"daemon fds back to {fds0}")
    rss1 = rss_kib(d.pid)
    print(f"\nsoak: 1000 attach/detach cycles in {elapsed:.1f} s ({elapsed:.3f} ms each); "
          f"daemon open fds {fds0} -> {fds1}, RSS {rss0} KiB -> {rss1} KiB")
    assert fds1 <= fds0
    assert rss1 - rss0 < 4096, "daemon RSS grew by more than 4 MiB over 1000 cycles"
    assert d.request("status")["counters"]["attaches"] == 1020


LIGHT_CLIENT = r"""
import os, sys, time
import zmq
sys.path.insert(0, sys.argv[4])
from a2ad import errors, protocol
rt, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.connect(f"ipc://{rt}/ctl.sock")
spec = {"max_num_tokens": 16, "top_k": 2, "num_experts": 64, "dispatch_bytes_per_token": 64, "combine_bytes_per_token": 64}
sys.stdout.write("READY\n"); sys.stdout.flush()
sys.stdin.readline()
t_send = time.clock_gettime(time.CLOCK_MONOTONIC)
s.send(protocol.encode_request("join", 1, job="rdv64", ep_rank=rank, ep_size=n, spec=spec, pid=os.getpid(), device="host", timeout=60.0))
if not s.poll(90000):
    print("TIMEOUT"); sys.exit(1)
rep = protocol.decode_reply(s.recv())
t_recv = time.clock_gettime(time.CLOCK_MONOTONIC)
print("OK" if rep.ok else "ERR " + rep.code, t_send, t_recv, flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
@pytest.mark.full
def test_rendezvous_latency_with_64_lightweight_clients(daemon):
    n = 64
    repo = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    procs = [
        subprocess.Popen([sys.executable, "-c", LIGHT_CLIENT, str(daemon.runtime_dir), str(r), str(n), repo],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        # release them in rank order, the last one after a pause, so "the last join" is clear
        for p in procs[:-1]:
            p.stdin.write("go\n")
            p.stdin.flush()
        wait_for(lambda: daemon.request("job_info", job="rdv64")["ranks_attached"] == 0
                 and sum(r["state"] == "joining" for r in daemon.request("job_info", job="rdv64")["ranks"]) == n - 1,
                 60, "63 ranks joining")
        procs[-1].stdin.write("go\n")
        procs[-1].stdin.flush()
        lines = [p.stdout.readline().split() for p in procs]
    finally:
        for p in procs:
            try:
                p.stdin.write("bye\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
        for p in procs:
            p.wait(30)
            p.stdin.close()
            p.stdout.close()
    assert all(line[0] == "OK" for line in lines), lines
    last_send = float(lines[-1][1])
    recvs = [float(line[2]) for line in lines]
    all_replied = max(recvs) - last_send
    print(f"\nrendezvous, 64 ranks: last join sent -> all 64 replies received: {all_replied * 1e3:.2f} ms "
          f"(first reply {min(recvs) - last_send:.4f} s after it; daemon's own figure "
          f"{daemon.request('status')['rendezvous_latency_ms']['max']} ms from the last join to replies sent)")
    assert all_replied < 1.0
