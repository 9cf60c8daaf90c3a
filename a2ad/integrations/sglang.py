"""SGLang plugin: the ``flashinfer`` MoE all-to-all backend (``FlashinferDispatcher``) on a2ad.

Loaded by SGLang through the ``sglang.srt.plugins`` entry point (``a2ad =
a2ad.integrations.sglang:register``) in every SGLang process; it does nothing unless
``A2AD_ENGINE_PLUGIN=1``. Then, with ``--moe-a2a-backend flashinfer``, two hooks go into
SGLang's ``HookRegistry`` (applied by ``load_plugins``):

- around ``FlashinferDispatcher.__init__``: the dispatcher module's ``MoeAlltoAll`` and
  ``moe_a2a_get_workspace_size_per_rank`` become a2ad's (:func:`make_moe_alltoall`), so
  each workspace namespace the dispatcher builds (decode, speculative, SP prefill) is its
  own a2ad job, named from the dispatcher's process group and the namespace's geometry;
  its ``dispatch``/``combine`` code runs unchanged on them.
- after ``FlashinferDispatcher.combine``: with elastic EP on
  (``ElasticEPStateManager.instance()`` set), a2ad's view of which ranks serve is written
  into ``active_ranks`` (int32 on the device, 1 = active) in stream order, without a host
  sync, so SGLang's rebalancing sees a lost rank at the next step instead of after a timeout.

With ``A2AD_DEEP_EP=1`` as well, ``import deep_ep`` gives :mod:`a2ad.deep_ep` in every SGLang
process, so that ``--moe-a2a-backend deepep --deepep-mode low_latency`` runs SGLang's own
``DeepEPDispatcher`` (its low-latency implementation and ``DeepEPBuffer``) on a2ad. The
normal mode (``--deepep-mode normal``, and ``auto``'s prefill batches) is refused by
:mod:`a2ad.deep_ep` (``NotSupported``), naming ``low_latency``.

Settings (environment): ``A2AD_ON_PEER_LOSS`` (``raise``, the default, or ``degrade``;
elastic EP needs ``degrade`` to keep serving), ``A2AD_RUNTIME_DIR``, ``A2AD_TIMEOUT``.

The plugin refuses an SGLang outside the tested range at load, naming both versions.
"""

from __future__ import annotations

import logging
import sys

from . import DEEP_EP_SWITCH, SWITCH, check_version as _check_version, enabled, env_options, install_deep_ep

logger = logging.getLogger("a2ad.integrations.sglang")

#: SGLang versions this plugin was tested with: [low, high).
SGLANG_TESTED = ("0.5.23", "0.5.24")
DISPATCHER = "sglang.srt.layers.moe.token_dispatcher.flashinfer.FlashinferDispatcher"
DEEPEP_MODULE = "sglang.srt.layers.moe.token_dispatcher.deepep"
_MODULE = DISPATCHER.rsplit(".", 1)[0]
#: room for each payload's region being padded to 128 bytes (up to 4 payloads)
_PADDING_SLACK = 4 * 128

_registered = False


def check_version(version: str | None = None) -> str:
    """Raise RuntimeError when ``version`` (default: the installed SGLang's) is outside
    :data:`SGLANG_TESTED`, naming both; return it otherwise."""
    return _check_version("sglang", SGLANG_TESTED, version)


def _options() -> dict:
    return env_options(default_timeout=60.0)


def workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                            combine_payload_size_per_token, *args, **kwargs) -> int:
    """a2ad's workspace size for FlashInfer's per-token sizes (FlashInfer's signature)."""
    from a2ad.client import moe_a2a_get_workspace_size_per_rank

    return moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                               combine_payload_size_per_token) + _PADDING_SLACK


def make_moe_alltoall(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None, hidden_size=None,
                      mnnvl_config=None, **kwargs):
    """FlashInfer's ``MoeAlltoAll(mapping=, max_num_tokens=, top_k=, num_experts=,
    workspace_size_per_rank=, mnnvl_config=)`` as an a2ad :class:`~a2ad.client.MoeAlltoAll`
    whose job name the ranks agree on through ``mnnvl_config.comm_backend`` (SGLang's
    ``TorchDistributedCommBackend`` over the dispatcher's group)."""
    from a2ad.client import MoeAlltoAll

    from . import flashinfer as fi
    from ._status import RankStatus

    opts = _options()
    ep_rank, ep_size = int(mapping.moe_ep_rank), int(mapping.moe_ep_size)
    comm = getattr(mnnvl_config, "comm_backend", None)
    token = fi._agree_token(ep_rank, ep_size, comm, None)
    geometry = (max_num_tokens, top_k, num_experts, workspace_size_per_rank, opts["on_peer_loss"])
    job = fi.job_name("sgl", token, ep_size, geometry)
    a2a = MoeAlltoAll(fi._Mapping(ep_rank, ep_size), max_num_tokens, top_k, num_experts,
                      workspace_size_per_rank=workspace_size_per_rank, hidden_size=hidden_size, job=job, **opts)
    a2a.a2ad_status = RankStatus(a2a)
    logger.info("a2ad MoeAlltoAll: rank %s of %s, job %s", ep_rank, ep_size, job)
    return a2a


