#!/usr/bin/env python3
"""The MoE layer of moe_layer.py, its communication written for FlashInfer and for a2ad.

The forward pass (``moe_layer.moe_forward``: route, ``dispatch``, local experts,
``combine``) is one function that works with either ``MoeAlltoAll``: the two classes
take the same arguments and have the same ``dispatch``/``combine``. What differs is only
how the object is made, in the two functions below:

    FlashInfer                                          a2ad
    from flashinfer.comm.trtllm_moe_alltoall            from a2ad.client import MoeAlltoAll
        import MoeAlltoAll
    (a torch.distributed group to exchange the          (the daemon allocates the workspace and
     workspace handles: FlashInfer allocates the         runs the rendezvous)
     workspace in every worker)
    MoeAlltoAll(mapping, ..., mnnvl_config=cfg)         MoeAlltoAll(mapping, ..., mnnvl_config=cfg,
                                                                    job="model-ep")   # cfg is ignored

Run with no arguments it runs both sides when FlashInfer imports and the GPUs are there
(FlashInfer's MoeAlltoAll needs one CUDA GPU per rank), else the a2ad side alone (host
memory where there is no GPU) and says why the FlashInfer side was skipped. Each side's
result is checked against the same layer computed in one process. The last line is
``switch_from_flashinfer: OK`` or ``... FAIL``.

    python3 examples/switch_from_flashinfer.py
    python3 examples/switch_from_flashinfer.py --sides a2ad --ranks 4
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile

from helpers.layer_args import add_arguments, check_arguments  # examples/helpers/layer_args.py


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--sides", choices=["both", "a2ad", "flashinfer"], default="both",
                        help="which MoeAlltoAll to run (default both; FlashInfer only where it can run)")
    return check_arguments(parser, parser.parse_args(argv))


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported, so that --help and a usage error answer at once

import torch  # noqa: E402

import moe_layer  # noqa: E402  examples/moe_layer.py, beside this file

NAME = "switch_from_flashinfer"


# ---------------------------------------------------------------------------
# The two ways to make the MoeAlltoAll. Everything else is shared.
# ---------------------------------------------------------------------------
def flashinfer_moe_alltoall(handle_exchange_file: str, run: moe_layer.RunConfig, rank: int, device: torch.device):
    """FlashInfer's MoeAlltoAll for ``rank`` (in the rank's process, on its GPU)."""
    import torch.distributed as dist
    from flashinfer.comm.mapping import Mapping
    from flashinfer.comm.mnnvl import MnnvlMemory, TorchDistBackend
    from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll

    # FlashInfer allocates the workspace in this process and exchanges the memory handles
    # with the other ranks itself, through a communicator (MPI, or torch.distributed here)
    dist.init_process_group("gloo", init_method=f"file://{handle_exchange_file}", rank=rank, world_size=run.ranks)
    MnnvlMemory.comm = TorchDistBackend(group=dist.group.WORLD)
    mapping = Mapping(world_size=run.ranks, rank=rank, gpus_per_node=run.ranks, tp_size=run.ranks,
                      moe_ep_size=run.ranks)
    cfg = run.layer
    return MoeAlltoAll(mapping, cfg.max_tokens, cfg.top_k, cfg.num_experts, hidden_size=cfg.hidden,
                       mnnvl_config=None)


def a2ad_moe_alltoall(run: moe_layer.RunConfig, rank: int, device: torch.device):
    """a2ad's MoeAlltoAll for ``rank``: the daemon on ``run.runtime_dir`` owns the workspace."""
    from a2ad.client import MoeAlltoAll

    class Mapping:  # a2ad reads only these two attributes; FlashInfer's Mapping works too
        moe_ep_rank = rank
        moe_ep_size = run.ranks

    cfg = run.layer
    return MoeAlltoAll(Mapping(), cfg.max_tokens, cfg.top_k, cfg.num_experts, hidden_size=cfg.hidden,
                       mnnvl_config=None,  # accepted and ignored: the daemon picks the memory handles
                       job=run.job,  # every rank of the group names the same job
                       runtime_dir=run.runtime_dir, device=device if device.type == "cuda" else None,
                       timeout=run.timeout)


def flashinfer_unavailable(ranks: int) -> str | None:
    """Why FlashInfer's side cannot run here, or None when it can."""
    try:
        import flashinfer.comm.trtllm_moe_alltoall  # noqa: F401
    except Exception as exc:  # ImportError, or a build that fails to load
        return f"flashinfer.comm.trtllm_moe_alltoall does not import ({type(exc).__name__}: {exc})"
    if torch.cuda.device_count() < ranks:
        return f"FlashInfer's MoeAlltoAll needs one CUDA GPU per rank: {ranks} ranks, " \
               f"{torch.cuda.device_count()} GPU(s) visible"
    return None


def pick_sides(requested: str, ranks: int) -> tuple[list[str], str | None]:
    """The sides to run (``"flashinfer"``, ``"a2ad"``) and why FlashInfer's was skipped."""
    want_fi = requested in ("both", "flashinfer")
    why = flashinfer_unavailable(ranks) if want_fi else None
    sides = []
    if want_fi and why is None:
        sides.append("flashinfer")
    if requested in ("both", "a2ad") or (want_fi and why is not None):
        sides.append("a2ad")  # the fallback when FlashInfer was asked for and is not there
    return sides, why


# ---------------------------------------------------------------------------
def run_flashinfer(args) -> bool:
    folder = tempfile.mkdtemp(prefix="fi-handles-")
    try:
        run = moe_layer.run_config(args, runtime_dir="", backend="cuda", job="")
        make = functools.partial(flashinfer_moe_alltoall, os.path.join(folder, "init"))
        return moe_layer.run_ranks(run, make, name=f"{NAME} [flashinfer]")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_a2ad(args) -> bool:
    backend = args.backend or moe_layer.default_backend()
    with moe_layer.a2ad_daemon(args.runtime_dir, backend, NAME) as (runtime_dir, backend):
        run = moe_layer.run_config(args, runtime_dir, backend, job=f"switch-{os.getpid()}")
        print(f"{NAME}: a2ad side: {run.ranks} ranks, backend {backend}", flush=True)
        return moe_layer.run_ranks(run, a2ad_moe_alltoall, name=f"{NAME} [a2ad]")


def main(args: argparse.Namespace | None = None) -> int:
    args = parse_args() if args is None else args
    sides, why = pick_sides(args.sides, args.ranks)
    print(f"{NAME}: the differences: the import (flashinfer.comm.trtllm_moe_alltoall -> a2ad.client), "
          f"job= (a2ad: the group's name), mnnvl_config (a2ad: accepted and ignored); "
          f"dispatch/combine calls are the same code for both")
    if why is not None:
        print(f"{NAME}: FlashInfer side skipped: {why}")
    results = {}
    for side in sides:
        try:
            results[side] = run_flashinfer(args) if side == "flashinfer" else run_a2ad(args)
        except Exception as exc:
            print(f"{NAME}: {side} side: {type(exc).__name__}: {exc}", file=sys.stderr)
            results[side] = False
        print(f"{NAME}: {side} side: {'matched the one-process layer' if results[side] else 'FAILED'}", flush=True)
    ok = bool(results) and all(results.values())
    print(f"{NAME}: {'OK' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
