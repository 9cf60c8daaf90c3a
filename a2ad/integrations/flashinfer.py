"""A ``flashinfer.moe_ep`` communication backend that runs on a2ad.

FlashInfer 0.7.2's ``flashinfer.moe_ep`` builds a communication per expert-parallel group
from a ``BootstrapConfig`` and ``MoEEpCommParams`` (``create_communication``); its
``nvlink_one_sided`` backend wraps ``flashinfer.comm.MoeAlltoAll``. :class:`A2adAlltoAll`
implements the same ``MoEEpCommunication`` interface over :class:`a2ad.client.MoeAlltoAll`,
so the workspace belongs to the a2ad daemon and a lost rank is seen by the daemon
(``on_peer_loss``: raise or degrade) instead of hanging the group. It is registered as
``"a2ad"`` and takes :class:`A2adConfig` or FlashInfer's own ``NVLinkOneSidedConfig``::

    from flashinfer.moe_ep import create_communication
    import a2ad.integrations.flashinfer as a2ad_fi

    comm = create_communication(bootstrap, params, backend=a2ad_fi.A2adConfig(on_peer_loss="degrade"))

Without FlashInfer installed the module still imports: :class:`MoEEpCommParams`,
:class:`MoEEpDispatchResult`, :class:`BootstrapConfig` and :class:`MoEEpCommunication` are
then compatible stand-ins with FlashInfer's fields, and :class:`A2adAlltoAll` is
constructed directly.

Job names. The ranks agree on a job name at every construction, through the config's
``comm_backend`` (FlashInfer's ``CommBackend``: ``allgather``) or else the bootstrap's
``process_group`` (the default torch.distributed group when it is None): the group's first
rank draws a random part and every rank receives it. The name also carries the geometry
(EP size, capacity, a digest of the rest), so a rebuild with a larger capacity (destroy,
then create) leaves the old job and joins a new one, and two engines on one node never
join each other's job. ``A2adConfig(job=...)`` names the job explicitly instead.
"""

from __future__ import annotations

import hashlib
import inspect
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from a2ad import errors

#: The FlashInfer release whose ``moe_ep`` interface this module implements.
FLASHINFER_TESTED = "0.7.2"
#: The name the backend is registered under in ``flashinfer.moe_ep``.
BACKEND_NAME = "a2ad"

try:  # FlashInfer's types when it is importable, so results pass its isinstance checks
    from flashinfer.moe_ep.config import BootstrapConfig  # type: ignore
    from flashinfer.moe_ep.core.comm.communication import (  # type: ignore
        MoEEpCommParams,
        MoEEpCommunication,
        MoEEpDispatchResult,
        register_communication,
    )

    HAVE_FLASHINFER = True
