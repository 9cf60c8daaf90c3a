"""SGLang 0.5.23's own ``FlashinferDispatcher`` (``--moe-a2a-backend flashinfer``) on a2ad.

Run by scripts/test-engines.sh in a venv with SGLang and a2ad installed (the file is not
collected by the main suite). Each rank is a real process in a gloo process group, its
plugin loaded through the ``sglang.srt.plugins`` entry point by SGLang's ``load_plugins``
with ``A2AD_ENGINE_PLUGIN=1``, against a real host-backend daemon. The engine code
exercised: ``FlashinferDispatcher.__init__`` (workspace sizing, one ``MoeAlltoAll`` per
namespace: decode and SP prefill), ``dispatch`` (payload list, runtime token geometry,
``invalid_token_expert_id`` sanitizing, ``get_combine_payload_tensor_in_workspace``) and
``combine``, and elastic EP's ``active_ranks`` written after each combine.

Replaced, each at one seam, because it needs a GPU or a launched server:

- the expert computation between dispatch and combine: a small reference on CPU tensors
  (``a2ad.client.reference.toy_expert``) instead of SGLang's MoE runner;
- the server configuration: SGLang's own test override
  (``get_context().override_server_args(...)``) instead of a launched server's arguments,
  and the rank's ``moe_ep_rank`` stated with ``get_parallel().override_permanently`` instead
  of the rank bundle a launched server publishes;
- elastic EP's state: ``ElasticEPStateManager._instance`` set to SGLang's own
  ``_build_state(...)`` on the CPU, instead of ``init(server_args)`` with an elastic EP
  backend (Mooncake or NIXL, GPU/RDMA only).
"""

from __future__ import annotations

import os
import time

import pytest

from integration_cases import (
    HIDDEN,
    TOP_K,
    die_now,
    killed_at,
    ll_check_combine,
    ll_check_received,
    ll_dequant,
    ll_expert_outputs,
    ll_fp8_inputs,
    ll_round,
    reference_round,
    run_group,
    wait_until,
)

MAX_TOKENS = 4


def _setup(rank, ep, runtime_dir, pg_file, policy, elastic=False):
    os.environ["A2AD_ENGINE_PLUGIN"] = "1"
    os.environ["A2AD_RUNTIME_DIR"] = runtime_dir
    os.environ["A2AD_ON_PEER_LOSS"] = policy
    os.environ["A2AD_TIMEOUT"] = "20"
    os.environ["SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's loader: runs a2ad's entry point, then applies the hooks
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(moe_a2a_backend="flashinfer", device="cpu", tp_size=ep, ep_size=ep).install()
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=ep)
    from sglang.srt.runtime_context import get_parallel

    # this process's place in the EP group (a launched server publishes it with its groups)
    get_parallel().override_permanently(moe_ep_rank=rank)
    if elastic:
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

        inst = ElasticEPStateManager._build_state(ep_size=ep, device=torch.device("cpu"))
        inst.effective_ep_size = inst.original_ep_size = ep
        ElasticEPStateManager._instance = inst


def _dispatcher(ep, num_experts, sp_prefill=False):
    import torch
    import torch.distributed as dist
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.flashinfer import FlashinferDispatcher

    # a layer's runner config without a runner backend (the experts run outside SGLang here)
    rc = MoeRunnerConfig(num_experts=num_experts, num_local_experts=num_experts // ep, hidden_size=HIDDEN,
                         top_k=TOP_K, num_fused_shared_experts=0, params_dtype=torch.bfloat16)
    d = FlashinferDispatcher(group=dist.group.WORLD, router_topk=TOP_K, num_experts=num_experts,
                             num_local_experts=num_experts // ep, hidden_size=HIDDEN, params_dtype=torch.bfloat16,
                             moe_runner_config=rc, enable_sp_prefill_a2a=sp_prefill)
    d.set_quant_config({})
    return d


