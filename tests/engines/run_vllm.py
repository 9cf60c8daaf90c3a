"""vLLM 0.33's own MoE path for ``--all2all-backend flashinfer_nvlink_one_sided`` on a2ad.

Run by scripts/test-engines.sh in a venv with vLLM and a2ad installed (the file is not
collected by the main suite). Each rank is a real process with vLLM's distributed state
(gloo), its plugin loaded through the ``vllm.general_plugins`` entry point with
``A2AD_ENGINE_PLUGIN=1``, and a real host-backend daemon. The engine code exercised:

- ``FlashInferNVLinkOneSidedPrepareAndFinalize`` (construction: ``manager.initialize``;
  ``prepare``: quantize-input and ``communication.dispatch``; ``finalize``:
  ``communication.combine(..., output=)``) inside ``FusedMoEKernel.apply``
  (``FusedMoEKernelModularImpl``: buffers, prepare, experts, finalize);
- ``FlashInferNVLinkOneSidedManager`` growth (a second prepare/finalize with a larger
  ``max_num_tokens``: barrier, destroy, create), ``checkpoint_prepare/restore``;
- the fault-tolerance hooks the model runner polls (``support_fault_tolerance``,
  ``query_fault``, ``query_active_mask``, ``clean_buffers``) and ``WorkerSentinel``'s check.

Replaced, each at one seam, because it needs a GPU or a full engine:

- the experts: a small reference ``FusedMoEExpertsModular`` on CPU tensors
  (``a2ad.client.reference.toy_expert``) instead of a CUDA grouped GEMM;
- the EP group's all2all manager: vLLM's ``CudaCommunicator`` builds it from
  ``--all2all-backend`` on GPUs only; here the EP group's device communicator gets the
  manager vLLM's own lookup returns (``all2all.FlashInferNVLinkOneSidedManager(cpu_group)``,
  the plugin's class);
- the DP token counts: vLLM's DP all-reduce fills ``DPMetadata``; here each round's counts
  are set in a ``DPMetadata`` in the forward context directly;
- the worker given to ``WorkerSentinel``: an object with the worker's ``parallel_config``.
"""

from __future__ import annotations

import os
import time

import pytest

from integration_cases import (
    HIDDEN,
    INVALID,
    TOP_K,
    all_reached,
    check_received,
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


def _setup(rank, ep, runtime_dir, pg_file, policy):
    """vLLM's distributed state over gloo, the plugin from its entry point, the EP manager."""
    os.environ["A2AD_ENGINE_PLUGIN"] = "1"
    os.environ["A2AD_RUNTIME_DIR"] = runtime_dir
    os.environ["A2AD_ON_PEER_LOSS"] = policy
    os.environ["A2AD_TIMEOUT"] = "20"
    import torch

    torch.set_num_threads(1)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import all2all

    from a2ad.integrations import vllm as plugin

    assert all2all.FlashInferNVLinkOneSidedManager is plugin.manager_class(), "the plugin did not load"
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(tensor_parallel_size=ep, enable_expert_parallel=True,
                                                    all2all_backend="flashinfer_nvlink_one_sided"))
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    ps.init_distributed_environment(world_size=ep, rank=rank, distributed_init_method=f"file://{pg_file}",
                                    local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=ep)
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))  # what GPUModelRunner does, on its device
    ep_group = ps.get_ep_group()
    assert ep_group.world_size == ep
    dc = ep_group.device_communicator
    if dc is None:  # no device communicator on this platform: the seam is the group's
        from types import SimpleNamespace

        dc = ep_group.device_communicator = SimpleNamespace()
    # the one piece CudaCommunicator builds on GPUs (vLLM's own lookup of the class)
    dc.all2all_manager = all2all.FlashInferNVLinkOneSidedManager(ep_group.cpu_group)
    return cfg, dc.all2all_manager


