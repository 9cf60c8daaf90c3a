"""What one eager MoeAlltoAll.dispatch + combine pair costs on the host.

A one-rank job (it needs no peer, so the figures are the client's own): the eager pair
(many pairs back to back, one synchronize), the same pair replayed from a CUDA graph (cuda
backend), and a cProfile of eager pairs (top items by own time). Starts its own daemon.

A host's CPU can run at different speeds from one process to the next (shared or throttled
machines: the same tree measured 27 us in one run and 45 us in the next), so the eager pairs
are timed in batches, each beside a batch of a reference of the same kind of host work: two
in-place torch ops on a tensor of the pair's device (two launches through torch's dispatcher
on CUDA). The ratio eager pair / reference is what to compare between trees on such a host;
the script prints each batch's ratio, and their median.

    python3 scripts/profile-eager.py [--backend cuda|host] [--tokens 1] [--hidden 7168]
                                     [--pairs 2000] [--batches 10] [--no-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

from _eager_pair import add_pair_arguments, eager_pair, positive


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(ap, "the daemon's memory backend: cuda (default; one GPU) or host (no GPU; no graph replay)")
    ap.add_argument("--pairs", type=positive, default=2000, help="pairs timed (split over the batches), and profiled")
    ap.add_argument("--batches", type=positive, default=10,
                    help="batches of eager pairs, each timed beside a batch of the reference (default 10)")
    ap.add_argument("--no-profile", action="store_true", help="leave out the cProfile of eager pairs")
    args = ap.parse_args()
    if args.batches > args.pairs:
        ap.error(f"--batches ({args.batches}) must not exceed --pairs ({args.pairs}): each batch times at least one pair")
    if args.top_k > args.experts:
        ap.error(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")

    import torch

    cuda = args.backend == "cuda"
    if cuda and not torch.cuda.is_available():
        print("profile-eager: no CUDA GPU here; --backend host profiles the host backend", file=sys.stderr)
        return 2

    T, H, K = args.tokens, args.hidden, args.top_k
    with eager_pair(args.backend, T, H, K, args.experts) as job:
        pair, sync, timed = job.pair, job.sync, job.timed
        # Batches of pairs beside batches of the reference, which goes first every other batch.
        sizes = [args.pairs // args.batches + (1 if b < args.pairs % args.batches else 0) for b in range(args.batches)]
        pair_s, ref_us, ratios = 0.0, [], []
        for b, n in enumerate(sizes):
            p, r = job.batch(n, reference_first=b % 2 == 1)
            pair_s += p
            ref_us.append(r / n * 1e6)
            ratios.append(p / r)
        eager = pair_s / args.pairs * 1e6

        t0 = time.perf_counter()
        for _ in range(args.pairs):
            pair()
        host = (time.perf_counter() - t0) / args.pairs * 1e6  # the host's issue time (the GPU trails)
        sync()

        replay = None
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                pair()
            torch.cuda.synchronize()
            for _ in range(50):
                graph.replay()
            replay = timed(graph.replay, args.pairs) / args.pairs * 1e6

        if not args.no_profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.pairs):
                pair()
            prof.disable()
            sync()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(out.getvalue())
    graph_part = (f"graph replay of the pair {replay:.2f} us, eager - graph {eager - replay:+.2f} us"
                  if replay is not None else "no graph replay (host backend)")
    print(f"one rank, T={T}, hidden={H}, top_k={K}, backend {args.backend}: eager pair {eager:.2f} us "
          f"(host issue {host:.2f} us), {graph_part}")
    print(f"reference (two in-place torch ops on a [{T}, {H}] bf16 tensor of the pair's device): "
          f"{statistics.median(ref_us):.2f} us; eager pair / reference {statistics.median(ratios):.3f} "
          f"(median of {len(ratios)} batches; batch ratios {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
