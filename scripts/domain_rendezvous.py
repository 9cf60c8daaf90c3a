#!/usr/bin/env python3
"""Measure the rendezvous of one job spread over the daemons of a domain, on this machine.

Starts ``--nodes`` host-backend daemons as the nodes of one domain (temporary runtime
folders, TCP ports on 127.0.0.1 picked free now, a temporary shared-memory folder), then
attaches ``--ranks`` ranks, spread evenly over the nodes, each through its own node's
daemon, from threads of this one process (a process may hold several ranks). All ranks but
the last are let join first; once every daemon shows them waiting, the last rank joins and
the clock runs from just before its attach call to the moment the last of all ranks has its
attachment (its join released, its handles redeemed, every row mapped). Each rank then
writes a mark into its own row and checks that every other rank's mark shows up in its
mapping (so every rank mapped every row, through fds for its node's rows and shared-memory
names for the others'). Also printed: what each daemon and the job's coordinator measured.

Usage: python scripts/domain_rendezvous.py [--nodes 4] [--ranks 64] [--repeat 1]
Exit status 0 when every rank attached and saw every mark; the figures go to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _config(folder: Path, names: list[str]) -> Path:
    key = folder / "domain.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    text = ["[domain]", 'name = "bench"', f'key_file = "{key}"', "heartbeat_interval = 0.5", "heartbeat_misses = 10", ""]
    for n in names:
        text += ["[[node]]", f'name = "{n}"', f'address = "tcp://127.0.0.1:{_free_port()}"', ""]
    path = folder / "domain.toml"
    path.write_text("\n".join(text))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="jobs to measure one after the other")
    ap.add_argument("--timeout", type=float, default=60.0, help="rendezvous timeout of every rank, seconds")
    args = ap.parse_args(argv)
    if not 1 <= args.nodes <= args.ranks <= 64:
        ap.error("need 1 <= nodes <= ranks <= 64")

    from a2ad import protocol
    from a2ad.tools.launcher import DaemonLauncher

    work = Path(tempfile.mkdtemp(prefix="a2ad-rdv-"))
    shm = work / "shm"
    shm.mkdir()
    os.environ[protocol.SHM_DIR_ENV] = str(shm)
    names = [f"n{i}" for i in range(args.nodes)]
    config = _config(work, names)
    daemons = {}
    ok = True
    try:
        for n in names:
            rd = work / n
            daemons[n] = DaemonLauncher(rd, "--backend", "host", "--fd-store", "none", "--grace", "2",
                                        "--domain", str(config), "--node", n, env=dict(os.environ))
        for d in daemons.values():
            d.start(timeout=30)
        end = time.monotonic() + 20
        while not all(all(p["state"] in ("up", "self") for p in d.request("domain")["nodes"]) for d in daemons.values()):
            if time.monotonic() > end:
                raise SystemExit("the daemons did not all see each other up within 20 s")
            time.sleep(0.05)
        for i in range(args.repeat):
            ok &= _measure(f"rdv{i}", args, names, daemons)
    finally:
        for d in daemons.values():
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def _measure(job: str, args, names, daemons) -> bool:
    import torch

    from a2ad.client import attach

    torch.set_num_threads(1)
    n_ranks = args.ranks
    node_of = {r: names[r * len(names) // n_ranks] for r in range(n_ranks)}
    got: dict[int, object] = {}
    t_start: dict[int, float] = {}
    t_end: dict[int, float] = {}

    def run(r: int) -> None:
        t_start[r] = time.monotonic()
        try:
            got[r] = attach(job, r, n_ranks, max_num_tokens=8, top_k=2, num_experts=n_ranks, workspace_size_per_rank=1 << 16,
                            runtime_dir=daemons[node_of[r]].runtime_dir, timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 - reported below
            got[r] = exc
        t_end[r] = time.monotonic()

    threads = {r: threading.Thread(target=run, args=(r,), daemon=True) for r in range(n_ranks)}
    last = n_ranks - 1
    for r in range(last):
        threads[r].start()

    def waiting() -> int:
        total = 0
        for n, d in daemons.items():
            try:
                info = d.request("job_info", job=job)
            except Exception:
                continue
            total += sum(1 for q in info["ranks"] if q["state"] == "joining" and q.get("node") == n)
        return total

    end = time.monotonic() + args.timeout
    while waiting() < last:
        if time.monotonic() > end or any(isinstance(v, Exception) for v in got.values()):
            break
        time.sleep(0.02)
    threads[last].start()
    for th in threads.values():
        th.join(args.timeout + 15)
    failed = {r: v for r, v in got.items() if isinstance(v, Exception)}
    if failed or len(got) != n_ranks:
        print(f"{job}: {len(failed)} rank(s) failed, {n_ranks - len(got)} never returned: "
              f"{ {r: str(v)[:200] for r, v in list(failed.items())[:5]} }")
        for a in got.values():
            if not isinstance(a, Exception):
                a.close()
        return False
    released = [t_end[r] for r in range(n_ranks)]
    rendezvous_ms = (max(released) - t_start[last]) * 1e3
    spread_ms = (max(released) - min(released)) * 1e3
    # every rank writes its mark into its own row, then must see every other rank's
    for r, a in got.items():
        a.workspace[r, 4096:4100] = torch.tensor([r + 1, 0xA5, r % 256, 0x5A], dtype=torch.uint8)
    missing = 0
    for r, a in got.items():
        marks = a.workspace[:, 4096]
        missing += int((marks != torch.arange(1, n_ranks + 1, dtype=torch.uint8)).sum())
    coordinator = got[0].request("job_info", job=job)["domain"]["coordinator"]
    coord = daemons[coordinator].request("domain")["federation"]["coordinated_rendezvous_ms"]
    per_daemon = {n: d.request("status")["rendezvous_latency_ms"]["last"] for n, d in daemons.items()}
    for a in got.values():
        a.close()
    print(f"{job}: {n_ranks} ranks over {len(names)} daemons ({n_ranks // len(names)} per daemon, threads of one process): "
          f"last rank's attach call -> every rank released and mapped: {rendezvous_ms:.1f} ms; "
          f"releases spread over {spread_ms:.1f} ms; the last rank's daemon {node_of[last]}: its join -> its release "
          f"{per_daemon[node_of[last]]} ms; coordinator {coordinator}: last join it saw -> release sent "
          f"{coord['last']} ms; every daemon, last join it saw -> its release (ms): {per_daemon}; "
          f"attach calls p50 {statistics.median(t_end[r] - t_start[r] for r in range(last)) * 1e3:.0f} ms for the "
          f"{last} early ranks (they waited for the last); every rank saw all {n_ranks} rows' marks: {missing == 0}")
    return missing == 0


if __name__ == "__main__":
    sys.exit(main())
