"""``MoeAlltoAll`` without ``job=``: a one-rank group needs no name and no communicator, and an
MPI job agrees through mpi4py's COMM_WORLD as FlashInfer does. Real processes against a real
host-backend daemon (MPI ranks started by a real ``mpiexec``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_ranks

TESTS = Path(__file__).parent


def _solo_rank(rank, runtime_dir, barrier):
    """One process, one-rank groups without job=: two instances of one geometry share a name
    (and attachment); another geometry is another job; every round matches the reference."""
    import torch

    from a2ad.client import MoeAlltoAll
    from helpers import Mapping
    from test_flashinfer_parity import HIDDEN, MAX_TOKENS, NUM_EXPERTS, TOP_K, _expert, _round

    assert not torch.distributed.is_initialized()
    a = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, runtime_dir=runtime_dir,
                    timeout=30.0)
    b = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, runtime_dir=runtime_dir,
                    timeout=30.0)
    other = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=2 * HIDDEN,
                        runtime_dir=runtime_dir, timeout=30.0)
    try:
        names = [x.attachment.job for x in (a, b, other)]
        for i, x in enumerate((a, b)):
            rt, inputs, _, combined = _round(1400 + 10 * rank + i, 1, tokens=[4])
            mine = inputs[0]
            got = x.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, -1, 1)
            assert torch.equal(x.combine(_expert(got, 0, 1), rt), combined[0])
        barrier.wait(60)  # both processes hold their jobs at once
        return names
    finally:
        for x in (a, b, other):
            x.close()


def test_one_rank_group_needs_no_job_name(daemon):
    """Mapping(rank=0, world_size=1) with no job= and no communicator attaches; two processes
    of the same geometry, attached at once, get different jobs (no clash), each a job of
    one rank; two instances in a process share theirs."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    res = run_ranks(_solo_rank, [0, 1], args=(str(daemon.runtime_dir), barrier), timeout=180.0, ctx=ctx)
    for r in (0, 1):
        a, b, other = res[r]
        assert a == b, f"rank {r}: instances of one geometry got different jobs {a!r}, {b!r}"
        assert other != a
    assert res[0][0] != res[1][0] and res[0][2] != res[1][2], f"two processes shared a one-rank job: {res}"