class _RefExperts:
    """Built lazily (it subclasses vLLM's FusedMoEExpertsModular)."""

    cls = None

    @classmethod
    def make(cls, rank, ep, num_experts):
        import torch
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FUSED_MOE_UNQUANTIZED_CONFIG,
            FusedMoEConfig,
            FusedMoEParallelConfig,
            RoutingMethodType,
        )
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

        from a2ad.client import reference as ref

        if cls.cls is None:
            class RefExperts(mk.FusedMoEExpertsModular):
                """Every received row's toy expert output, already weighted and reduced over
                this rank's experts (what the one-sided finalize combines)."""

                @staticmethod
                def activation_format():
                    return mk.FusedMoEActivationFormat.Standard

                @staticmethod
                def _supports_current_device():
                    return True

                @staticmethod
                def _supports_no_act_and_mul():
                    return True

                @staticmethod
                def _supports_quant_scheme(weight_key, activation_key):
                    return True

                @staticmethod
                def _supports_activation(activation):
                    return True

                @staticmethod
                def _supports_parallel_config(moe_parallel_config):
                    return True

                def supports_chunking(self):
                    return False

                def supports_expert_map(self):
                    return False

                def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                                     expert_tokens_meta, activation):
                    return (0,), (0,), (M, K)

                def finalize_weight_and_reduce_impl(self):
                    return TopKWeightAndReduceNoOP()

                def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                          global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                          expert_tokens_meta, apply_router_weight_on_input):
                    output.copy_(ref.toy_expert(hidden_states, topk_ids, topk_weights, self.ep_rank,
                                                global_num_experts, self.ep_size))
                    return None

            cls.cls = RefExperts
        pcfg = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=ep, ep_size=ep, tp_rank=0, pcp_rank=0,
                                      dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                      all2all_backend="flashinfer_nvlink_one_sided", enable_eplb=False)
        moe = FusedMoEConfig(num_experts=num_experts, experts_per_token=TOP_K, hidden_dim=HIDDEN,
                             intermediate_size=2 * HIDDEN, num_local_experts=num_experts // ep,
                             num_logical_experts=num_experts, activation=MoEActivation.SILU, device="cpu",
                             routing_method=RoutingMethodType.TopK, moe_parallel_config=pcfg,
                             in_dtype=torch.bfloat16)
        experts = cls.cls(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
        experts.ep_rank, experts.ep_size = rank, ep
        return experts


def _kernel(rank, ep, num_experts, max_tokens):
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.flashinfer_nvlink_one_sided import (
        FlashInferNVLinkOneSidedPrepareAndFinalize,
    )

    pf = FlashInferNVLinkOneSidedPrepareAndFinalize(max_num_tokens=max_tokens, top_k=TOP_K, num_experts=num_experts,
                                                    hidden_size=HIDDEN, num_dispatchers=ep)
    return FusedMoEKernel(pf, _RefExperts.make(rank, ep, num_experts))


def _layer(kernel, cfg, rank, ep, num_experts, seed, max_tokens, tokens=None, dead=()):
    """One MoE layer through FusedMoEKernel.apply, checked against the reference."""
    import torch
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    rt, inputs, received, combined = reference_round(seed, ep, num_experts, max_tokens, tokens, dead)
    counts = [int(i.experts.shape[0]) for i in inputs]
    dp = DPMetadata(torch.tensor(counts, dtype=torch.int32))
    dp.local_sizes = counts  # what vLLM's DP all-reduce and chunked_sizes leave for the layer
    mine = inputs[rank]
    nle = num_experts // ep
    w1 = torch.zeros(nle, 2 * HIDDEN, HIDDEN, dtype=torch.bfloat16)
    w2 = torch.zeros(nle, HIDDEN, 2 * HIDDEN, dtype=torch.bfloat16)
    with override_forward_context(create_forward_context(None, cfg, dp_metadata=dp)):
        out = kernel.apply(hidden_states=mine.hidden.clone(), w1=w1, w2=w2, topk_weights=mine.scales,
                           topk_ids=mine.experts, activation=MoEActivation.SILU, global_num_experts=num_experts,
                           expert_map=None, apply_router_weight_on_input=False)
    want = combined[rank]
    assert out.shape == want.shape and torch.equal(out.to(want.dtype), want), \
        f"rank {rank} round {seed}: FusedMoEKernel output differs from the reference"
    return rt, received[rank]


def rounds_growth_checkpoint(rank, ep, runtime_dir, pg_file, num_experts):
    import torch
    import torch.distributed as dist

    from a2ad.client.connection import DaemonClient
    from a2ad.integrations.flashinfer import A2adAlltoAll

    cfg, manager = _setup(rank, ep, runtime_dir, pg_file, "raise")
    assert manager.support_fault_tolerance is True
    kernel = _kernel(rank, ep, num_experts, MAX_TOKENS)
    comm = manager.get_communication()
    assert isinstance(comm, A2adAlltoAll) and comm.job.startswith("vllm-"), comm
    for rnd in range(4):
        _layer(kernel, cfg, rank, ep, num_experts, 1000 + rnd, MAX_TOKENS)
    # what one dispatch received, through vLLM's prepare(), checked row by row
    rt, inputs, received, _ = reference_round(1100, ep, num_experts, MAX_TOKENS)
    got = comm.dispatch(inputs[rank].hidden, inputs[rank].experts, inputs[rank].scales, max_tokens_per_rank=rt)
    check_received(rank, "dispatch", [got.hidden_states.view(ep, rt, -1).clone(), got.topk_ids.view(ep, rt, -1).clone(),
                                      got.topk_weights.view(ep, rt, -1).clone()], received[rank])
    comm.combine(torch.zeros(ep * rt, HIDDEN, dtype=torch.bfloat16))
    mask, fault = manager.query_active_mask(), manager.query_fault()
    assert mask.dtype == torch.int32 and mask.tolist() == [0] * ep and fault.dtype == torch.bool and not bool(fault)
    # growth: a second layer needs twice the tokens; vLLM's manager rebuilds the communication
    first = comm.job
    kernel2 = _kernel(rank, ep, num_experts, 2 * MAX_TOKENS)
    comm2 = manager.get_communication()
    assert comm2 is not comm and comm2.params.max_tokens_per_rank == 2 * MAX_TOKENS and comm2.job != first
    with DaemonClient(runtime_dir) as c:
        wait_until(lambda: first not in [j["name"] for j in c.request("jobs")["jobs"]], 10, f"{first} released", 0.05)
    for rnd in range(2):  # both layers now run on the grown communication
        _layer(kernel2, cfg, rank, ep, num_experts, 1200 + rnd, 2 * MAX_TOKENS,
               tokens=[2 * MAX_TOKENS - r for r in range(ep)])
        _layer(kernel, cfg, rank, ep, num_experts, 1300 + rnd, MAX_TOKENS)
    # sleep and wake: vLLM's manager calls the communication's checkpoint methods
    dist.barrier(group=manager.cpu_group)
    manager.checkpoint_prepare()
    manager.checkpoint_restore()
    _layer(kernel, cfg, rank, ep, num_experts, 1400, MAX_TOKENS)
    # the worker sentinel accepts the backend
    from types import SimpleNamespace

    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

    WorkerSentinel(SimpleNamespace(parallel_config=cfg.parallel_config))
    from vllm.config import ParallelConfig

    with pytest.raises(ValueError, match="FT-capable"):  # other backends still refused
        WorkerSentinel(SimpleNamespace(parallel_config=ParallelConfig(all2all_backend="allgather_reducescatter")))
    return comm2.job


def kill9(rank, ep, runtime_dir, pg_file, num_experts, policy, stamp):
    import torch.distributed as dist

    from a2ad import errors

    cfg, manager = _setup(rank, ep, runtime_dir, pg_file, policy)
    kernel = _kernel(rank, ep, num_experts, MAX_TOKENS)
    victim = ep - 1
    for rnd in range(2):
        _layer(kernel, cfg, rank, ep, num_experts, 2000 + rnd, MAX_TOKENS)
    dist.barrier(group=manager.cpu_group)
    if rank == victim:
        die_now(stamp)
    t0 = killed_at(stamp)
    wait_until(lambda: bool(manager.query_fault()), 5.0, "query_fault() True")
    seen = time.time() - t0
    mask = manager.query_active_mask().tolist()
    assert mask == [1 if r == victim else 0 for r in range(ep)], mask
    if policy == "degrade":
        for rnd in range(3):  # the survivors keep serving, without the victim's experts
            _layer(kernel, cfg, rank, ep, num_experts, 2100 + rnd, MAX_TOKENS, dead=(victim,))
        manager.clean_buffers()
        assert not bool(manager.query_fault()), "query_fault() stays True after clean_buffers()"
        assert manager.query_active_mask().tolist() == mask
        # no survivor leaves (its exit clears its bit: a new fault, rightly) before every
        # survivor has made the checks above
        all_reached(stamp, rank, [r for r in range(ep) if r != victim], "checked query_fault()")
    else:
        with pytest.raises(errors.PeerLost):
            _layer(kernel, cfg, rank, ep, num_experts, 2200, MAX_TOKENS, dead=(victim,))
    return seen


@pytest.mark.parametrize("ep", [2, 4])
def test_fused_moe_kernel_rounds_growth_checkpoint(daemon, tmp_path, ep):
    res = run_group(rounds_growth_checkpoint, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep),
                    timeout=600)
    assert len(set(res.values())) == 1, res


