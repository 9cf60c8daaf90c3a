"""vLLM plugin: the ``flashinfer_nvlink_one_sided`` all-to-all backend on a2ad.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (``a2ad =
a2ad.integrations.vllm:register``) in every vLLM process; it does nothing unless
``A2AD_ENGINE_PLUGIN=1``. Then, with ``--all2all-backend flashinfer_nvlink_one_sided``:

- vLLM's ``FlashInferNVLinkOneSidedManager`` is replaced (in its module, which vLLM's CUDA
  communicator reads when it builds the manager) by :class:`A2adNVLinkOneSidedManager`, a
  subclass that builds :class:`a2ad.integrations.flashinfer.A2adAlltoAll` instead of
  FlashInfer's ``NVLinkOneSidedAlltoAll``. vLLM's prepare/finalize
  (``FlashInferNVLinkOneSidedPrepareAndFinalize``) runs unchanged on it: ``dispatch(x,
  topk_ids, topk_weights, hidden_states_scale=, max_tokens_per_rank=)``,
  ``combine(expert_out, output=)``, the capacity growth (destroy, then create: a new a2ad
  job), ``checkpoint_prepare``/``checkpoint_restore`` around sleep and wake.
- The manager sets ``support_fault_tolerance`` and implements vLLM's fault-tolerance hooks
  from the job's control block, without a host sync: ``query_active_mask()`` (int32 on the
  device, 1 = masked rank), ``query_fault()`` (a device bool: the mask changed since the
  last ``clean_buffers()``, the job was aborted, or this rank's wait failed) and
  ``clean_buffers()`` (re-arms a failed rank, then takes the mask as the new baseline).
- vLLM's worker sentinel accepts ``flashinfer_nvlink_one_sided`` as a fault-tolerant backend.

With ``A2AD_DEEP_EP=1`` as well, ``import deep_ep`` gives :mod:`a2ad.deep_ep` in every vLLM
process (and vLLM's cached ``has_deep_ep()`` probe is re-run), so that ``--all2all-backend
deepep_low_latency`` runs vLLM's own ``DeepEPLLAll2AllManager`` (its ``deep_ep.Buffer``, with
``enable_shrink`` from ``--enable-fault-tolerance``, and its ``query_active_mask`` /
``query_fault`` / ``clean_buffers``) and ``DeepEPLLPrepareAndFinalize`` on a2ad.

Settings (environment): ``A2AD_ON_PEER_LOSS`` (``raise``, the default, or ``degrade``),
``A2AD_RUNTIME_DIR`` (the daemon's runtime folder; default the daemon's default),
``A2AD_TIMEOUT`` (seconds for the rendezvous and every wait on a peer, default 60).

The plugin refuses a vLLM outside the tested range at load, naming both versions.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Optional

from . import DEEP_EP_SWITCH, SWITCH, check_version as _check_version, enabled, env_options, install_deep_ep

logger = logging.getLogger("a2ad.integrations.vllm")

#: vLLM versions this plugin was tested with: [low, high).
VLLM_TESTED = ("0.33.0", "0.34")
BACKEND = "flashinfer_nvlink_one_sided"

_registered = False
_manager_cls = None


def check_version(version: Optional[str] = None) -> str:
    """Raise RuntimeError when ``version`` (default: the installed vLLM's) is outside
    :data:`VLLM_TESTED`, naming both; return it otherwise."""
    return _check_version("vllm", VLLM_TESTED, version)


def _env_options() -> dict:
    return {**env_options(), "job_prefix": "vllm"}


def manager_class():
    """:class:`A2adNVLinkOneSidedManager` (built on first use: it subclasses vLLM's class)."""
    global _manager_cls
    if _manager_cls is not None:
        return _manager_cls
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators import all2all as a2a_mod
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

    from . import flashinfer as fi

    base = getattr(a2a_mod.FlashInferNVLinkOneSidedManager, "_a2ad_original", a2a_mod.FlashInferNVLinkOneSidedManager)

    class A2adNVLinkOneSidedManager(base):
        """vLLM's one-sided manager building an a2ad communication (see the module doc)."""

        def __init__(self, cpu_group):
            # vLLM's __init__ only asserts that FlashInfer's NVLink wrapper exists, then sets
            # these fields; a2ad does not need FlashInfer's kernels
            All2AllManagerBase.__init__(self, cpu_group)
            self.initialized = False
            self.communication = None
            self.top_k = 0
            self.num_experts = 0
            self.support_fault_tolerance = True
            self._idle_mask = None

        def initialize(self, max_num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                       dispatch_format=None, extra_payload_bytes_per_token: int = 0) -> None:
            """vLLM's sharing of the largest capacities (same rules), on an a2ad communication."""
            if self.initialized:
                assert top_k == self.top_k, (
                    f"a2ad one-sided communication does not support heterogeneous top_k (got {top_k}, was built "
                    f"with {self.top_k})")
                assert num_experts == self.num_experts, (
                    "a2ad one-sided communication does not support heterogeneous num_experts "
                    f"(got {num_experts}, was built with {self.num_experts})")
            if extra_payload_bytes_per_token < 0:
                raise ValueError("extra_payload_bytes_per_token must be non-negative")
            params = fi.MoEEpCommParams(num_experts=num_experts, top_k=top_k, max_tokens_per_rank=max_num_tokens,
                                        hidden_size=hidden_size, dtype=torch.bfloat16, dispatch_format=dispatch_format)
            comm = self.communication
            if comm is not None:
                previous_max = comm.params.max_tokens_per_rank
                previous_bytes = comm.params.dispatch_bytes_per_token + comm.config.extra_payload_bytes_per_token
                dispatch_bytes = params.dispatch_bytes_per_token + extra_payload_bytes_per_token
                if (max_num_tokens <= previous_max and hidden_size <= comm.params.hidden_size
                        and dispatch_bytes <= previous_bytes):
                    return
                if hidden_size < comm.params.hidden_size or (
                        hidden_size == comm.params.hidden_size and dispatch_bytes < previous_bytes):
                    params = comm.params
                params = replace(params, max_tokens_per_rank=max(max_num_tokens, previous_max))
                extra_payload_bytes_per_token = max(dispatch_bytes, previous_bytes) - params.dispatch_bytes_per_token
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            bootstrap = fi.BootstrapConfig(world_size=self.world_size, rank=self.rank, device=device,
                                           process_group=self.cpu_group)
            try:
                import vllm.envs as envs

                low_precision = bool(envs.VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE)
            except Exception:
                low_precision = False
            config = fi.A2adConfig(extra_payload_bytes_per_token=extra_payload_bytes_per_token,
                                   use_low_precision_combine=low_precision, **_env_options())
            if comm is not None:
                # growth happens while the model is built, before graph capture: every rank
                # leaves the old job, then all join the new one
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                dist.barrier(group=self.cpu_group)
                self.cleanup()
                dist.barrier(group=self.cpu_group)
            with torch.device("cpu"):
                replacement = fi.A2adAlltoAll(bootstrap, params, config)
            self.communication = replacement
            self.top_k = top_k
            self.num_experts = num_experts
            self.initialized = True
            logger.info("a2ad one-sided all-to-all: rank %s of %s, hidden %s, job %s", self.rank, self.world_size,
                        params.hidden_size, replacement.job)
            dist.barrier(group=self.cpu_group)

        # --- vLLM's fault-tolerance hooks -----------------------------------------
        def _idle(self):
            if self._idle_mask is None:
                dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
                self._idle_mask = torch.zeros(self.world_size, dtype=torch.int32, device=dev)
            return self._idle_mask

        def query_active_mask(self):
            """``[ep_size]`` int32 on the device, 1 = a masked (lost) rank; no host sync."""
            if self.communication is None:
                return self._idle()
            return self.communication.rank_mask()

        def query_fault(self):
            """0-d device bool: a new fault since the last clean_buffers(); no host sync."""
            if self.communication is None:
                return self._idle().any()
            return self.communication.fault()

        def clean_buffers(self) -> None:
            """After a fault (rank-local): re-arm this rank if its job failed (waits until every
            rank is present again), then take the current mask as the baseline. a2ad's rounds
            are counted, so no stale tokens are read: no buffer needs zeroing."""
            if self.communication is not None:
                self.communication.clean()

    A2adNVLinkOneSidedManager._a2ad_original = base
    A2adNVLinkOneSidedManager.__qualname__ = "A2adNVLinkOneSidedManager"
    _manager_cls = A2adNVLinkOneSidedManager
    return _manager_cls


def install() -> None:
    """Put a2ad in vLLM's one-sided path and let the worker sentinel accept it (idempotent)."""
    from vllm.distributed.device_communicators import all2all as a2a_mod

    a2a_mod.FlashInferNVLinkOneSidedManager = manager_class()
    try:
        from vllm.v1.worker.sentinel import gpu_worker_sentinel as sentinel
    except ImportError:  # pragma: no cover (a vLLM without the sentinel)
        return
    if BACKEND not in sentinel.FT_BACKEND_SET:
        sentinel.FT_BACKEND_SET = frozenset(sentinel.FT_BACKEND_SET | {BACKEND})


def install_deep_ep_ll() -> bool:
    """With ``A2AD_DEEP_EP=1``: ``deep_ep`` is :mod:`a2ad.deep_ep` in this process, and vLLM's
    cached module probes (``has_deep_ep()``) forget an earlier answer. Returns whether it acted."""
    if not install_deep_ep():
        return False
    iu = sys.modules.get("vllm.utils.import_utils")
    for name in ("_has_module", "_has_module_spec"):
        probe = getattr(iu, name, None)
        if probe is not None and hasattr(probe, "cache_clear"):
            probe.cache_clear()
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: acts only with ``A2AD_ENGINE_PLUGIN=1``."""
    global _registered
    if not enabled():
        return
    if _registered:
        return
    version = check_version()
    install()
    deep = install_deep_ep_ll()
    _registered = True
    logger.info("a2ad: vLLM %s's %s all-to-all runs on a2ad (%s=1)", version, BACKEND, SWITCH)
    if deep:
        logger.info("a2ad: deep_ep is a2ad.deep_ep (%s=1): --all2all-backend deepep_low_latency runs on a2ad",
                    DEEP_EP_SWITCH)
