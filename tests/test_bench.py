"""a2ad-bench (a2ad/bench.py): accounting, routing, the Megatron-style permutation, checks,
statistics and output formatting on CPU; the CPU dry run end to end; and, with 2 GPUs,
``a2ad-bench --quick`` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from a2ad import bench as B
from a2ad import layout as L

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# accounting
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts,ep", [(256, 2), (384, 5), (32, 4), (10, 3), (8, 8), (7, 1)])
def test_expert_owner_matches_layout(num_experts, ep):
    experts = torch.arange(num_experts, dtype=torch.int32).view(1, -1)
    got = B.expert_owner_tensor(experts, num_experts, ep).view(-1).tolist()
    assert got == [L.expert_owner(e, num_experts, ep) for e in range(num_experts)]


def test_target_mask_and_remote_bytes():
    # 8 experts on 2 ranks: 0-3 on rank 0, 4-7 on rank 1
    experts = torch.tensor([[0, 1], [0, 5], [4, 6], [7, 3]], dtype=torch.int32)
    mask = B.target_mask(experts, 8, 2)
    assert mask.tolist() == [[True, False], [True, True], [False, True], [True, True]]
    # rank 0 owns these tokens: tokens 1, 2, 3 cross to rank 1 -> 3 remote pairs
    assert B.remote_pairs(mask, 0) == 3
    assert B.remote_pairs(mask, 1) == 3  # tokens 0, 1, 3 go to rank 0
    bpt = B.dispatch_bytes_per_token(7168, 8)
    assert bpt == 2 * 7168 + 32 + 32 == 14400
    assert B.combine_bytes_per_token(7168) == 14336
    assert B.remote_bytes(mask, 0, bpt) == 3 * 14400


def test_target_mask_counts_a_rank_once():
    experts = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)  # all on rank 0 of 2
    mask = B.target_mask(experts, 8, 2)
    assert mask.tolist() == [[True, False]]
    assert B.remote_pairs(mask, 0) == 0 and B.remote_pairs(mask, 1) == 1


def test_logical_bytes_and_gbps():
    assert B.logical_bytes(4096, 2, 8, 14400) == 4096 * 2 * 14400  # min(ep, top_k) = 2
    assert B.logical_bytes(10, 16, 8, 100) == 10 * 8 * 100  # min(ep, top_k) = 8
    assert B.gbps(1e9, 1e6) == pytest.approx(1.0)  # 1e9 bytes in one second
    assert B.gbps(14400, 1.0) == pytest.approx(14.4)
    assert B.gbps(100, None) is None and B.gbps(100, 0.0) is None


def test_build_row_bandwidths():
    remote = {"dispatch_bytes": 1000.0, "combine_bytes": 500.0, "pairs_per_token": 0.5}
    row = B.build_row("a2ad", 4, 16, 2, 2, 8, [10.0, 10.0, 30.0], [5.0] * 3, [20.0] * 3, remote)
    assert row["dispatch_us"]["median"] == 10.0
    assert row["remote_gbps"]["dispatch"] == pytest.approx(1000 / 10 / 1e3)
    assert row["remote_gbps"]["combine"] == pytest.approx(500 / 5 / 1e3)
    assert row["remote_gbps"]["total"] == pytest.approx(1500 / 20 / 1e3)
    ld = 4 * 2 * B.dispatch_bytes_per_token(16, 2)
    assert row["logical_bytes"]["dispatch"] == ld
    assert row["logical_gbps"]["dispatch"] == pytest.approx(ld / 10 / 1e3)
    empty = B.build_row("nccl", 4, 16, 2, 2, 8, [], [], [], remote)
    assert empty["dispatch_us"] is None and empty["remote_gbps"]["dispatch"] is None


# ---------------------------------------------------------------------------
# routing and inputs
# ---------------------------------------------------------------------------
def test_uniform_routing_distinct_in_range_deterministic():
    g = torch.Generator().manual_seed(5)
    r = B.make_routing(2000, 8, 256, g)
    assert r.dtype == torch.int32 and r.shape == (2000, 8)
    assert int(r.min()) >= 0 and int(r.max()) < 256
    assert all(len(set(row)) == 8 for row in r.tolist())
    again = B.make_routing(2000, 8, 256, torch.Generator().manual_seed(5))
    assert torch.equal(r, again)
    counts = torch.bincount(r.view(-1).long(), minlength=256).double()
    mean = counts.mean()
    assert float(counts.std() / mean) < 0.2  # 62.5 hits per expert on average: no strong skew
    assert float(counts.max() / mean) < 2.0


def test_skewed_routing_is_skewed_and_distinct():
    w = B.expert_weights(256, "skewed", 1.0, seed=3)
    assert w is not None and w.shape == (256,) and math.isclose(float(w.sum()), 1.0)
    r = B.make_routing(2000, 8, 256, torch.Generator().manual_seed(1), w)
    assert all(len(set(row)) == 8 for row in r.tolist())
    counts = torch.bincount(r.view(-1).long(), minlength=256).double()
    top = int(counts.argmax())
    assert top == int(w.argmax())
    assert float(counts.max() / counts.mean()) > 5.0
    assert B.expert_weights(256, "uniform", 1.0, 3) is None
    with pytest.raises(ValueError):
        B.expert_weights(256, "zipf", 1.0, 3)


def test_make_inputs_regenerable_per_rank():
    a = B.make_inputs(7, 0, 16, 32, 1, 4, 64, None, "cpu")
    b = B.make_inputs(7, 0, 16, 32, 1, 4, 64, None, "cpu")
    c = B.make_inputs(7, 1, 16, 32, 1, 4, 64, None, "cpu")
    for name in ("experts", "hidden", "scales"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.hidden, c.hidden) and not torch.equal(a.experts, c.experts)
    assert a.hidden.dtype == torch.bfloat16 and a.scales.dtype == torch.float32 and a.experts.dtype == torch.int32
    assert bool((a.hidden != 0).all())  # never zeros
    # the routing does not depend on the hidden size
    d = B.make_inputs(7, 0, 16, 64, 1, 4, 64, None, "cpu")
    assert torch.equal(a.experts, d.experts)


# ---------------------------------------------------------------------------
# Megatron-style permutation
# ---------------------------------------------------------------------------
def _direct_permutation(mask):
    T, ep = mask.shape
    return [t for r in range(ep) for t in range(T) if mask[t, r]]


@pytest.mark.parametrize("T,ep", [(1, 2), (7, 2), (33, 4), (64, 8), (5, 1)])
def test_permute_indices_matches_direct(T, ep):
    g = torch.Generator().manual_seed(T * 31 + ep)
    mask = torch.rand(T, ep, generator=g) < 0.4
    want = _direct_permutation(mask)
    assert B.permute_indices(mask).tolist() == want
    assert B.permute_indices(mask, len(want)).tolist() == want


def test_unpermute_sum_matches_direct():
    g = torch.Generator().manual_seed(2)
    idx = torch.tensor([3, 0, 3, 1, 0, 3])
    back = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    out = B.unpermute_sum(back, idx, 5)
    ref = torch.zeros(5, 5)
    for i, t in enumerate(idx.tolist()):
        ref[t] += back[i].float()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert bool((out[2] == 0).all()) and bool((out[4] == 0).all())  # tokens with no sends


def _simulate_megatron(inputs, num_experts, top_k, hidden):
    """All ranks of the Megatron-style baseline in one process: all_to_all_single is a list shuffle."""
    ep = len(inputs)
    masks = [B.target_mask(x.experts, num_experts, ep) for x in inputs]
    idx = [B.permute_indices(m) for m in masks]
    splits = [m.sum(0).tolist() for m in masks]  # splits[src][dst]
    sends = [B.pack_rows(x).index_select(0, i) for x, i in zip(inputs, idx)]
    offs = [[sum(splits[s][:d]) for d in range(ep)] for s in range(ep)]
    recv = [torch.cat([sends[s][offs[s][d] : offs[s][d] + splits[s][d]] for s in range(ep)]) for d in range(ep)]
    expert_out = [B.unpack_rows(r, hidden, top_k).hidden.contiguous() for r in recv]  # identity expert
    roffs = [[sum(splits[s][d] for s in range(src)) for src in range(ep)] for d in range(ep)]
    back = [torch.cat([expert_out[d][roffs[d][s] : roffs[d][s] + splits[s][d]] for d in range(ep)]) for s in range(ep)]
    outs = [B.unpermute_sum(b, i, x.hidden.shape[0], torch.bfloat16) for b, i, x in zip(back, idx, inputs)]
    return recv, splits, outs


def test_megatron_round_trip_equals_reference():
    E, k, H, T, ep = 32, 4, 24, 40, 4
    inputs = [B.make_inputs(11, r, T, H, 0, k, E, None, "cpu") for r in range(ep)]
    recv, splits, outs = _simulate_megatron(inputs, E, k, H)
    for me in range(ep):
        rows = B.unpack_rows(recv[me], H, k)
        per_source, off = [], 0
        for s in range(ep):
            n = splits[s][me]
            per_source.append(B.Inputs(rows.experts[off : off + n], rows.hidden[off : off + n], rows.scales[off : off + n]))
            off += n
        ok, why = B.check_received(per_source, inputs, me, E, ep)
        assert ok, why
        res = B.check_combine(outs[me], inputs[me], E, ep)
        assert res["ok"] and res["exact"] and res["rel_err"] < 4e-3  # bf16 rounding of hidden x 3


def test_agrs_simulation_equals_reference():
    E, k, H, T, ep = 16, 3, 8, 9, 2
    inputs = [B.make_inputs(4, r, T, H, 0, k, E, None, "cpu") for r in range(ep)]
    gathered = torch.cat([B.pack_rows(x) for x in inputs])
    partial = []
    for me in range(ep):
        rows = B.unpack_rows(gathered, H, k)
        mine = (B.expert_owner_tensor(rows.experts, E, ep) == me).any(1)
        partial.append(rows.hidden * mine.unsqueeze(1).to(torch.bfloat16))
    total = sum(p.float() for p in partial).to(torch.bfloat16)
    for me in range(ep):
        res = B.check_combine(total[me * T : (me + 1) * T], inputs[me], E, ep)
        assert res["ok"] and res["exact"]


def test_reference_combine_is_hidden_times_distinct_targets():
    experts = torch.tensor([[0, 1], [0, 5]], dtype=torch.int32)
    hidden = torch.tensor([[1.0, 2.0], [3.0, -1.0]]).to(torch.bfloat16)
    ref = B.reference_combine(hidden, B.target_mask(experts, 8, 2))
    assert ref.tolist() == [[1.0, 2.0], [6.0, -2.0]]


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------
def test_same_rows_as_sets_order_free_and_strict():
    x = B.make_inputs(1, 0, 12, 80, 0, 4, 16, None, "cpu")
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shuffled = B.Inputs(x.experts[perm], x.hidden[perm], x.scales[perm])
    assert B.same_rows_as_sets(x, shuffled) == (True, "")
    bad = shuffled.clone()
    bad.scales[3, 1] += 1.0
    ok, why = B.same_rows_as_sets(x, bad)
    assert not ok and "scales" in why
    bad = shuffled.clone()
    bad.hidden[5, 70] = 99.0  # outside the 64 fingerprint columns
    ok, why = B.same_rows_as_sets(x, bad)
    assert not ok and "hidden" in why
    ok, why = B.same_rows_as_sets(x, B.Inputs(x.experts[:5], x.hidden[:5], x.scales[:5]))
    assert not ok and "5 rows" in why


def test_check_combine_catches_wrong_outputs():
    x = B.make_inputs(3, 0, 10, 16, 0, 4, 16, None, "cpu")
    mask = B.target_mask(x.experts, 16, 2)
    good = B.reference_combine(x.hidden, mask).to(torch.bfloat16)
    res = B.check_combine(good, x, 16, 2, other=good)
    assert res["ok"] and res["exact"] and res["max_abs_diff_vs_a2ad"] == 0.0
    missing = good.clone()
    missing[0] = x.hidden[0] * 0  # one token lost every contribution
    assert not B.check_combine(missing, x, 16, 2)["ok"]
    nan = good.clone()
    nan[1, 1] = float("nan")
    res = B.check_combine(nan, x, 16, 2)
    assert not res["ok"] and "non-finite" in res["why"]
    assert not B.check_combine(good[:5], x, 16, 2)["ok"]


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------
def test_percentiles_and_steps():
    vals = list(range(1, 101))
    assert B.percentile(vals, 50) == pytest.approx(50.5)
    assert B.percentile(vals, 10) == pytest.approx(10.9)
    assert B.percentile(vals, 90) == pytest.approx(90.1)
    assert B.percentile([3.0], 90) == 3.0 and B.percentile([], 50) is None
    s = B.summarize([5, 1, 3])
    assert s["median"] == 3 and s["min"] == 1 and s["max"] == 5 and s["n"] == 3
    assert B.summarize([]) is None
    assert B.step_latencies([[1.0, 5.0, 2.0], [2.0, 1.0, 2.5]]) == [2.0, 5.0, 2.5]


# ---------------------------------------------------------------------------
# speedups, targets, table, JSON, plot, perf doc
# ---------------------------------------------------------------------------
def _rows():
    def row(impl, T, d, c, t, rb):
        remote = {"dispatch_bytes": rb, "combine_bytes": rb * 0.99, "pairs_per_token": 1.0}
        return B.build_row(impl, T, 7168, 2, 8, 256, [d] * 3, [c] * 3, [t] * 3, remote,
                           check={"ok": True, "why": ""}, timing="x")

    rb = lambda T: T * 0.875 * 14400  # noqa: E731
    rows = []
    for T, (ad, ac, at), (nd, nc, nt) in [
        (1, (8.0, 11.0, 18.0), (60.0, 60.0, 120.0)),
        (1024, (60.0, 70.0, 125.0), (200.0, 200.0, 400.0)),
        (4096, (220.0, 180.0, 340.0), (250.0, 250.0, 500.0)),
    ]:
        rows.append(row("a2ad", T, ad, ac, at, rb(T)))
        rows.append(row("nccl", T, nd, nc, nt, rb(T)))
    return rows


CEIL = {"ce_two_way": {"devices": [0, 1], "bytes": 1 << 30, "per_gpu_gbps": 350.0, "aggregate_gbps": 700.0}}


def test_speedups_and_targets():
    rows = _rows()
    B.add_speedups(rows)
    a = {r["tokens"]: r for r in rows if r["impl"] == "a2ad"}
    assert a[1]["speedup_vs_nccl"] == pytest.approx(120 / 18)
    assert a[4096]["speedup_vs_nccl"] == pytest.approx(500 / 340)
    assert all(r["speedup_vs_nccl"] == pytest.approx(1.0) for r in rows if r["impl"] == "nccl")
    targets = {t["name"]: t for t in B.evaluate_targets(rows, CEIL)}
    disp = targets["T=4096 dispatch remote GB/s / copy-engine two-way"]
    assert disp["measured"] == pytest.approx(4096 * 0.875 * 14400 / 220 / 1e3 / 350)
    assert disp["status"] == "MISS"  # 0.63 of the ceiling
    assert targets["T=1 dispatch latency (us)"]["status"] == "PASS"
    assert targets["T=1 combine latency (us)"]["status"] == "PASS"
    small = targets["dispatch+combine speedup vs NCCL, T<=1024 (min)"]
    assert small["measured"] == pytest.approx(400 / 125) and small["status"] == "PASS"
    assert targets["dispatch+combine speedup vs NCCL, T=4096"]["status"] == "PASS"
    none = B.evaluate_targets(rows, {})
    assert {t["status"] for t in none if "copy-engine" in t["name"]} == {"n/a"}


def test_table_and_report_formatting():
    rows = _rows()
    B.add_speedups(rows)
    text = B.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["impl", "T", "hidden"]
    assert len(lines) == 2 + len(rows)
    assert len({len(line) for line in lines[:2]}) == 1
    first = lines[2].split()
    assert first[:3] == ["a2ad", "1", "7168"] and "8.00" in first and "6.67x" in first and first[-1] == "ok"
    md = B.format_markdown_table(rows)
    assert md.count("\n") == len(rows) + 1 and md.startswith("| impl |")
    result = {"config": {"mode": "gpu", "ep": 2, "routing": "uniform", "top_k": 8, "num_experts": 256},
              "rows": rows, "ceilings": CEIL, "targets": B.evaluate_targets(rows, CEIL),
              "skipped": [{"tokens": 4096, "hidden": 2880, "reason": "time budget"}], "notes": ["n1"], "errors": []}
    rep = B.make_report(result)
    assert "PASS" in rep and "MISS" in rep and "skipped: T=4096 hidden=2880" in rep and "350.0 GB/s per GPU" in rep


def test_json_roundtrip_has_no_nan(tmp_path):
    rows = _rows()
    rows[0]["check"]["rel_err"] = float("inf")
    result = B._finite({"schema": B.SCHEMA, "rows": rows, "x": float("nan")})
    path = tmp_path / "sub" / "bench.json"
    B.write_json(result, path)
    back = json.loads(path.read_text())
    assert back["x"] is None and back["rows"][0]["check"]["rel_err"] is None
    assert back["rows"][0]["dispatch_us"]["median"] == 8.0


def test_plot_and_perf_doc(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows()
    B.add_speedups(rows)
    result = {"config": {"mode": "gpu", "ep": 2, "routing": "uniform", "top_k": 8, "num_experts": 256,
                         "replays": 100, "warmup": 3, "input_sets": 4, "l2_flush": True},
              "hardware": {"device_name": "NVIDIA H200", "device_count": 2, "topology": "GPU0 X NV18"},
              "rows": rows, "ceilings": CEIL, "command": "a2ad-bench --quick", "finished": "now",
              "skipped": [], "notes": [], "errors": []}
    result["targets"] = B.evaluate_targets(rows, CEIL)
    png = tmp_path / "perf.png"
    assert B.plot(result, png) is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = B.perf_doc(result, "perf.png")
    assert "a2ad-bench --quick" in doc and "![latency and bandwidth vs tokens](perf.png)" in doc
    assert "NVIDIA H200" in doc and "| a2ad | 1 | 7168 |" in doc and "NV18" in doc


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------
def _cfg(argv, gpus=2):
    return B.resolve_config(B.build_parser().parse_args(argv), gpus)


def test_resolve_config_modes():
    full = _cfg([])
    assert full["tokens"] == list(B.FULL_TOKENS) and full["hidden"] == [7168, 4096, 2880]
    assert full["ep"] == 2 and full["replays"] == 100 and full["impls"] == list(B.IMPLS) and full["l2_flush"]
    quick = _cfg(["--quick"])
    assert quick["tokens"] == [1, 128, 4096] and quick["hidden"] == [7168] and quick["replays"] == 50
    dry = _cfg(["--dry-run"], gpus=0)
    assert dry["device"] == "cpu" and dry["ep"] == 2 and not dry["l2_flush"] and dry["ceiling_bytes"] == 16 << 20
    custom = _cfg(["--tokens", "64,8,8", "--hidden", "2880,4096", "--impls", "nccl,a2ad", "--ep", "1"])
    assert custom["tokens"] == [8, 64] and custom["hidden"] == [4096, 2880] and custom["impls"] == ["a2ad", "nccl"]
    assert custom["ep"] == 1


@pytest.mark.parametrize("argv,gpus,msg", [
    ([], 0, "no CUDA GPU"),
    (["--ep", "4"], 2, "needs 4 GPUs"),
    (["--hidden", "7"], 2, "even"),
    (["--top-k", "23"], 2, "top-k"),
    (["--num-experts", "1"], 2, "num-experts"),
])
def test_resolve_config_errors(argv, gpus, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(argv, gpus)


def test_parser_rejects_bad_lists():
    p = B.build_parser()
    for argv in (["--tokens", "1,x"], ["--tokens", "0"], ["--impls", "mpi"], ["--ceiling-bytes", "lots"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert p.parse_args(["--ceiling-bytes", "256M"]).ceiling_bytes == 256 << 20


# ---------------------------------------------------------------------------
# capture through the plane (host backend, one rank)
# ---------------------------------------------------------------------------
def test_plane_calls_replay_sees_new_inputs(daemon):
    """The graph path launches MoeAlltoAll's plane with recorded arguments: a later call must
    read whatever is in the static inputs then (checked on the host plane, ep=1)."""
    from a2ad.client import MoeAlltoAll

    E, k, H, T = 16, 4, 32, 6
    a2a = MoeAlltoAll(SimpleNamespace(moe_ep_rank=0, moe_ep_size=1), 8, k, E, hidden_size=H, job="bench-plane",
                      runtime_dir=daemon.runtime_dir, timeout=10.0)
    try:
        ctx = SimpleNamespace(barrier=lambda: None, sync=lambda: None)
        static = B.make_inputs(1, 0, T, H, 0, k, E, None, "cpu").clone()
        d, c = B._plane_calls(ctx, a2a, static, T)
        assert a2a.phase == "idle"
        for set_idx in (1, 2):
            fresh = B.make_inputs(1, 0, T, H, set_idx, k, E, None, "cpu")
            static.copy_from(fresh)
            recv = d()
            got = B._received_a2ad(recv, [fresh], 0, E, 1)
            assert B.check_received(got, [fresh], 0, E, 1) == (True, "")
            out = c(recv)
            res = B.check_combine(out, fresh, E, 1)
            assert res["ok"] and res["exact"]
        # the API still works afterwards (same rounds)
        recv = a2a.dispatch(static.experts, static.payloads(), T)
        assert B.check_combine(a2a.combine(recv[0], T), static, E, 1)["ok"]
    finally:
        a2a.close()


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    doc = tmp_path / "docs" / "PERF.md"
    r = subprocess.run(
        [sys.executable, "-m", "a2ad.bench", "--dry-run", "--tokens", "1,8", "--replays", "3", "--budget", "200",
         "--json", str(out), "--write-perf-doc", str(doc)],
        capture_output=True, text=True, timeout=280, cwd=str(REPO),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["schema"] == B.SCHEMA and res["complete"] and not res["errors"]
    impls = {(row["impl"], row["tokens"]) for row in res["rows"]}
    assert impls == {(i, t) for i in B.IMPLS for t in (1, 8)}
    assert all(row["check"]["ok"] for row in res["rows"]), [r["check"] for r in res["rows"]]
    assert all(row["total_us"]["n"] == 3 for row in res["rows"])
    assert not res["skipped"]
    a2ad = [row for row in res["rows"] if row["impl"] == "a2ad"]
    assert all(row["timing"] == "cpu stand-in graph (plane)" for row in a2ad)
    # every implementation produced the same combine output as a2ad's on the check set
    assert all(rk["combine"]["max_abs_diff_vs_a2ad"] == 0.0 for row in res["rows"] if row["impl"] != "a2ad"
               for rk in row["check"]["ranks"])
    assert res["ceilings"]["sm_store_two_way"]["verified"]
    assert "impl" in r.stdout and "targets" in r.stdout
    text = doc.read_text()
    assert "python -m a2ad.bench --dry-run" in text and "| nccl | 8 |" in text
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        assert (doc.parent / "perf.png").exists() and "(perf.png)" in text


@pytest.mark.gpu2
@pytest.mark.timeout(600)
def test_quick_bench_on_two_gpus(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "a2ad.bench", "--quick", "--ep", "2", "--replays", "20", "--budget", "300",
         "--ceiling-bytes", "256M", "--json", str(out), "--plot", str(tmp_path / "perf.png")],
        capture_output=True, text=True, timeout=560, cwd=str(REPO),
    )
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-8000:]
    res = json.loads(out.read_text())
    assert not res["errors"]
    assert res["rows"] and all(row["check"]["ok"] for row in res["rows"])
    assert any(row["impl"] == "a2ad" for row in res["rows"])
    assert any(row["impl"] == "nccl" for row in res["rows"])
    assert res["ceilings"]["ce_two_way"]["per_gpu_gbps"] > 0