@pytest.mark.parametrize("ep,policy", [(2, "degrade"), (4, "degrade"), (2, "raise"), (4, "raise")])
def test_kill9_seen_by_query_fault_within_1s(daemon, tmp_path, ep, policy):
    victim = ep - 1
    res = run_group(kill9, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep, policy,
                                str(tmp_path / "killed")), timeout=600, may_die={victim})
    assert sorted(res) == [r for r in range(ep) if r != victim]
    assert max(res.values()) < 1.0, f"query_fault() saw the kill after {max(res.values()):.3f} s"


def test_plugin_refuses_an_untested_vllm():
    from a2ad.integrations import vllm as plugin

    with pytest.raises(RuntimeError, match=r"tested with vllm >=0\.33\.0,<0\.34; this is vllm 0\.35\.1"):
        plugin.check_version("0.35.1")
    import vllm

    assert plugin.check_version(vllm.__version__)


def flashinfer_factory(rank, ep, runtime_dir, pg_file, num_experts):
    """FlashInfer's own factory builds the a2ad backend (registered as "a2ad"), with FlashInfer's
    types, by name and by config; rounds checked against the reference."""
    from flashinfer.moe_ep import (
        BootstrapConfig,
        MoEEpCommParams,
        MoEEpCommunication,
        MoEEpDispatchResult,
        available_communication_backends,
        create_communication,
    )

    import integration_cases as ic
    from a2ad.integrations.flashinfer import HAVE_FLASHINFER, A2adAlltoAll, A2adConfig

    assert HAVE_FLASHINFER and "a2ad" in available_communication_backends()
    ic.init_group(rank, ep, pg_file)
    params = MoEEpCommParams(num_experts=num_experts, top_k=TOP_K, max_tokens_per_rank=MAX_TOKENS,
                             hidden_size=HIDDEN, invalid_expert_id=INVALID)
    jobs = []
    for backend in (A2adConfig(runtime_dir=runtime_dir, timeout=20.0), "a2ad"):
        if backend == "a2ad":
            comm = create_communication(BootstrapConfig(world_size=ep, rank=rank), params, backend,
                                        runtime_dir=runtime_dir)
        else:
            comm = create_communication(BootstrapConfig(world_size=ep, rank=rank), params, backend=backend)
        try:
            assert isinstance(comm, A2adAlltoAll) and isinstance(comm, MoEEpCommunication)
            for rnd, how in enumerate(("plain", "output", "buffer")):
                ic._fi_round(comm, rank, ep, 5000 + rnd, num_experts, MAX_TOKENS, how)
            res = comm.dispatch(*_one_round(rank, ep, num_experts))
            assert isinstance(res, MoEEpDispatchResult)
            comm.combine(res.hidden_states)
            jobs.append(comm.job)
        finally:
            comm.destroy()
    return tuple(jobs)


