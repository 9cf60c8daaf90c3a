"""The ``flashinfer.moe_ep`` communication backed by a2ad against FlashInfer 0.7.2's own
``MoeAlltoAll``, several ranks on one GPU, the same inputs (tests/moe_ep_cases.py runs both).

a2ad: ``A2adAlltoAll`` (a2ad.integrations.flashinfer) in 2 or 4 spawned rank processes on
cuda:0, on a real cuda-backend daemon. FlashInfer: its ``MoeAlltoAll`` with every rank in
one process, each on its own stream, over one ``[ep, size_per_rank]`` workspace (its kernels
wait for their peers inside the kernel, so all ranks' grids must be resident at once: at
most 16 tokens per rank here, a block per token). Same seeded tokens, expert ids, weights,
the same toy experts; eager rounds and CUDA graphs (dispatch + experts + combine captured
once per rank, replayed with new inputs copied into the static buffers).

Compared per round and rank: what each rank received from each source, as sets of rows
(hidden, ids, weights; the slot order within a source is each library's arrival order),
against the reference and between the two libraries, with every empty slot's ids
sanitized to the invalid id by both; the combine outputs, exactly equal between the two for
2 ranks (a token reaches at most 2 ranks, and a float32 sum of two terms does not depend
on the order), for 4 ranks within one bfloat16 step plus the float32 rounding of the sum of
magnitudes (a2ad sums a token's contributions in rank order, FlashInfer by a tree), and each
within the cuda data plane's bf16 tolerance of the reference.

The host-backend test runs a2ad's half of the same harness on the CPU, against the reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import moe_ep_cases as cases
from integration_cases import run_group


def _expected(seed: int, tokens: list[int], rt: int, hidden: int, ep: int):
    """(what each rank receives, each rank's combine, each rank's sum of |contributions|)."""
    from a2ad.client import reference as ref

    inputs = cases.make_inputs(seed, tokens, hidden)
    payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, cases.NUM_EXPERTS, rt,
                                      cases.INVALID, 1)
    ys = [cases.expert(received[q].payloads, q, ep) for q in range(ep)]
    combined = ref.combine(routings, ys)
    magnitude = ref.combine(routings, [y.float().abs() for y in ys])
    return received, combined, magnitude


def _check_received(what: str, got: list[torch.Tensor], expected) -> None:
    from a2ad.client import reference as ref

    problems = ref.dispatch_mismatches(got, expected.recv_counts, expected)
    assert not problems, f"{what}: " + "; ".join(problems)
    ids = got[1]
    for s, n in enumerate(expected.recv_counts.tolist()):
        assert bool((ids[s, n:] == cases.INVALID).all()), f"{what}: empty slots from source {s} not sanitized"


def _rounds(ep: int, hidden: int):
    """(phase, index, seed, tokens, rt) of every round both sides ran, in order."""
    for i, (seed, tokens, rt, _how) in enumerate(cases.eager_plan(ep)):
        yield "eager", i, seed, tokens, rt
    for i, seed in enumerate(cases.GRAPH_SEEDS):
        yield "graph", i, seed, cases.graph_tokens(ep), cases.MAX_TOKENS


def _run_a2ad(ep, backend, runtime_dir, tmp_path, hidden, timeout=300.0):
    res = run_group(cases.a2ad_rank, ep,
                    (ep, backend, str(runtime_dir), str(tmp_path / "pg"), hidden, str(tmp_path), timeout),
                    timeout=timeout)
    assert len(set(res.values())) == 1, f"the ranks joined different jobs: {res}"
    return {r: torch.load(tmp_path / f"a2ad-{r}.pt") for r in range(ep)}


# ---------------------------------------------------------------------------
# CPU: a2ad's half of the harness on the host backend
# ---------------------------------------------------------------------------
def test_moe_ep_harness_on_the_host_backend(daemon_factory, tmp_path):
    """The rounds the GPU test runs (eager, then the static-buffer rounds run eagerly), through
    A2adAlltoAll on a host-backend daemon: every round equal to the reference, exactly."""
    ep, hidden = 2, 64
    d = daemon_factory("--grace", "1", backend="host")
    got = _run_a2ad(ep, "host", d.runtime_dir, tmp_path, hidden)
    n = 0
    for phase, i, seed, tokens, rt in _rounds(ep, hidden):
        received, combined, _ = _expected(seed, tokens, rt, hidden, ep)
        for r in range(ep):
            what = f"a2ad host, {phase} round {i}, rank {r}"
            mine = got[r][phase][i]
            _check_received(what, mine["recv"], received[r])
            assert mine["out"].dtype == combined[r].dtype and torch.equal(mine["out"], combined[r]), \
                f"{what}: combine differs from the reference"
            n += 1
    assert n == ep * (len(cases.eager_plan(ep)) + len(cases.GRAPH_SEEDS))


# ---------------------------------------------------------------------------
# GPU: a2ad's moe_ep communication against FlashInfer's MoeAlltoAll
# ---------------------------------------------------------------------------
def _flashinfer_or_skip() -> None:
    """Skip (with the reason) unless FlashInfer's MoeAlltoAll imports; tried in a child with a
    time limit, so that this process stays without FlashInfer and CUDA."""
    import subprocess
    import sys

    code = "import flashinfer.comm.trtllm_moe_alltoall as m; print(m.__file__)"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("importing flashinfer.comm.trtllm_moe_alltoall took more than 120 s") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"FlashInfer is not importable: {last}")
    cases.log("test", f"FlashInfer importable: {p.stdout.strip()}")


#: time limits (s): the FlashInfer child, the a2ad rank processes, the a2ad extension's load
#: (a build, when this tree's is not built yet, takes a minute or two)
FI_LIMIT, A2AD_LIMIT, EXT_LIMIT = 90.0, 90.0, 300.0

_EXT_CHECK = """
import sys, time
from a2ad.client import _ext
src = _ext.csrc_dir()
out = _ext.build_dir(_ext.build_hash(src, ",".join(_ext.cuda_archs()), _ext.timing_build(), _ext.debug_build()))
lock = out / "lock"
built = out.is_dir() and any(out.glob("*.so"))
print(f"a2ad extension folder {out}: built {built}, lock file {lock.exists()}", file=sys.stderr, flush=True)
end = time.monotonic() + 20
while lock.exists() and time.monotonic() < end:
    time.sleep(0.5)