def _layer(d, rank, ep, num_experts, seed, tokens, dead=()):
    """One dispatch/combine of FlashinferDispatcher, checked against the reference. Every rank
    passes the same token count (SGLang's geometry without DP attention: x.shape[0])."""
    import torch
    from sglang.srt.layers.moe.token_dispatcher.flashinfer import FlashinferCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from a2ad.client import reference as ref

    n = [0 if r in dead else tokens for r in range(ep)]
    rt, inputs, received, combined = reference_round(seed, ep, num_experts, MAX_TOKENS, n, dead)
    mine = inputs[rank]
    out = d.dispatch(mine.hidden.clone(), StandardTopKOutput(mine.scales, mine.experts.to(torch.int64),
                                                             torch.zeros(tokens, num_experts)))
    x, ids, w = out.hidden_states, out.topk_output.topk_ids, out.topk_output.topk_weights
    assert x.shape == (ep * rt, HIDDEN) and ids.shape == (ep * rt, TOP_K)
    # rows of empty slots carry SGLang's invalid id (num_experts without a runner backend)
    for s, cnt in enumerate(received[rank].recv_counts.tolist()):
        assert bool((ids.view(ep, rt, -1)[s, cnt:] == d.invalid_token_expert_id).all()), (rank, seed, s)
    y = ref.toy_expert(x, ids, w, rank, num_experts, ep)
    got = d.combine(FlashinferCombineInput(hidden_states=y))
    want = combined[rank]
    assert torch.equal(got, want), f"rank {rank} round {seed}: FlashinferDispatcher combine differs from the reference"


def rounds_and_namespaces(rank, ep, runtime_dir, pg_file, num_experts):
    from a2ad.client.connection import DaemonClient

    _setup(rank, ep, runtime_dir, pg_file, "raise")
    d = _dispatcher(ep, num_experts, sp_prefill=True)
    jobs = (d.moe_a2a.attachment.job, d.sp_prefill_moe_a2a.attachment.job)
    assert jobs[0] != jobs[1] and all(j.startswith("sgl-") for j in jobs), jobs
    with DaemonClient(runtime_dir) as c:
        listed = [j["name"] for j in c.request("jobs")["jobs"]]
    assert set(jobs) <= set(listed), (jobs, listed)
    for rnd in range(4):
        _layer(d, rank, ep, num_experts, 3000 + rnd, tokens=1 + rnd % MAX_TOKENS)
    return jobs


def elastic_kill9(rank, ep, runtime_dir, pg_file, num_experts, stamp):
    import torch.distributed as dist
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    _setup(rank, ep, runtime_dir, pg_file, "degrade", elastic=True)
    d = _dispatcher(ep, num_experts)
    victim = ep - 1
    for rnd in range(2):
        _layer(d, rank, ep, num_experts, 4000 + rnd, tokens=3)
    state = ElasticEPStateManager.instance()
    assert state.active_ranks.tolist() == [1] * ep
    dist.barrier()
    if rank == victim:
        die_now(stamp)
    t0 = killed_at(stamp)
    seed = [4100]

    def combined_without_victim():
        # keep serving; each combine writes a2ad's mask into active_ranks
        _layer(d, rank, ep, num_experts, seed[0], tokens=2, dead=(victim,))
        seed[0] += 1
        return state.active_ranks[victim].item() == 0

    # the first round after the kill already runs without the victim (the daemon saw it)
    wait_until(lambda: os.path.exists(stamp) and _mask_lost(d, victim), 5.0, "a2ad's mask without the victim")
    wait_until(combined_without_victim, 5.0, "active_ranks without the victim after a combine")
    seen = time.time() - t0
    assert state.active_ranks.tolist() == [0 if r == victim else 1 for r in range(ep)]
    assert not state.is_active_equal_last(), "SGLang's rebalancing check does not see the change"
    for _ in range(2):
        combined_without_victim()
    return seen


def _mask_lost(d, victim):
    return int(d.moe_a2a.a2ad_status.masked()[victim]) == 1


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatcher_rounds_with_a_job_per_namespace(daemon, tmp_path, ep):
    res = run_group(rounds_and_namespaces, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep),
                    timeout=600)
    assert len(set(res.values())) == 1, res


@pytest.mark.parametrize("ep", [2, 4])
def test_kill9_reaches_elastic_active_ranks_within_1s(daemon, tmp_path, ep):
    victim = ep - 1
    res = run_group(elastic_kill9, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep,
                                        str(tmp_path / "killed")), timeout=600, may_die={victim})
    assert sorted(res) == [r for r in range(ep) if r != victim]
    assert max(res.values()) < 1.0, f"active_ranks showed the kill after {max(res.values()):.3f} s"


