"""The eager pair that scripts/profile-eager.py and scripts/eager-ab.py time: a one-rank job
(it needs no peer, so the figures are the client's own) on a daemon of its own, one
MoeAlltoAll.dispatch + combine of T tokens, and a reference of the same kind of host work
(two in-place torch ops on a tensor of the pair's device: two launches through torch's
dispatcher on CUDA).

Only the public client API is used (MoeAlltoAll, DaemonLauncher), so that eager-ab.py can run
it against an installed package of another tree."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_pair_arguments(ap: argparse.ArgumentParser, backend_help: str) -> None:
    """The pair's arguments: --backend, --tokens, --hidden, --top-k, --experts."""
    ap.add_argument("--backend", choices=["cuda", "host"], default="cuda", help=backend_help)
    ap.add_argument("--tokens", type=positive, default=1)
    ap.add_argument("--hidden", type=positive, default=7168)
    ap.add_argument("--top-k", type=positive, default=8)
    ap.add_argument("--experts", type=positive, default=256)


@contextlib.contextmanager
def eager_pair(backend: str, tokens: int, hidden: int, top_k: int, experts: int):
    """Yields a namespace, once 200 pairs and references have run (warm): ``pair()``,
    ``reference()``, ``sync()``, ``timed(fn, n)`` (seconds for n calls of fn, synchronized before
    and after), ``batch(n, reference_first)`` (the seconds of n pairs and of n references, timed
    one after the other in that order) and ``a2a``. The job and its daemon end on exit."""
    import torch

    from a2ad.client import MoeAlltoAll
    from a2ad.tools.launcher import DaemonLauncher

    cuda = backend == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    folder = Path(tempfile.mkdtemp(prefix="a2ad-eager-"))
    daemon = DaemonLauncher(folder / "rt", "--backend", backend).start()
    try:
        class Mapping:
            moe_ep_rank, moe_ep_size = 0, 1

        T, H, K = tokens, hidden, top_k
        a2a = MoeAlltoAll(Mapping(), T, K, experts, hidden_size=H, job="profile", runtime_dir=daemon.runtime_dir)
        try:
            dev = a2a.workspace.device
            ids = torch.randint(0, experts, (T, K), dtype=torch.int32, device=dev)
            x = torch.randn(T, H, device=dev).to(torch.bfloat16)
            scales = torch.rand(T, K, device=dev)
            payloads = [x, ids, scales]
            ref = torch.zeros(T, H, device=dev, dtype=torch.bfloat16)

            def pair():
                recv = a2a.dispatch(ids, payloads, T)
                return a2a.combine(recv[0], T)

            def reference():
                ref.add_(1.0)
                ref.mul_(0.5)

            def timed(fn, n):
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                return time.perf_counter() - t0

            def batch(n, reference_first):
                if reference_first:
                    r = timed(reference, n)
                    return timed(pair, n), r
                p = timed(pair, n)
                return p, timed(reference, n)

            for _ in range(200):
                pair()
                reference()
            sync()
            yield SimpleNamespace(pair=pair, reference=reference, sync=sync, timed=timed, batch=batch, a2a=a2a)
        finally:
            a2a.close()
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