def _one_round(rank, ep, num_experts):
    rt, inputs, _, _ = reference_round(5100, ep, num_experts, MAX_TOKENS, tokens=[2] * ep)
    return inputs[rank].hidden, inputs[rank].experts, inputs[rank].scales


def test_flashinfer_create_communication_builds_a2ad(daemon, tmp_path):
    res = run_group(flashinfer_factory, 2, (2, str(daemon.runtime_dir), str(tmp_path / "pg"), 4), timeout=600)
    assert len(set(res.values())) == 1 and len(set(res[0])) == 2, res


# ---------------------------------------------------------------------------
# --all2all-backend deepep_low_latency on a2ad.deep_ep (A2AD_DEEP_EP=1)
# ---------------------------------------------------------------------------
#: the smallest hidden size DeepEP's LL kernels are built for (vLLM's prepare asserts the list)
LL_HIDDEN = 2048
LL_TOPK = 4
LL_MAX = 4


def _ll_setup(rank, ep, runtime_dir, pg_file, fault_tolerance):
    """vLLM's distributed state for ``deepep_low_latency``, ``deep_ep`` from the plugin, and
    vLLM's ``DeepEPLLAll2AllManager`` in the EP group's manager slot."""
    os.environ["A2AD_ENGINE_PLUGIN"] = "1"
    os.environ["A2AD_DEEP_EP"] = "1"
    os.environ["A2AD_RUNTIME_DIR"] = runtime_dir
    os.environ["A2AD_TIMEOUT"] = "20"
    import torch

    torch.set_num_threads(1)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import deep_ep

    import a2ad.deep_ep

    assert deep_ep is a2ad.deep_ep, "the plugin did not make deep_ep a2ad's"
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import all2all
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ll
    from vllm.utils.import_utils import has_deep_ep

    assert has_deep_ep()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(
        tensor_parallel_size=ep, enable_expert_parallel=True, all2all_backend="deepep_low_latency",
        enable_fault_tolerance=fault_tolerance))
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    ps.init_distributed_environment(world_size=ep, rank=rank, distributed_init_method=f"file://{pg_file}",
                                    local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=ep)
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))
    ep_group = ps.get_ep_group()
    dc = ep_group.device_communicator
    if dc is None:
        from types import SimpleNamespace

        dc = ep_group.device_communicator = SimpleNamespace()
    # seams, each a line vLLM runs only on a CUDA platform:
    # - CudaCommunicator builds the manager from --all2all-backend on GPUs
    dc.all2all_manager = all2all.DeepEPLLAll2AllManager(ep_group.cpu_group)
    # - all2all_utils imports the LL prepare/finalize under current_platform.is_cuda_alike()
    if not hasattr(all2all_utils, "DeepEPLLPrepareAndFinalize"):
        all2all_utils.DeepEPLLPrepareAndFinalize = deepep_ll.DeepEPLLPrepareAndFinalize
        all2all_utils.DEEPEP_QUANT_BLOCK_SHAPE = deepep_ll.DEEPEP_QUANT_BLOCK_SHAPE
    # - query_active_mask allocates its mask with device="cuda" (here the EP device, the CPU)
    all2all.DeepEPLLAll2AllManager._mask = torch.zeros(ep, dtype=torch.int32)
    # - clean_buffers calls torch.accelerator.synchronize(), which raises without an accelerator
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    return cfg, dc.all2all_manager


