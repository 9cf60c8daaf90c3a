"""The options of examples/moe_layer.py (and of switch_from_flashinfer.py, which adds its own).

A helper, not an example: it imports no torch, so that the examples parse their options, and
answer --help or a usage error, before they import torch.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="forward passes (default 3)")
    parser.add_argument("--tokens", type=int, default=32, help="most tokens per rank per round (default 32)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--ffn", type=int, default=256, help="expert FFN size (default 256)")
    parser.add_argument("--experts", type=int, default=8, help="experts in the layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--backend", choices=["host", "cuda"], default=None,
                        help="workspace memory for a daemon started here (default: cuda when GPUs are visible)")
    parser.add_argument("--runtime-dir", help="a running daemon's runtime folder (default: $A2AD_RUNTIME_DIR, "
                        "else start a daemon in a temp folder)")
    parser.add_argument("--seed", type=int, default=0, help="weights, routing and inputs seed (default 0)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds for the rendezvous and every wait (default 30)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.experts < args.ranks or not 1 <= args.top_k <= args.experts:
        parser.error("need --experts >= --ranks and 1 <= --top-k <= --experts")
    return args
