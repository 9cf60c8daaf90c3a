"""What one eager MoeAlltoAll.dispatch + combine pair costs on the host, on one GPU.

A one-rank job (it needs no peer, so the figures are the client's own): the eager pair
(many pairs back to back, one synchronize), the same pair replayed from a CUDA graph, and
a cProfile of eager pairs (top items by own time). Starts its own daemon.

    python3 scripts/profile-eager.py [--tokens 1] [--hidden 7168] [--pairs 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=2000)
    args = ap.parse_args()

    import torch

    from a2ad.client import MoeAlltoAll
    from a2ad.tools.launcher import DaemonLauncher

    folder = Path(tempfile.mkdtemp(prefix="a2ad-prof-"))
    daemon = DaemonLauncher(folder / "rt", "--backend", "cuda").start()
    try:
        class Mapping:
            moe_ep_rank, moe_ep_size = 0, 1

        T, H, K = args.tokens, args.hidden, args.top_k
        a2a = MoeAlltoAll(Mapping(), T, K, args.experts, hidden_size=H, job="profile", runtime_dir=daemon.runtime_dir)
        dev = a2a.workspace.device
        experts = torch.randint(0, args.experts, (T, K), dtype=torch.int32, device=dev)
        hidden = torch.randn(T, H, device=dev).to(torch.bfloat16)
        scales = torch.rand(T, K, device=dev)
        payloads = [hidden, experts, scales]

        def pair():
            recv = a2a.dispatch(experts, payloads, T)
            return a2a.combine(recv[0], T)

        for _ in range(200):
            pair()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.pairs):
            pair()
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / args.pairs * 1e6

        t0 = time.perf_counter()
        for _ in range(args.pairs):
            recv = a2a.dispatch(experts, payloads, T)
            a2a.combine(recv[0], T)
        host = (time.perf_counter() - t0) / args.pairs * 1e6  # the host's issue time (the GPU trails)
        torch.cuda.synchronize()

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            pair()
        torch.cuda.synchronize()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.pairs):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t0) / args.pairs * 1e6

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.pairs):
            pair()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        a2a.close()
        print(out.getvalue())
        print(f"one rank, T={T}, hidden={H}, top_k={K}: eager pair {eager:.2f} us (host issue {host:.2f} us), "
              f"graph replay of the pair {replay:.2f} us, eager - graph {eager - replay:+.2f} us")
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