class _LLExperts:
    cls = None

    @classmethod
    def make(cls, rank, ep, num_experts, quant_config):
        import torch
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig,
            FusedMoEParallelConfig,
            RoutingMethodType,
        )
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

        if cls.cls is None:
            class LLRefExperts(mk.FusedMoEExpertsModular):
                """Toy experts on DeepEP's expert-major batch; the combine kernel weighs and sums."""

                @staticmethod
                def activation_format():
                    return mk.FusedMoEActivationFormat.BatchedExperts

                @staticmethod
                def _supports_current_device():
                    return True

                @staticmethod
                def _supports_no_act_and_mul():
                    return True

                @staticmethod
                def _supports_quant_scheme(weight_key, activation_key):
                    return True

                @staticmethod
                def _supports_activation(activation):
                    return True

                @staticmethod
                def _supports_parallel_config(moe_parallel_config):
                    return True

                def supports_chunking(self):
                    return False

                def supports_expert_map(self):
                    return False

                def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                                     expert_tokens_meta, activation):
                    return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

                def finalize_weight_and_reduce_impl(self):
                    return TopKWeightAndReduceDelegate()

                def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                          global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                          expert_tokens_meta, apply_router_weight_on_input):
                    counts = expert_tokens_meta.expert_num_tokens
                    # FP8 dispatch: DeepEP's e4m3 batch with its scales, as the kernels get it
                    x = ll_dequant(hidden_states, a1q_scale)
                    self.seen.append((x, counts.clone()))
                    output.copy_(ll_expert_outputs(x, counts, self.ep_rank, global_num_experts, self.ep_size))
                    return None

            cls.cls = LLRefExperts
        pcfg = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=ep, ep_size=ep, tp_rank=0, pcp_rank=0,
                                      dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                      all2all_backend="deepep_low_latency", enable_eplb=False)
        moe = FusedMoEConfig(num_experts=num_experts, experts_per_token=LL_TOPK, hidden_dim=LL_HIDDEN,
                             intermediate_size=2 * LL_HIDDEN, num_local_experts=num_experts // ep,
                             num_logical_experts=num_experts, activation=MoEActivation.SILU, device="cpu",
                             routing_method=RoutingMethodType.TopK, moe_parallel_config=pcfg,
                             in_dtype=torch.bfloat16, max_num_tokens=LL_MAX)
        experts = cls.cls(moe, quant_config, max_num_tokens=LL_MAX, num_dispatchers=ep)
        experts.ep_rank, experts.ep_size, experts.seen = rank, ep, []
        return moe, experts


