"""a2ad against FlashInfer 0.7.2's own kernels on the same inputs (GPU machine, FlashInfer
importable): two ranks on one GPU in one process, each library on a caller-owned
``[ep_size, size_per_rank]`` workspace, the calls written the same way for both (only the
module differs). What each rank receives must match the reference for both libraries (the
slot order within a source is the kernels' arrival order, so rows are compared as sets), and
the combined outputs of the two must agree: exactly enough for bf16 (both accumulate in fp32),
within the FP8 bound for ``use_low_precision=True`` (the two quantize with different block
scales)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

EP = 2
TOP_K = 8
NUM_EXPERTS = 64
INVALID = -1


def _flashinfer():
    try:
        from flashinfer.comm import trtllm_moe_alltoall as fi
    except Exception as exc:  # not installed on this machine
        pytest.skip(f"FlashInfer is not importable: {type(exc).__name__}: {exc}")
    return fi


def _workspace(mod, max_tokens, hidden, dev):
    size = int(mod.moe_a2a_get_workspace_size_per_rank(EP, max_tokens, 2 * hidden + 8 * TOP_K, 2 * hidden))
    ws = torch.zeros(EP, size, dtype=torch.uint8, device=dev)
    metas = [mod.moe_a2a_initialize(ws, r, EP, max_tokens) for r in range(EP)]
    torch.cuda.synchronize(dev)
    return ws, metas


def _run(mod, ws, metas, inputs, rt, hidden, dev, low_precision):
    """One round of dispatch + toy experts + combine for both ranks, each on its own stream."""
    from a2ad.client import reference as ref

    streams = [torch.cuda.Stream(dev) for _ in range(EP)]
    main = torch.cuda.current_stream(dev)
    recv, offs, saved, outs = {}, {}, {}, {}
    for r in range(EP):
        streams[r].wait_stream(main)
        with torch.cuda.stream(streams[r]):
            pl = [inputs[r].hidden.to(dev), inputs[r].experts.to(dev), inputs[r].scales.to(dev)]
            recv[r], offs[r], _ = mod.moe_a2a_dispatch(pl[1], pl, ws, metas[r], rt, r, EP, TOP_K, NUM_EXPERTS)
    for r in range(EP):
        with torch.cuda.stream(streams[r]):
            saved[r] = [t.clone() for t in recv[r]]
            y = ref.toy_expert(saved[r][0], saved[r][1], saved[r][2], r, NUM_EXPERTS, EP)
            outs[r] = mod.moe_a2a_combine(y, inputs[r].experts.shape[0], ws, metas[r], rt, r, EP, TOP_K, offs[r],
                                          False, use_low_precision=low_precision)
    for r in range(EP):
        main.wait_stream(streams[r])
    torch.cuda.synchronize(dev)
    return {r: [t.cpu() for t in saved[r]] for r in range(EP)}, {r: outs[r].float().cpu() for r in range(EP)}


@pytest.mark.parametrize("hidden", [256, 2880])
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_a2ad_and_flashinfer_agree_on_the_same_inputs(hidden, tokens):
    fi = _flashinfer()
    import a2ad.client as a2ad
    from a2ad.client import reference as ref

    dev = torch.device("cuda", torch.cuda.current_device())
    fws, fmetas = _workspace(fi, tokens, hidden, dev)
    aws, ametas = _workspace(a2ad, tokens, hidden, dev)
    try:
        for seed in range(3):
            counts = [tokens, max(1, tokens // 2)]
            inputs = ref.make_round(seed, counts, hidden, TOP_K, NUM_EXPERTS, torch.bfloat16)
            payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
            _routings, received = ref.dispatch([i.experts for i in inputs], payloads, NUM_EXPERTS, tokens, INVALID, 1)
            got = {}
            for name, mod, ws, metas in (("flashinfer", fi, fws, fmetas), ("a2ad", a2ad, aws, ametas)):
                for lp in (False, True):
                    got[name, lp] = _run(mod, ws, metas, inputs, tokens, hidden, dev, lp)
            for name in ("flashinfer", "a2ad"):
                for r in range(EP):
                    problems = ref.dispatch_mismatches(got[name, False][0][r], received[r].recv_counts, received[r])
                    assert not problems, f"{name} rank {r} seed {seed}: " + "; ".join(problems)
            for r in range(EP):
                f16, a16 = got["flashinfer", False][1][r], got["a2ad", False][1][r]
                assert f16.shape == a16.shape
                torch.testing.assert_close(a16, f16, rtol=1.6e-2, atol=1e-2,
                                           msg=lambda m: f"bf16 combine, rank {r} seed {seed}: {m}")
                f8, a8 = got["flashinfer", True][1][r], got["a2ad", True][1][r]
                scale = float(f16.abs().max()) or 1.0
                # both quantize to e4m3 (3 mantissa bits, relative step 2**-3 at worst per element,
                # summed over top_k contributions): against bf16 each stays within 2**-3 of the
                # output's magnitude, so against each other within twice that
                assert float((a8 - f16).abs().max()) <= 0.125 * scale, f"a2ad FP8 vs bf16, rank {r} seed {seed}"
                assert float((f8 - f16).abs().max()) <= 0.125 * scale, f"FlashInfer FP8 vs bf16, rank {r} seed {seed}"
                assert float((a8 - f8).abs().max()) <= 0.25 * scale, f"a2ad FP8 vs FlashInfer FP8, rank {r} seed {seed}"
    finally:
        torch.cuda.synchronize(dev)
        a2ad.moe_a2a_release(aws)