def test_plugin_refuses_an_untested_sglang():
    from a2ad.integrations import sglang as plugin

    with pytest.raises(RuntimeError, match=r"tested with sglang >=0\.5\.23,<0\.5\.24; this is sglang 0\.6\.0"):
        plugin.check_version("0.6.0")
    from importlib.metadata import version

    assert plugin.check_version(version("sglang"))


# ---------------------------------------------------------------------------
# --moe-a2a-backend deepep --deepep-mode low_latency on a2ad.deep_ep (A2AD_DEEP_EP=1)
# ---------------------------------------------------------------------------
LL_HIDDEN = 2048
LL_TOPK = 4
LL_MAX = 4


def _ll_setup(rank, ep, runtime_dir, pg_file, output_dtype):
    """SGLang's own configuration path for the DeepEP LL backend: the server arguments, its
    ``initialize_moe_config`` (the MoE flags the dispatcher factory reads), the plugin from
    ``load_plugins`` making ``deep_ep`` a2ad's."""
    os.environ["A2AD_ENGINE_PLUGIN"] = "1"
    os.environ["A2AD_DEEP_EP"] = "1"
    os.environ["A2AD_RUNTIME_DIR"] = runtime_dir
    os.environ["A2AD_TIMEOUT"] = "20"
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(LL_MAX)
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import deep_ep

    import a2ad.deep_ep

    assert deep_ep is a2ad.deep_ep, "the plugin did not make deep_ep a2ad's"
    from sglang.srt.layers.moe.token_dispatcher import deepep as sgl_deepep

    assert sgl_deepep.use_deepep and sgl_deepep.Buffer is a2ad.deep_ep.Buffer
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(moe_a2a_backend="deepep", deepep_mode="low_latency",
                                       deepep_dispatcher_output_dtype=output_dtype, device="cpu", tp_size=ep,
                                       ep_size=ep).install()
    initialize_moe_config()
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=ep)
    # the groups a launched server builds (the dispatcher factory takes the TP group's)
    get_parallel().override_permanently(moe_ep_rank=rank, tp_group=SimpleNamespace(device_group=dist.group.WORLD))
    # seam: DeepEPBuffer.get_deepep_buffer reads the GPU's SM count (for a normal-mode warning)
    torch.cuda.get_device_properties = lambda *args, **kwargs: SimpleNamespace(multi_processor_count=132)


def _ll_dispatcher(ep, num_experts):
    """SGLang's own factory (``create_moe_dispatcher``: MaybeTboDeepEPDispatcher around
    DeepEPDispatcher, return_recv_hook=True, as every MoE layer gets it)."""
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    rc = MoeRunnerConfig(num_experts=num_experts, num_local_experts=num_experts // ep, hidden_size=LL_HIDDEN,
                         top_k=LL_TOPK, num_fused_shared_experts=0, params_dtype=torch.bfloat16)
    d = create_moe_dispatcher(rc, None)
    d.set_quant_config({})
    return d


def _ll_layer(d, rank, ep, num_experts, seed, fp8, tokens=None, dead=()):
    """One dispatch / experts / combine through SGLang's dispatcher, checked against the
    reference: bf16 exactly; FP8 (DeepEP's per-128-channel e4m3) against a2ad.deep_ep's
    quantization of the sources' tokens, and the combine within FP8's error."""
    import torch
    from sglang.srt.layers.moe.token_dispatcher import DeepEPLLCombineInput, DeepEPLLDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    inputs = ll_round(seed, ep, num_experts, LL_MAX, LL_HIDDEN, LL_TOPK, tokens, dead)
    x, idx, w = inputs[rank]
    topk = StandardTopKOutput(w, idx, torch.zeros(x.shape[0], num_experts))
    out = d.dispatch(hidden_states=x.clone(), topk_output=topk)  # MaybeTboDeepEPDispatcher: keywords only
    assert isinstance(out, DeepEPLLDispatchOutput), type(out)
    lx = num_experts // ep
    assert out.hidden_states.shape == (lx, ep * LL_MAX, LL_HIDDEN), out.hidden_states.shape
    if fp8:
        assert out.hidden_states.dtype == torch.float8_e4m3fn and out.hidden_states_scale is not None
    else:
        assert out.hidden_states.dtype == torch.bfloat16 and out.hidden_states_scale is None
    recv = ll_dequant(out.hidden_states, out.hidden_states_scale)
    ll_check_received(rank, f"round {seed}", ll_fp8_inputs(inputs) if fp8 else inputs, recv, out.masked_m,
                      num_experts, ep, dead)
    assert torch.equal(out.topk_ids, idx) and torch.equal(out.topk_weights, w)
    y = ll_expert_outputs(recv, out.masked_m, rank, num_experts, ep)
    got = d.combine(combine_input=DeepEPLLCombineInput(hidden_states=y, topk_ids=out.topk_ids,
                                                       topk_weights=out.topk_weights))
    ll_check_combine(rank, f"round {seed}", got, inputs, num_experts, ep, fp8, dead)