def _flashinfer_names():
    """FlashInfer's ``Mapping`` and ``MnnvlConfig`` when importable, else minimal stand-ins
    (the dispatcher only constructs them and hands them to ``MoeAlltoAll``)."""
    try:
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig

        return Mapping, MnnvlConfig
    except Exception:
        class Mapping:
            def __init__(self, rank=0, tp_size=1, moe_ep_size=1, world_size=1, **_):
                self.rank, self.world_size = rank, world_size
                self.moe_ep_size = moe_ep_size
                self.moe_ep_rank = rank % moe_ep_size

        class MnnvlConfig:
            def __init__(self, comm_backend=None, **_):
                self.comm_backend = comm_backend

        return Mapping, MnnvlConfig


def patch_dispatcher_module(mod=None) -> None:
    """Point the dispatcher module's FlashInfer names at a2ad (idempotent)."""
    if mod is None:
        import importlib

        mod = importlib.import_module(_MODULE)
    if getattr(mod, "_a2ad_patched", False):
        return
    mod.MoeAlltoAll = make_moe_alltoall
    mod.moe_a2a_get_workspace_size_per_rank = workspace_size_per_rank
    if not getattr(mod, "use_flashinfer", False):
        mod.Mapping, mod.MnnvlConfig = _flashinfer_names()
        if not hasattr(mod, "nvfp4_block_scale_interleave"):
            mod.nvfp4_block_scale_interleave = None  # only the NVFP4 + CUTLASS path uses it
        mod.use_flashinfer = True
    mod._a2ad_patched = True


def _around_init(original, self, *args, **kwargs):
    patch_dispatcher_module(sys.modules[type(self).__module__] if type(self).__module__ == _MODULE else None)
    return original(self, *args, **kwargs)


def publish_active_ranks(dispatcher) -> None:
    """Write a2ad's serving ranks into elastic EP's ``active_ranks`` (no host sync)."""
    try:
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    except ImportError:  # pragma: no cover
        return
    inst = ElasticEPStateManager.instance()
    if inst is None or getattr(inst, "active_ranks", None) is None:
        return
    a2a = getattr(dispatcher, "moe_a2a", None)
    status = getattr(a2a, "a2ad_status", None)
    if status is None or status.closed:
        return
    active = status.active()
    n = min(active.shape[0], inst.active_ranks.shape[0])
    inst.active_ranks[:n].copy_(active[:n].to(inst.active_ranks.device, non_blocking=True))


def _after_combine(result, self, *args, **kwargs):
    publish_active_ranks(self)
    return None  # keep the combine's result


def install() -> None:
    """Register the two hooks in SGLang's HookRegistry (``load_plugins`` applies them)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{DISPATCHER}.__init__", _around_init, HookType.AROUND)
    HookRegistry.register(f"{DISPATCHER}.combine", _after_combine, HookType.AFTER)


def install_deep_ep_ll() -> bool:
    """With ``A2AD_DEEP_EP=1``: ``deep_ep`` is :mod:`a2ad.deep_ep` in this process. SGLang's
    DeepEP dispatcher module imports ``Buffer`` and ``Config`` from it when it is first imported;
    if that happened before (and found no DeepEP), its names are bound now, as its import
    would have. Returns whether it acted."""
    if not install_deep_ep():
        return False
    mod = sys.modules.get(DEEPEP_MODULE)
    if mod is not None and getattr(mod, "Buffer", None) is not sys.modules["deep_ep"].Buffer:
        import a2ad.deep_ep as dep

        mod.Buffer, mod.Config = dep.Buffer, dep.Config
        if not hasattr(mod, "sglang_per_token_group_quant_fp8"):
            try:
                from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8
            except Exception:  # only its normal mode uses it, which a2ad.deep_ep refuses
                sglang_per_token_group_quant_fp8 = None
            mod.sglang_per_token_group_quant_fp8 = sglang_per_token_group_quant_fp8
        mod.use_deepep = True
        mod._deepep_import_error = None
    return True


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: acts only with ``A2AD_ENGINE_PLUGIN=1``."""
    global _registered
    if not enabled() or _registered:
        return
    version = check_version()
    install()
    deep = install_deep_ep_ll()
    _registered = True
    logger.info("a2ad: SGLang %s's FlashinferDispatcher runs on a2ad (%s=1)", version, SWITCH)
    if deep:
        logger.info("a2ad: deep_ep is a2ad.deep_ep (%s=1): --moe-a2a-backend deepep --deepep-mode low_latency "
                    "runs on a2ad", DEEP_EP_SWITCH)
