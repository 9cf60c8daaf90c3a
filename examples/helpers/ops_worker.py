#!/usr/bin/env python3
"""One worker of examples/ops_restart.sh: runs the MoE layer of moe_layer.py round after round.

A helper, not an example of its own (hence its folder): ops_restart.sh starts it with the
arguments it needs.

Every round is a forward through a2ad (dispatch, local experts, combine) checked against the
same layer computed in this process. A token's result depends only on this rank's tokens and
the shared weights, so the check holds whatever round number the peers are at (a
replacement starts counting at 1).

When a peer dies the round raises PeerLost; the worker then calls ``recover()``, which
returns once a replacement has joined as the dead rank and every rank has recovered, and
goes on. It writes its count of verified rounds to ``--progress`` after each round, and
stops when the file ``--stop`` appears (a peer that already stopped makes the last round
end in PeerLeft: fine at that point). Exit status 0 when every round verified.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROUND_TOKENS = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True, help="this worker's expert-parallel rank")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the job (default 2)")
    p.add_argument("--job", default="ops-example", help="the job's name (default ops-example)")
    p.add_argument("--runtime-dir", required=True, help="the daemon's runtime folder")
    p.add_argument("--progress", required=True, help="file that holds the number of verified rounds")
    p.add_argument("--stop", required=True, help="stop once this file exists")
    p.add_argument("--pause", type=float, default=0.02, help="seconds between rounds (default 0.02)")
    p.add_argument("--timeout", type=float, default=30.0, help="bound of the rendezvous, of every wait and of recover, seconds (default 30)")
    args = p.parse_args()
    # imported once the arguments are parsed, so that --help and a usage error answer at once
    import torch

    from a2ad.client import A2ADError, MoeAlltoAll, PeerLost

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import moe_layer  # examples/moe_layer.py

    torch.set_num_threads(1)
    say = lambda msg: print(f"  [worker {args.rank}, pid {os.getpid()}] {msg}", flush=True)  # noqa: E731

    cfg = moe_layer.Config(max_tokens=ROUND_TOKENS)
    layer = moe_layer.MoELayer(cfg, torch.device("cpu"), args.rank, args.ranks)
    reference = moe_layer.MoELayer(cfg, torch.device("cpu"))

    class Mapping:
        moe_ep_rank = args.rank
        moe_ep_size = args.ranks

    a2a = MoeAlltoAll(Mapping(), cfg.max_tokens, cfg.top_k, cfg.num_experts, hidden_size=cfg.hidden,
                      job=args.job, runtime_dir=args.runtime_dir, timeout=args.timeout)
    say(f"joined job {args.job!r} as rank {args.rank}/{args.ranks} (generation {a2a.generation})")
    verified = 0
    g = torch.Generator().manual_seed(1000 + args.rank)
    try:
        while not os.path.exists(args.stop):
            x = torch.randn(ROUND_TOKENS, cfg.hidden, generator=g).to(torch.bfloat16)
            try:
                out, _ = moe_layer.moe_forward(a2a, layer, x, ROUND_TOKENS)
            except PeerLost as exc:
                if os.path.exists(args.stop):
                    break  # a peer stopped first
                say(f"round {verified + 1}: {type(exc).__name__}: {exc}")
                say("calling recover(): waits for a replacement of the lost rank")
                t0 = time.monotonic()
                gen = a2a.recover(timeout=args.timeout)
                say(f"recovered in {time.monotonic() - t0:.2f} s: generation {gen}; rounds resume")
                continue
            ok, rel = moe_layer.compare(out, reference.forward_local(x))
            if not ok:
                say(f"round {verified + 1}: MISMATCH (max rel diff {rel:.2e})")
                return 1
            verified += 1
            with open(args.progress + ".tmp", "w") as f:
                f.write(str(verified))
            os.replace(args.progress + ".tmp", args.progress)
            if verified % 50 == 0:
                say(f"{verified} rounds verified")
            time.sleep(args.pause)
    except A2ADError as exc:
        say(f"failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        a2a.close()
    say(f"stopping after {verified} verified rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