def deepep_ll_rounds(rank, ep, runtime_dir, pg_file, num_experts, output_dtype):
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPBuffer, DeepEPDispatcher

    import a2ad.deep_ep

    _ll_setup(rank, ep, runtime_dir, pg_file, output_dtype)
    d = _ll_dispatcher(ep, num_experts)
    inner = d._inners[0]
    assert isinstance(inner, DeepEPDispatcher) and inner._low_latency_dispatcher.return_recv_hook
    fp8 = output_dtype == "fp8"
    assert inner._low_latency_dispatcher.use_fp8 is fp8
    for rnd in range(3):
        _ll_layer(d, rank, ep, num_experts, 8000 + rnd, fp8)
    _ll_layer(d, rank, ep, num_experts, 8010, fp8, tokens=[0] + [LL_MAX] * (ep - 1))
    buf = DeepEPBuffer._state().buffer
    assert isinstance(buf, a2ad.deep_ep.Buffer) and buf.low_latency_mode and buf.group_size == ep
    # a second layer's dispatcher shares the process's Buffer
    d2 = _ll_dispatcher(ep, num_experts)
    _ll_layer(d2, rank, ep, num_experts, 8020, fp8)
    _ll_layer(d, rank, ep, num_experts, 8021, fp8)
    assert DeepEPBuffer._state().buffer is buf
    # SGLang's switch back from the normal mode: clean_low_latency_buffer (a barrier here)
    DeepEPBuffer.set_dispatch_mode_as_normal()
    _ll_layer(d, rank, ep, num_experts, 8030, fp8)
    return buf.job


def deepep_ll_kill9(rank, ep, runtime_dir, pg_file, num_experts, stamp):
    """SGLang's DeepEP LL path does not use the mask API (no enable_shrink): a killed peer
    makes the survivors' next layer raise PeerLost at once instead of hanging."""
    import torch.distributed as dist

    from a2ad import errors

    _ll_setup(rank, ep, runtime_dir, pg_file, "bf16")
    d = _ll_dispatcher(ep, num_experts)
    victim = ep - 1
    for rnd in range(2):
        _ll_layer(d, rank, ep, num_experts, 9000 + rnd, False)
    dist.barrier()
    if rank == victim:
        die_now(stamp)
    t0 = killed_at(stamp)
    time.sleep(0.2)
    with pytest.raises(errors.PeerLost):
        _ll_layer(d, rank, ep, num_experts, 9100, False, dead=(victim,))
    return time.time() - t0


@pytest.mark.parametrize("ep,output_dtype", [(2, "bf16"), (4, "bf16"), (2, "fp8"), (4, "fp8")])
def test_deepep_ll_dispatcher_rounds(daemon, tmp_path, ep, output_dtype):
    res = run_group(deepep_ll_rounds, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep, output_dtype),
                    timeout=600)
    assert len(set(res.values())) == 1, res


@pytest.mark.parametrize("ep", [2, 4])
def test_deepep_ll_kill9_is_peer_lost_not_a_hang(daemon, tmp_path, ep):
    victim = ep - 1
    res = run_group(deepep_ll_kill9, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep,
                                          str(tmp_path / "killed")), timeout=600, may_die={victim})
    assert sorted(res) == [r for r in range(ep) if r != victim]
    assert max(res.values()) < 5.0, f"PeerLost came {max(res.values()):.3f} s after the kill"