def _ll_kernel(rank, ep, num_experts, manager, fp8=False):
    """vLLM's own factory picks and builds DeepEPLLPrepareAndFinalize (the manager's
    get_handle makes the deep_ep.Buffer), in a FusedMoEKernel with the toy experts. ``fp8``:
    a block-FP8 (128 x 128) layer, for which vLLM dispatches in DeepEP's FP8."""
    import torch
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize

    nle = num_experts // ep
    qc = FUSED_MOE_UNQUANTIZED_CONFIG
    if fp8:
        qc = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(nle, 2 * LL_HIDDEN // 128, LL_HIDDEN // 128),
                                       w2_scale=torch.ones(nle, LL_HIDDEN // 128, 2 * LL_HIDDEN // 128),
                                       block_shape=[128, 128])
    moe, experts = _LLExperts.make(rank, ep, num_experts, qc)
    assert moe.use_deepep_ll_kernels
    pf = maybe_make_prepare_finalize(moe, qc, all2all_manager=manager)
    assert isinstance(pf, DeepEPLLPrepareAndFinalize) and pf.use_fp8_dispatch is fp8, pf
    return FusedMoEKernel(pf, experts), pf, experts


def _ll_layer(kernel, experts, cfg, rank, ep, num_experts, seed, tokens=None, dead=(), fp8=False):
    """One MoE layer through FusedMoEKernel.apply (DeepEPLLPrepareAndFinalize's prepare:
    low_latency_dispatch with the recv hook; finalize: low_latency_combine into the output),
    the experts' batch and the output checked against the reference."""
    import torch
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    inputs = ll_round(seed, ep, num_experts, LL_MAX, LL_HIDDEN, LL_TOPK, tokens, dead)
    counts = [int(i[0].shape[0]) for i in inputs]
    dp = DPMetadata(torch.tensor(counts, dtype=torch.int32))
    dp.local_sizes = counts
    x, idx, w = inputs[rank]
    nle = num_experts // ep
    w1 = torch.zeros(nle, 2 * LL_HIDDEN, LL_HIDDEN, dtype=torch.bfloat16)
    w2 = torch.zeros(nle, LL_HIDDEN, 2 * LL_HIDDEN, dtype=torch.bfloat16)
    experts.seen.clear()
    with override_forward_context(create_forward_context(None, cfg, dp_metadata=dp)):
        out = kernel.apply(hidden_states=x.clone(), w1=w1, w2=w2, topk_weights=w, topk_ids=idx,
                           activation=MoEActivation.SILU, global_num_experts=num_experts, expert_map=None,
                           apply_router_weight_on_input=False)
    assert len(experts.seen) == 1, len(experts.seen)
    recv_x, recv_count = experts.seen[0]
    ll_check_received(rank, f"round {seed}", ll_fp8_inputs(inputs) if fp8 else inputs, recv_x, recv_count,
                      num_experts, ep, dead)
    ll_check_combine(rank, f"round {seed} (FusedMoEKernel output)", out, inputs, num_experts, ep, fp8, dead)


def _ll_async_layer(pf, rank, ep, num_experts, seed):
    """DeepEPLLPrepareAndFinalize's async halves, as vLLM's dual-batch overlap drives them:
    ``prepare_async`` (dispatch with the recv hook; the hook run later), then
    ``finalize_async`` (combine with ``return_recv_hook``; the output valid after the hook)."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    inputs = ll_round(seed, ep, num_experts, LL_MAX, LL_HIDDEN, LL_TOPK)
    x, idx, w = inputs[rank]
    hook, receiver = pf.prepare_async(x, w, idx, num_experts, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    hook()
    expert_x, expert_x_scale, meta, _, _ = receiver()
    counts = meta.expert_num_tokens
    ll_check_received(rank, f"async round {seed}", inputs, expert_x, counts, num_experts, ep)
    y = ll_expert_outputs(ll_dequant(expert_x, expert_x_scale), counts, rank, num_experts, ep)
    out = torch.full((x.shape[0], LL_HIDDEN), 7.0, dtype=torch.bfloat16)
    recv_hook, _ = pf.finalize_async(out, y, w, idx, False, TopKWeightAndReduceDelegate())
    assert recv_hook is not None
    recv_hook()
    ll_check_combine(rank, f"async round {seed}", out, inputs, num_experts, ep, False)


def deepep_ll_rounds(rank, ep, runtime_dir, pg_file, num_experts):
    import torch

    import a2ad.deep_ep

    cfg, manager = _ll_setup(rank, ep, runtime_dir, pg_file, fault_tolerance=False)
    assert manager.support_fault_tolerance is False
    kernel, pf, experts = _ll_kernel(rank, ep, num_experts, manager)
    kfp8, pfp8, efp8 = _ll_kernel(rank, ep, num_experts, manager, fp8=True)  # a block-FP8 layer
    buf = pf.buffer
    assert isinstance(buf, a2ad.deep_ep.Buffer) and buf.low_latency_mode and buf.explicitly_destroy
    assert not buf.enable_shrink and buf.group_size == ep and buf.rank == rank
    for rnd in range(3):
        _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 6000 + rnd)
    _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 6010, tokens=[0] + [LL_MAX] * (ep - 1))
    # a second layer of the same geometry gets the same Buffer (vLLM's handle cache)
    kernel2, pf2, experts2 = _ll_kernel(rank, ep, num_experts, manager)
    assert pf2.buffer is buf
    _ll_layer(kernel2, experts2, cfg, rank, ep, num_experts, 6020)
    _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 6021)
    assert pfp8.buffer is buf
    for rnd in range(2):  # FP8 dispatch of the same geometry, between bf16 layers
        _ll_layer(kfp8, efp8, cfg, rank, ep, num_experts, 6030 + rnd, fp8=True)
        _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 6040 + rnd)
    for rnd in range(2):
        _ll_async_layer(pf, rank, ep, num_experts, 6050 + rnd)
    job = buf.job
    manager.destroy()  # vLLM's destroy: Buffer.destroy() of every cached handle
    with pytest.raises(Exception, match="destroyed"):
        buf.low_latency_dispatch(torch.zeros(1, LL_HIDDEN, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64),
                                 LL_MAX, num_experts)
    return job


def deepep_ll_kill9(rank, ep, runtime_dir, pg_file, num_experts, stamp):
    import torch.distributed as dist
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

    cfg, manager = _ll_setup(rank, ep, runtime_dir, pg_file, fault_tolerance=True)
    assert manager.support_fault_tolerance is True
    from types import SimpleNamespace

    WorkerSentinel(SimpleNamespace(parallel_config=cfg.parallel_config))  # an FT-capable backend
    kernel, pf, experts = _ll_kernel(rank, ep, num_experts, manager)
    assert pf.buffer.enable_shrink
    victim = ep - 1
    for rnd in range(2):
        _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 7000 + rnd)
    assert manager.query_active_mask().tolist() == [0] * ep and not bool(manager.query_fault())
    dist.barrier(group=manager.cpu_group)
    if rank == victim:
        die_now(stamp)
    t0 = killed_at(stamp)
    wait_until(lambda: bool(manager.query_fault()), 5.0, "query_fault() True")
    seen = time.time() - t0
    lost = [1 if r == victim else 0 for r in range(ep)]
    assert manager.query_active_mask().tolist() == lost
    for rnd in range(3):  # the survivors keep serving, without the victim's experts
        _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 7100 + rnd, dead=(victim,))
    # the sentinel's retry: vLLM's clean_buffers (local buffer zeroed, mask buffer cleaned); a
    # rank the daemon counts lost stays masked (DeepEP would mask it again at its next timeout)
    manager.clean_buffers()
    assert manager.query_active_mask().tolist() == lost
    _ll_layer(kernel, experts, cfg, rank, ep, num_experts, 7200, dead=(victim,))
    all_reached(stamp, rank, [r for r in range(ep) if r != victim], "checked query_fault()")
    return seen


@pytest.mark.parametrize("ep", [2, 4])
def test_deepep_ll_fused_moe_kernel_rounds(daemon, tmp_path, ep):
    res = run_group(deepep_ll_rounds, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep), timeout=600)
    assert len(set(res.values())) == 1, res


@pytest.mark.parametrize("ep", [2, 4])
def test_deepep_ll_kill9_seen_by_query_fault_within_1s(daemon, tmp_path, ep):
    victim = ep - 1
    res = run_group(deepep_ll_kill9, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep,
                                          str(tmp_path / "killed")), timeout=600, may_die={victim})
    assert sorted(res) == [r for r in range(ep) if r != victim]
    assert max(res.values()) < 1.0, f"query_fault() saw the kill after {max(res.values()):.3f} s"