except Exception:  # not installed, or its import fails on this machine
    HAVE_FLASHINFER = False
    from abc import ABC, abstractmethod

    @dataclass(frozen=True)
    class BootstrapConfig:  # type: ignore[no-redef]
        """FlashInfer's ``BootstrapConfig`` fields (the ones a communication reads)."""

        world_size: int
        rank: int
        stream: int = 0
        auto_bootstrap: bool = True
        device: Optional[int] = field(default=None, kw_only=True)
        nccl_comm: Optional[int] = None
        process_group: Any = field(default=None, compare=False, hash=False)
        tcp_store: Any = None

        def __post_init__(self) -> None:
            if self.world_size <= 0:
                raise ValueError(f"world_size must be positive, got {self.world_size}")
            if not 0 <= self.rank < self.world_size:
                raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")

    @dataclass(frozen=True)
    class MoEEpCommParams:  # type: ignore[no-redef]
        """FlashInfer's ``MoEEpCommParams`` (``dispatch_format`` must be None here: the
        quantized formats' byte counts need FlashInfer's ``QuantFormat``)."""

        num_experts: int
        top_k: int
        max_tokens_per_rank: int
        hidden_size: int
        dtype: Optional[torch.dtype] = None
        dispatch_format: Any = None
        invalid_expert_id: int = -1

        def __post_init__(self) -> None:
            for name in ("num_experts", "top_k", "max_tokens_per_rank", "hidden_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(f"MoEEpCommParams.{name} must be a positive int")
            if self.top_k > self.num_experts:
                raise ValueError(f"MoEEpCommParams.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
            if 0 <= self.invalid_expert_id < self.num_experts:
                raise ValueError("MoEEpCommParams.invalid_expert_id must lie outside "
                                 f"[0, num_experts={self.num_experts}), got {self.invalid_expert_id}")
            if self.dispatch_format is not None:
                raise ValueError("MoEEpCommParams.dispatch_format needs FlashInfer's QuantFormat "
                                 "(flashinfer is not importable here): pass None")

        @property
        def token_dtype(self) -> torch.dtype:
            return torch.bfloat16 if self.dtype is None else self.dtype

        @property
        def dispatch_bytes_per_token(self) -> int:
            return self.hidden_size * self.token_dtype.itemsize

    @dataclass(frozen=True)
    class MoEEpDispatchResult:  # type: ignore[no-redef]
        """FlashInfer's ``MoEEpDispatchResult``: ``ep_size * tokens_per_rank`` rows each."""

        hidden_states: torch.Tensor
        topk_ids: torch.Tensor
        topk_weights: Optional[torch.Tensor]
        tokens_per_rank: int
        hidden_states_scale: Optional[torch.Tensor] = None
        eplb_gathered_stats: Optional[torch.Tensor] = None

    class MoEEpCommunication(ABC):  # type: ignore[no-redef]
        """FlashInfer's ``MoEEpCommunication`` base: construction checks and the interface."""

        backend_name: ClassVar[str]
        supports_cuda_graph: ClassVar[bool] = True

        def __init__(self, bootstrap, params) -> None:
            if not self.is_platform_supported():
                raise RuntimeError(f"{type(self).__name__} is not supported on this platform.")
            self.bootstrap = bootstrap
            self.params = params
            self.ep_rank = bootstrap.rank
            self.ep_size = bootstrap.world_size
            if params.num_experts % self.ep_size != 0:
                raise ValueError(f"{type(self).__name__} requires num_experts ({params.num_experts}) "
                                 f"divisible by the EP size ({self.ep_size})")
            self.num_local_experts = params.num_experts // self.ep_size

        @classmethod
        @abstractmethod
        def is_platform_supported(cls) -> bool: ...

        def is_workload_feasible(self, max_tokens_per_rank: int) -> bool:
            return max_tokens_per_rank <= self.params.max_tokens_per_rank

        @abstractmethod
        def dispatch(self, hidden_states, topk_ids, topk_weights=None, *, hidden_states_scale=None,
                     max_tokens_per_rank=None, eplb_local_stats=None): ...

        @abstractmethod
        def combine(self, expert_output, *, output=None): ...

        def get_combine_input_buffer(self, dtype):
            return None

        def destroy(self) -> None:
            pass

    def register_communication(name):  # type: ignore[no-redef]
        def decorator(cls):
            cls.backend_name = name
            return cls

        return decorator


@dataclass
class A2adConfig:
    """Options of :class:`A2adAlltoAll`: FlashInfer's ``NVLinkOneSidedConfig`` fields, then a2ad's.

    ``extra_payload_bytes_per_token``, ``eplb_stats_num_experts``, ``enable_rank_mask``,
    ``use_low_precision_combine``, ``comm_backend``: as in ``NVLinkOneSidedConfig``
    (``comm_backend`` is used to agree on the job name). ``job``: the job name (default:
    agreed, see the module doc); ``job_prefix``: the agreed name's first part (up to 16 of
    letters, digits, ``_.-``); ``runtime_dir``: the daemon's runtime folder;
    ``on_peer_loss``: ``"raise"`` or ``"degrade"``; ``timeout``: seconds for the rendezvous
    and every wait on a peer.
    """

    backend_name: str = BACKEND_NAME
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None
    job: Optional[str] = None
    job_prefix: str = "fi"
    runtime_dir: Any = None
    on_peer_loss: str = "raise"
    timeout: float = 60.0

    @classmethod
    def from_config(cls, config, **a2ad_options) -> "A2adConfig":
        """An :class:`A2adConfig` from FlashInfer's ``NVLinkOneSidedConfig`` (or any object with
        its fields), plus a2ad's options."""
        if isinstance(config, cls):
            return config if not a2ad_options else cls(**{**config.__dict__, **a2ad_options})
        fields = {}
        for name in ("extra_payload_bytes_per_token", "eplb_stats_num_experts", "enable_rank_mask",
                     "use_low_precision_combine", "comm_backend"):
            if hasattr(config, name):
                fields[name] = getattr(config, name)
        return cls(**fields, **a2ad_options)


class _Mapping:
    def __init__(self, rank: int, size: int):
        self.moe_ep_rank = rank
        self.moe_ep_size = size


def _agree_token(rank: int, size: int, comm_backend, process_group) -> str:
    """A random token drawn by the group's first rank, received by every rank."""
    token = secrets.token_hex(5)
    if comm_backend is not None:
        got = comm_backend.allgather(token)
        return str(got[0])
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise errors.InputError(
            "no communicator to agree on a job name through: initialize torch.distributed (or pass the "
            "bootstrap's process_group, or the config's comm_backend), or give A2adConfig(job=...)",
            argument="job",
        )
    group = process_group
    gsize = dist.get_world_size(group)
    grank = dist.get_rank(group)
    if gsize != size or grank != rank:
        raise errors.InputError(
            f"the process group has rank {grank} of {gsize}; the bootstrap says rank {rank} of {size}",
            argument="process_group",
        )
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [token]
    dist.broadcast_object_list(box, src=src, group=group)
    return str(box[0])


def job_name(prefix: str, token: str, ep_size: int, geometry: tuple) -> str:
    """``<prefix>-<token>-<ep_size>x<capacity>-<digest of the geometry>``."""
    digest = hashlib.sha1(repr(geometry).encode()).hexdigest()[:8]
    return f"{prefix}-{token}-{ep_size}x{geometry[0]}-{digest}"


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def is_a2ad_communication(obj) -> bool:
    return isinstance(obj, A2adAlltoAll)


@register_communication(BACKEND_NAME)
class A2adAlltoAll(MoEEpCommunication):
    """Rank-major dispatch/combine over an a2ad job (FlashInfer's ``MoEEpCommunication``).

    ``bootstrap``: ``BootstrapConfig`` (``world_size``, ``rank``, ``process_group``).
    ``params``: ``MoEEpCommParams``. ``config``: :class:`A2adConfig` or FlashInfer's
    ``NVLinkOneSidedConfig`` (then a2ad's options take their defaults); ``a2ad_options``:
    :class:`A2adConfig`'s a2ad fields, overriding the config's.

    ``hidden_states``, its optional scale factors, ``topk_ids`` and ``topk_weights`` travel
    as the payloads of one dispatch, as in ``NVLinkOneSidedAlltoAll``; received rows
    beyond a source's token count carry ``invalid_expert_id``.
    """

    supports_cuda_graph: ClassVar[bool] = True

    def __init__(self, bootstrap, params, config=None, **a2ad_options) -> None:
        from a2ad.client import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank

        cfg = A2adConfig.from_config(A2adConfig() if config is None else config, **a2ad_options)
        self.config = cfg
        super().__init__(bootstrap, params)
        if cfg.extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        kwargs: dict = {}
        if cfg.eplb_stats_num_experts:
            if not _accepts(MoeAlltoAll.__init__, "eplb_stats_num_experts"):
                raise errors.InputError("this a2ad's MoeAlltoAll has no EPLB statistics", argument="eplb_stats_num_experts")
            kwargs["eplb_stats_num_experts"] = cfg.eplb_stats_num_experts
        if cfg.enable_rank_mask:
            if not _accepts(MoeAlltoAll.__init__, "enable_rank_mask"):
                raise errors.InputError("this a2ad's MoeAlltoAll takes no rank mask", argument="enable_rank_mask")
            kwargs["enable_rank_mask"] = True
        self._combine_kw = {}
        if cfg.use_low_precision_combine:
            if not _accepts(MoeAlltoAll.combine, "use_low_precision"):
                raise errors.InputError("this a2ad's MoeAlltoAll has no low-precision combine",
                                        argument="use_low_precision_combine")
            self._combine_kw["use_low_precision"] = True
        self._combine_takes_output = _accepts(MoeAlltoAll.combine, "output")

        # activations, int32 ids, float32 weights (+ extra); each payload's region is padded
        # to 128 bytes, so room for that padding too
        dispatch_bytes = params.dispatch_bytes_per_token + 8 * params.top_k + cfg.extra_payload_bytes_per_token
        combine_bytes = params.hidden_size * max(params.token_dtype.itemsize, 2)
        ws = moe_a2a_get_workspace_size_per_rank(self.ep_size, params.max_tokens_per_rank, dispatch_bytes,
                                                 combine_bytes) + 4 * 128
        self.workspace_size_per_rank = ws
        job = cfg.job
        if job is None:
            geometry = (params.max_tokens_per_rank, params.top_k, params.num_experts, ws, cfg.eplb_stats_num_experts,
                        cfg.on_peer_loss)
            token = _agree_token(self.ep_rank, self.ep_size, cfg.comm_backend, bootstrap.process_group)
            job = job_name(cfg.job_prefix, token, self.ep_size, geometry)
        self.job = job
        device = None
        if getattr(bootstrap, "device", None) is not None and torch.cuda.is_available():
            device = torch.device("cuda", bootstrap.device)
        try:
            self._alltoall = MoeAlltoAll(
                _Mapping(self.ep_rank, self.ep_size), params.max_tokens_per_rank, params.top_k, params.num_experts,
                workspace_size_per_rank=ws, job=job, runtime_dir=cfg.runtime_dir, device=device,
                timeout=float(cfg.timeout), on_peer_loss=cfg.on_peer_loss, **kwargs,
            )
        except errors.InvalidField as exc:
            if device is None or "host backend" not in str(exc):
                raise
            # the daemon runs the host backend: the bootstrap's CUDA device does not apply
            self._alltoall = MoeAlltoAll(
                _Mapping(self.ep_rank, self.ep_size), params.max_tokens_per_rank, params.top_k, params.num_experts,
                workspace_size_per_rank=ws, job=job, runtime_dir=cfg.runtime_dir,
                timeout=float(cfg.timeout), on_peer_loss=cfg.on_peer_loss, **kwargs,
            )
        from ._status import RankStatus

        self.status = RankStatus(self._alltoall)
        self._tokens_per_rank: Optional[int] = None
        self._combine_buffer: Optional[torch.Tensor] = None

    @classmethod
    def is_platform_supported(cls) -> bool:
        """True: a2ad's host backend runs anywhere and its cuda backend on any CUDA GPU; a
        missing daemon is a clear error at construction (no collective work here)."""
        return True

    @property
    def alltoall(self):
        """The underlying :class:`a2ad.client.MoeAlltoAll`."""
        if self._alltoall is None:
            raise RuntimeError("A2adAlltoAll has been destroyed")
        return self._alltoall

    @property
    def device(self) -> torch.device:
        return self.alltoall.attachment.workspace.device

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: Optional[torch.Tensor] = None,
        *,
        hidden_states_scale: Optional[torch.Tensor] = None,
        max_tokens_per_rank: Optional[int] = None,
        eplb_local_stats: Optional[torch.Tensor] = None,
        active_rank_mask: Optional[torch.Tensor] = None,
    ) -> MoEEpDispatchResult:
        """See FlashInfer's ``MoEEpCommunication.dispatch``. ``active_rank_mask`` needs
        ``enable_rank_mask=True``; a2ad's own mask applies in any case."""
        alltoall = self.alltoall
        if self._tokens_per_rank is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        tpr = self.params.max_tokens_per_rank if max_tokens_per_rank is None else int(max_tokens_per_rank)
        if not 0 < tpr <= self.params.max_tokens_per_rank:
            raise ValueError(f"max_tokens_per_rank={tpr} must be in (0, {self.params.max_tokens_per_rank}]")
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        payloads = [hidden_states]
        if hidden_states_scale is not None:
            payloads.append(hidden_states_scale)
        ids_index = len(payloads)
        payloads.append(topk_ids)
        if topk_weights is not None:
            payloads.append(topk_weights)
        extra = {}
        if eplb_local_stats is not None:
            extra["eplb_local_stats"] = eplb_local_stats
        if active_rank_mask is not None:
            extra["active_rank_mask"] = active_rank_mask
        recv = alltoall.dispatch(topk_ids, payloads, tpr, invalid_token_expert_id=self.params.invalid_expert_id,
                                 expert_id_payload_index=ids_index, **extra)
        self._tokens_per_rank = tpr
        recv = [t.flatten(0, 1) for t in recv]
        return MoEEpDispatchResult(
            hidden_states=recv[0],
            hidden_states_scale=recv[1] if hidden_states_scale is not None else None,
            topk_ids=recv[ids_index],
            topk_weights=recv[ids_index + 1] if topk_weights is not None else None,
            tokens_per_rank=tpr,
            eplb_gathered_stats=getattr(alltoall, "eplb_gathered_stats", None),
        )

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """``[ep_size * tokens_per_rank, hidden_size]`` view of this rank's combine region."""
        if self._tokens_per_rank is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch")
        buf = self.alltoall.get_combine_payload_tensor_in_workspace(
            self._tokens_per_rank, self.params.hidden_size, dtype).flatten(0, 1)
        self._combine_buffer = buf
        return buf

    def combine(
        self,
        expert_output: torch.Tensor,
        *,
        output: Optional[torch.Tensor] = None,
        active_rank_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """See FlashInfer's ``MoEEpCommunication.combine``: every local token's outputs summed
        over the ranks it went to, written into ``output`` when given (and returned)."""
        alltoall = self.alltoall
        tpr = self._tokens_per_rank
        if tpr is None:
            raise RuntimeError("combine called before dispatch")
        if expert_output.dim() == 2:
            payload = expert_output.view(self.ep_size, tpr, -1)
        elif expert_output.dim() == 3:
            payload = expert_output
        else:
            raise ValueError(f"expert_output must be 2D or 3D, got shape {tuple(expert_output.shape)}")
        in_ws = self._combine_buffer is not None and expert_output.data_ptr() == self._combine_buffer.data_ptr()
        if in_ws and self._combine_buffer is not None:
            payload = alltoall.get_combine_payload_tensor_in_workspace(tpr, payload.shape[-1], payload.dtype)
        kw = dict(self._combine_kw)
        if active_rank_mask is not None:
            kw["active_rank_mask"] = active_rank_mask
        if output is not None and self._combine_takes_output:
            kw["output"] = output
        try:
            combined = alltoall.combine(payload, tpr, payload_in_workspace=in_ws, **kw)
        finally:
            self._tokens_per_rank = None
            self._combine_buffer = None
        if output is not None and combined is not output:
            output.copy_(combined)
            return output
        return combined

    # --- a2ad's fault state, for the engines' fault-tolerance hooks -------------------
    def rank_mask(self) -> torch.Tensor:
        """``[ep_size]`` int32 on the job's device, 1 = masked rank (no host sync)."""
        return self.status.masked()

    def fault(self) -> torch.Tensor:
        """0-d device bool: a new fault since the last :meth:`clean` (no host sync)."""
        return self.status.fault()

    def clean(self, timeout: Optional[float] = None) -> None:
        """After a fault: re-arm a failed rank (:meth:`a2ad.client.MoeAlltoAll.recover`, which
        waits until every rank is present again) and take the current mask as the baseline
        of :meth:`fault`."""
        if self._alltoall is None:
            return
        if self.status.failed_on_host():
            self._alltoall.recover(timeout if timeout is not None else self.config.timeout)
        self._tokens_per_rank = None
        self._combine_buffer = None
        self.status.rebaseline()

    # --- checkpoints ------------------------------------------------------------------
    def checkpoint_prepare(self) -> None:
        """Quiesce and unmap the workspace (before the process sleeps); the job stays."""
        fn = getattr(self.alltoall, "checkpoint_prepare", None)
        if fn is None:
            raise errors.StateError("this a2ad's MoeAlltoAll has no checkpoint_prepare")
        fn()

    def checkpoint_restore(self, comm_backend=None) -> None:
        """Map the workspace again at the same addresses (captured graphs stay valid)."""
        fn = getattr(self.alltoall, "checkpoint_restore", None)
        if fn is None:
            raise errors.StateError("this a2ad's MoeAlltoAll has no checkpoint_restore")
        fn(comm_backend) if comm_backend is not None else fn()

    def destroy(self) -> None:
        """Leave the job (the daemon releases it once every rank left). Idempotent."""
        a2a, self._alltoall = self._alltoall, None
        self._tokens_per_rank = None
        self._combine_buffer = None
        status = getattr(self, "status", None)
        if status is not None:
            status.close()
        if a2a is not None:
            a2a.close()

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass


def create_communication(bootstrap, params, config=None, **a2ad_options) -> A2adAlltoAll:
    """:class:`A2adAlltoAll` for ``bootstrap`` and ``params`` (FlashInfer's factory's shape)."""
    return A2adAlltoAll(bootstrap, params, config, **a2ad_options)


__all__ = [
    "A2adAlltoAll",
    "A2adConfig",
    "BACKEND_NAME",
    "BootstrapConfig",
    "FLASHINFER_TESTED",
    "HAVE_FLASHINFER",
    "MoEEpCommParams",
    "MoEEpCommunication",
    "MoEEpDispatchResult",
    "create_communication",
    "job_name",
]
