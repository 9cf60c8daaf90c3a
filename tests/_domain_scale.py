"""What the domain scale tests share: many real daemons on this machine, ranks as threads of
a few processes (one process per node, or per rank where a rank alone is killed), and the
message counters of every daemon.

``host_ranks`` runs a group of ranks as threads of one process (each test_domain's
``serve_rank``), ``Group`` starts, kills and reaps those
processes and collects what their ranks report (``RankReports``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from pathlib import Path

from a2ad import protocol
from helpers import RankReports, wait_for
from test_domain import Cluster, serve_rank, write_domain


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def host_ranks(ranks, ep, runtime_dir, shm, job, policy, shared, results, seed, hold):
    """The ranks of one group as threads of this process (``hold``: the rank that waits for go)."""
    os.environ[protocol.SHM_DIR_ENV] = shm
    import torch

    torch.set_num_threads(1)
    ths = [threading.Thread(target=serve_rank, args=(r, ep, runtime_dir, shm, job, policy, shared, results,
                                                     seed * 1000 + r, r == hold), daemon=True) for r in ranks]
    for th in ths:
        th.start()
    for th in ths:
        th.join()


class Group(RankReports):
    """Rank processes of one job (each a group of rank threads); every wait is bounded and
    ``close`` ends every process still running."""

    def __init__(self, ep, job, policy, shm):
        # rank processes fork from one server that imported torch and the client once: many
        # of them start in a fraction of the CPU that as many interpreters importing torch take
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "a2ad.client", "_domain_scale"])
        super().__init__(self.ctx)
        self.ep, self.job, self.policy, self.shm = ep, job, policy, str(shm)
        self.shared = {"done": self.ctx.Array("l", ep, lock=False), "round": self.ctx.Array("l", ep, lock=False),
                       "stop": self.ctx.Value("l", 0, lock=False), "go": self.ctx.Value("l", 0, lock=False),
                       "closing": self.ctx.Value("l", 0, lock=False)}
        self.procs: dict[str, mp.Process] = {}
        self.ranks: dict[str, list[int]] = {}

    def start(self, key, ranks, runtime_dir, seed, hold=None):
        p = self.ctx.Process(target=host_ranks, args=(list(ranks), self.ep, str(runtime_dir), self.shm, self.job,
                                                      self.policy, self.shared, self.results, seed, hold), daemon=True)
        p.start()
        self.procs[key], self.ranks[key] = p, list(ranks)

    def expect(self, what, ranks, timeout=90.0) -> dict:
        """RankReports.expect; on a timeout the message also says what the missing ranks did
        report meanwhile (their latest reports)."""
        try:
            return super().expect(what, ranks, timeout)
        except AssertionError as exc:
            self.drain()
            said = {}
            for r, kind, t, v in self.backlog:
                said.setdefault(r, []).append((kind, round(t, 3), str(v)[:120]))
            missing = [r for r in ranks if not any(k == what for k, _, _ in said.get(r, []))]
            raise AssertionError(f"{exc}; what ranks {missing[:8]} reported meanwhile: "
                                 f"{ {r: said.get(r, [])[-4:] for r in missing[:8]} }") from None

    def kill(self, key):
        os.kill(self.procs[key].pid, signal.SIGKILL)
        self.procs[key].join(10)
        for r in self.ranks[key]:
            self.forget(r)

    def stop_after(self, rounds: int, timeout: float = 120.0) -> int:
        """Every rank stops ``rounds`` rounds after the furthest one; their verified rounds in all."""
        return self.stop_ranks(range(self.ep), rounds, timeout)

    def stop_ranks(self, ranks, rounds: int, timeout: float = 120.0) -> int:
        """``ranks`` stop ``rounds`` rounds after the furthest of them and close together."""
        ranks = list(ranks)
        self.shared["stop"].value = max(self.shared["round"][r] for r in ranks) + rounds
        done = self.expect("done", ranks, timeout=timeout)
        self.shared["closing"].value = 1
        return sum(v for _, v in done.values())

    def close(self):
        self.end_processes(self.procs.values())


class ScaleCluster(Cluster):
    """Cluster of test_domain with daemons started in parallel and logging at info level (a
    debug log of many daemons costs this machine's CPUs more than their work does)."""

    # a daemon started again while the ranks of every other node serve rounds flat out shares
    # 2 CPUs with all of them: seen answering after 3-7 s here, and not within 30 s in a CI run
    start_timeout = 120.0

    def __init__(self, tmp, names, **domain_kw):
        super().__init__(tmp, names, **domain_kw)
        if len(set(self.ports.values())) != len(self.ports):  # free_port may hand out one port twice
            socks = []
            try:
                for _ in names:
                    s = socket.socket()
                    s.bind(("127.0.0.1", 0))
                    socks.append(s)
                self.ports = {n: s.getsockname()[1] for n, s in zip(names, socks)}
            finally:
                for s in socks:
                    s.close()
            self.config = write_domain(tmp, self.ports, **domain_kw)

    def start(self, node, config=None, env=None, *args):
        return super().start(node, config, env, "--log-level", "info", *args)

    def start_all(self, names) -> None:
        errs: list = []

        def one(n):
            try:
                self.start(n)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errs.append((n, exc))

        ths = [threading.Thread(target=one, args=(n,)) for n in names]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        if errs:
            raise AssertionError(f"daemon(s) did not start: {errs[:3]}")

    def wait_all_up(self, names, timeout: float = 60.0) -> None:
        def all_up():
            return all(all(s in ("up", "self") for s in self.states(n).values()) for n in names)

        wait_for(all_up, timeout, f"all {len(names)} daemons to see each other up", interval=0.2)

    def link_events(self, names) -> dict:
        """Peer losses, ups and failed sends, summed over the daemons of ``names``."""
        out = {"losses": 0, "ups": 0, "connects": 0, "send_drops": 0, "handshake_failures": 0, "gate_restarts": 0,
               "shed_connections": 0}
        for n in names:
            st = self.domain(n)
            out["gate_restarts"] += st["gate"]["restarts"]
            out["shed_connections"] += st["gate"]["shed_connections"]
            for p in st["nodes"]:
                for k in out:
                    out[k] += p.get(k, 0)
        return out

    def counts(self, names) -> dict[str, dict]:
        """Per node: {"sent": {type: n}, "received": {type: n}, "bytes_sent": {type: n}}."""
        out = {}
        for n in names:
            st = self.domain(n)
            out[n] = {"sent": st["messages_by_type"]["sent"], "received": st["messages_by_type"]["received"],
                      "bytes_sent": st["bytes_by_type"]["sent"]}
        return out


def diff_counts(a: dict, b: dict) -> dict:
    return {n: {k: {t: b[n][k][t] - a[n][k][t] for t in b[n][k]} for k in b[n]} for n in b}


def summarize(d: dict, seconds: float | None = None) -> dict:
    """Totals over the nodes and the busiest node, by type (per second with ``seconds``)."""
    types = sorted({t for v in d.values() for t in v["sent"]})
    total = {t: sum(v["sent"][t] for v in d.values()) for t in types}
    busiest_sent = max(sum(v["sent"].values()) for v in d.values())
    busiest_recv = max(sum(v["received"].values()) for v in d.values())
    out = {"total_sent": sum(total.values()), "by_type": {t: n for t, n in total.items() if n},
           "busiest_node_sent": busiest_sent, "busiest_node_received": busiest_recv,
           "bytes_sent": sum(sum(v["bytes_sent"].values()) for v in d.values())}
    if seconds:
        out = {k: (round(v / seconds, 1) if isinstance(v, int) else {t: round(n / seconds, 1) for t, n in v.items()})
               for k, v in out.items()}
    return out


def placement(ep: int, names: list[str]) -> dict[int, str]:
    return {r: names[r * len(names) // ep] for r in range(ep)}


def job_coordinated_by(node: str, prefix: str, names) -> str:
    from a2ad.daemon.core.federation import coordinator_order

    return next(f"{prefix}-{i}" for i in range(100000) if coordinator_order(f"{prefix}-{i}", names)[0] == node)


def lost_seen_at(cluster: Cluster, names, victim: str, timeout: float) -> dict[str, float]:
    """When each daemon of ``names`` counted ``victim`` down (CLOCK_MONOTONIC, from its
    ``state_for_s``), waiting (bounded) until every one did."""
    seen: dict[str, float] = {}
    end = time.monotonic() + timeout
    while set(seen) != set(names):
        for n in names:
            if n in seen:
                continue
            t0 = _now()
            peer = cluster.links(n)[victim]
            if peer["state"] == "down":
                seen[n] = t0 - peer["state_for_s"]
        if time.monotonic() > end:
            raise AssertionError(f"nodes {sorted(set(names) - set(seen))} did not count {victim} lost within {timeout} s")
        time.sleep(0.05)
    return seen


__all__ = ["Group", "ScaleCluster", "diff_counts", "summarize", "placement", "job_coordinated_by", "lost_seen_at",
           "Path", "_now"]