if lock.exists():
    age = time.time() - lock.stat().st_mtime
    print(f"{lock} is still there (age {age:.0f} s): a build in progress elsewhere, or the lock of a build that "
          "was killed; torch waits on it forever. Remove it if no build is running.", file=sys.stderr, flush=True)
    sys.exit(3)
t0 = time.monotonic()
_ext.load()
print(f"a2ad extension loaded in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
"""


def _a2ad_extension_ready() -> None:
    """Build (if needed) and load the a2ad extension once, in a child with a time limit, before
    the rank processes need it: a lock file left by a killed build would make them wait forever."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    try:
        p = subprocess.run([sys.executable, "-c", _EXT_CHECK], timeout=EXT_LIMIT, cwd=str(repo), env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"loading (building) the a2ad extension took more than {EXT_LIMIT:.0f} s") from None
    assert p.returncode == 0, f"loading the a2ad extension failed (exit {p.returncode}; its output is above)"


@pytest.mark.gpu
@pytest.mark.timeout(EXT_LIMIT + FI_LIMIT + A2AD_LIMIT + 60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ep,hidden", [(2, 7168), (4, 2880)])
def test_moe_ep_matches_flashinfer_moe_alltoall_on_one_gpu(daemon_factory, tmp_path, ep, hidden):
    log = cases.log
    log("test", f"ep {ep}, hidden {hidden}: checking that FlashInfer imports")
    _flashinfer_or_skip()
    failed = []
    log("test", f"ep {ep}, hidden {hidden}: FlashInfer side (limit {FI_LIMIT:.0f} s)")
    try:
        # FlashInfer in a child of its own: a kernel that cannot find its peers traps (a sticky
        # CUDA error) after minutes; the child is killed at the time limit instead
        run_group(cases.flashinfer_ranks, 1, (ep, hidden, str(tmp_path), "cuda", FI_LIMIT), timeout=FI_LIMIT)
        fi = torch.load(tmp_path / "flashinfer.pt")
    except AssertionError as exc:
        fi = None
        failed.append(f"FlashInfer side: {exc}")
    log("test", f"FlashInfer side {'failed' if fi is None else 'done'}; the a2ad extension (limit {EXT_LIMIT:.0f} s)")
    a2ad = None
    try:
        _a2ad_extension_ready()
        d = daemon_factory("--grace", "1", backend="cuda")
        log("test", f"cuda daemon up; a2ad side, {ep} rank processes (limit {A2AD_LIMIT:.0f} s)")
        a2ad = _run_a2ad(ep, "cuda", d.runtime_dir, tmp_path, hidden, timeout=A2AD_LIMIT)
    except AssertionError as exc:
        failed.append(f"a2ad side: {exc}")
    log("test", f"a2ad side {'failed' if a2ad is None else 'done'}")
    if failed:  # say how the side that ran compares with the reference, then fail
        for name, got in (("a2ad", a2ad and [a2ad[r] for r in range(ep)]),
                          ("FlashInfer", fi and [{p: [rnd[r] for rnd in fi[p]] for p in fi} for r in range(ep)])):
            if got:
                try:
                    _against_reference(name, got, ep, hidden)
                    failed.append(f"{name} side: every round equal to the reference")
                except AssertionError as exc:
                    failed.append(f"{name} side against the reference: {exc}")
        raise AssertionError("\n".join(failed))
    _compare(a2ad, fi, ep, hidden)


def _against_reference(name: str, got: list, ep: int, hidden: int) -> None:
    """One side's rounds (``got[rank][phase][index]``) against the reference."""
    for phase, i, seed, tokens, rt in _rounds(ep, hidden):
        received, combined, _ = _expected(seed, tokens, rt, hidden, ep)
        for r in range(ep):
            what = f"{name} {phase} round {i}, rank {r}"
            _check_received(what, got[r][phase][i]["recv"], received[r])
            torch.testing.assert_close(got[r][phase][i]["out"], combined[r], rtol=2e-2, atol=2e-2,
                                       msg=lambda m, what=what: f"{what}: {m}")


def _compare(a2ad: dict, fi: dict, ep: int, hidden: int) -> None:
    """Every round of both sides against the reference and against each other (module doc)."""
    from a2ad.client import reference as ref

    exact = total = 0
    for phase, i, seed, tokens, rt in _rounds(ep, hidden):
        received, combined, magnitude = _expected(seed, tokens, rt, hidden, ep)
        for r in range(ep):
            what = f"{phase} round {i} (seed {seed}, tokens {tokens}, rt {rt}), rank {r}"
            a, f = a2ad[r][phase][i], fi[phase][i][r]
            _check_received(f"a2ad {what}", a["recv"], received[r])
            _check_received(f"FlashInfer {what}", f["recv"], received[r])
            ab, fb = ref.slot_bytes(a["recv"]), ref.slot_bytes(f["recv"])
            for s, n in enumerate(received[r].recv_counts.tolist()):
                assert ref.same_rows(ab[s, :n], fb[s, :n]), \
                    f"{what}: rows from source {s} differ between a2ad and FlashInfer"
            ao, fo, want = a["out"], f["out"], combined[r]
            assert ao.dtype == fo.dtype == torch.bfloat16 and ao.shape == fo.shape == want.shape, \
                (what, ao.dtype, fo.dtype, ao.shape, fo.shape, want.shape)
            for name, out in (("a2ad", ao), ("FlashInfer", fo)):
                torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2,
                                           msg=lambda m, name=name: f"{name} {what}, against the reference: {m}")
            exact += int((ao == fo).sum())
            total += ao.numel()
            if ep == 2:
                assert torch.equal(ao, fo), \
                    f"{what}: combine differs, max |a2ad - FlashInfer| {float((ao.float() - fo.float()).abs().max())}"
            else:
                af, ff = ao.float(), fo.float()
                bound = 2.0 ** -7 * torch.maximum(af.abs(), ff.abs()) + 2.0 ** -20 * magnitude[r].float()
                worst = float(((af - ff).abs() - bound).max()) if af.numel() else 0.0
                assert worst <= 0, f"{what}: |a2ad - FlashInfer| exceeds one bf16 step (+ fp32 sum rounding) by {worst}"
    print(f"\nmoe_ep ep={ep} hidden={hidden}: {len(list(_rounds(ep, hidden)))} rounds x {ep} ranks, "
          f"combine outputs bitwise equal a2ad vs FlashInfer: {exact}/{total} elements")
    assert total > 0
