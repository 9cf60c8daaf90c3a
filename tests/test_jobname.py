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


# --------------------------------------------------------------------------- MPI
def _mpiexec():
    """mpiexec beside this Python (an MPI installed into its environment), else on PATH."""
    near = Path(sys.executable).parent / "mpiexec"
    return str(near) if near.exists() else shutil.which("mpiexec")


def _mpi_rank(runtime_dir: str, import_first: str) -> None:
    """One MPI rank (started by mpiexec): MoeAlltoAll without job= and without torch.distributed,
    then one round checked against the reference; prints what it saw as one JSON line."""
    if import_first == "1":
        from mpi4py import MPI  # noqa: F401  (initializes MPI, as FlashInfer's MpiComm does)
    import torch

    from a2ad.client import MoeAlltoAll
    from helpers import Mapping
    from test_flashinfer_parity import HIDDEN, MAX_TOKENS, NUM_EXPERTS, TOP_K, _expert, _round

    imported_before = "mpi4py.MPI" in sys.modules
    env = os.environ
    rank = int(env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK") or env["PMIX_RANK"])
    size = int(env.get("PMI_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 2)
    a2a = MoeAlltoAll(Mapping(rank, size), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN,
                      runtime_dir=runtime_dir, timeout=60.0)
    try:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rt, inputs, _, combined = _round(1500, size)
        mine = inputs[rank]
        got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, -1, 1)
        ok = torch.equal(a2a.combine(_expert(got, rank, size), rt), combined[rank])
        print(json.dumps({"rank": rank, "mpi_rank": world.Get_rank(), "job": a2a.attachment.job, "ok": ok,
                          "imported_before": imported_before, "dist": torch.distributed.is_initialized()}),
              flush=True)
    finally:
        a2a.close()


@pytest.mark.parametrize("import_first", ["1", "0"], ids=["mpi4py-imported", "under-mpiexec"])
def test_mpi_ranks_agree_on_a_job_through_comm_world(daemon, import_first):
    """Two ranks started by mpiexec, no job=, no torch.distributed, no FlashInfer: they agree on
    one job through mpi4py's COMM_WORLD (FlashInfer's default communicator), whether the program
    imported mpi4py or only runs under the launcher, and run a round on it."""
    pytest.importorskip("mpi4py", reason="mpi4py (and an MPI) are needed for the MPI agreement test")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_jobname as t; "
            "t._mpi_rank(sys.argv[1], sys.argv[2])")
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-c", code, str(daemon.runtime_dir), import_first],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1], out
    assert all(x["rank"] == x["mpi_rank"] and x["ok"] and not x["dist"] for x in lines), lines
    assert all(x["imported_before"] == (import_first == "1") for x in lines), lines
    assert lines[0]["job"] == lines[1]["job"] and lines[0]["job"].startswith("fi-2x"), lines
