"""``a2ad.deep_ep``: DeepEP v1's low-latency API over workspaces owned by the a2ad daemon.

Code written for DeepEP's low-latency (LL) mode changes only its import::

    import a2ad.deep_ep as deep_ep

    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max, hidden, group.size(), num_experts), low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, num_max, num_experts)
    ...  # run the local experts on recv_x: [num_local_experts, R * num_max, hidden]
    out, event, hook = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

How it maps onto a2ad (docs/DEEPEP.md has the whole table)
----------------------------------------------------------
DeepEP's LL kernels send one message per (token, selected expert) and receive them
expert-major; a2ad's data planes move tokens token-major: a token goes once to each rank
that owns one of its ``top_k`` experts, and combine sums what those ranks return. Here
each (token, k) pair is one a2ad token of a job with ``top_k=1``, so that

* dispatch moves exactly what DeepEP's does (one row per pair), then the receiver arranges
  the rows it got expert-major with a stable sort by (local expert, source rank): one
  contiguous block per source inside each expert, as DeepEP's layout promises;
* combine returns every pair's expert output unsummed (a ``top_k=1`` combine adds nothing),
  and the source applies the caller's ``topk_weights``, summing in float32 and rounding
  once, DeepEP's numerics.

The steps around a2ad's kernels (the pairs' rows and routing before dispatch, the
expert-major arrangement after it, the outputs back in slot order and the weighted sum in
combine) are torch ops on the tensors' device (CPU on the host backend, CUDA on the CUDA
backend) with no host synchronization on CUDA; a CUDA Buffer runs them as kernels of a2ad's
extension instead (``csrc/ll.cu`` around dispatch, and combine's low-latency pairs
instantiation, which stages through the arrangement's index and sums each token's weighted
pairs itself), with the same results, unless made with ``kernels=False`` (or
``A2AD_DEEP_EP_KERNELS=0``). The jobs are ordinary a2ad jobs (the same
daemon, rendezvous, checks, masks and degraded mode as ``MoeAlltoAll``): a small one made
by the constructor (its rendezvous is the collective, and its rounds are the barrier of
:meth:`Buffer.clean_low_latency_buffer`), and one per (num_max, hidden, num_experts, topk)
made at the first dispatch of that geometry (every rank makes it at the same call), a
second one when a dispatch comes while the first still has a round open (DeepEP's double
buffer: at most two LL rounds open at once).

``enable_shrink=True`` makes those jobs ``on_peer_loss="degrade"`` jobs: a rank that dies
is counted out by the daemon at once (its lease and pidfd), every survivor's
:meth:`Buffer.low_latency_query_mask_buffer` reports it masked (1), and the survivors'
rounds go on without it (its experts' contributions are absent from combine; nothing hangs).
Without it, a dead peer raises a2ad's typed :class:`~a2ad.errors.PeerLost`, as
``MoeAlltoAll`` does; no wait is unbounded (``timeout``, 60 s by default).
"""

from __future__ import annotations

import math
import secrets

import torch

from a2ad import errors, layout as L

__all__ = ["Buffer", "Config", "EventOverlap", "NotSupported", "topk_idx_t", "SUPPORTED_HIDDEN_SIZES"]

#: The dtype of ``topk_idx`` (DeepEP's ``topk_idx_t``; 64-bit as DeepEP's default build).
topk_idx_t = torch.int64

#: The hidden sizes DeepEP's LL kernels are compiled for. a2ad takes any hidden size
#: (FP8 needs a multiple of 128, UE8M0 scales a multiple of 512); see docs/DEEPEP.md.
SUPPORTED_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)

#: DeepEP's largest ``topk`` in LL mode.
MAX_TOPK = 11
#: Largest finite float8 e4m3fn value, and the floor of a block's amax (DeepEP's numerics).
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
#: a2ad's default bound on every wait for a peer (seconds); ``Buffer(timeout=...)``.
DEFAULT_TIMEOUT = 60.0
#: The combine arguments of DeepEP's single-batch-overlap branches (antgroup-opt, hybrid-ep),
#: refused unless None or False.
OVERLAP_ARGUMENTS = ("overlap", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms", "src_signals",
                     "src_signal_expect_value")
#: LL rounds that may be open at once (DeepEP's double buffer).
MAX_OPEN_ROUNDS = 2
#: The environment variable that turns the extension's kernels off (0, no, false) for CUDA
#: Buffers made without ``kernels=``; they run them by default.
KERNELS_ENV = "A2AD_DEEP_EP_KERNELS"
#: The most slots an ll_arrange block numbers and copies.
ARRANGE_MAX_SLOTS = 256


def _kernels_from_env() -> bool:
    import os

    return os.environ.get(KERNELS_ENV, "1").strip().lower() not in ("0", "no", "false")


class NotSupported(errors.InputError, NotImplementedError):
    """A DeepEP feature a2ad does not offer (the normal / high-throughput mode, NVFP4, LogFMT,
    the combine-overlap arguments). ``details['argument']`` names what was refused."""


_NORMAL_MODE = (
    "DeepEP's normal (high-throughput) mode is not offered by a2ad.deep_ep: construct the Buffer with "
    "low_latency_mode=True and use low_latency_dispatch / low_latency_combine, or use a2ad's token-major "
    "all-to-all, a2ad.client.MoeAlltoAll"
)


def _normal_mode(what: str) -> NotSupported:
    return NotSupported(f"{what}: {_NORMAL_MODE}", argument=what)


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
    from a2ad.client.frontend import int_arg

    return int_arg(name, value, lo, hi)


def _bool(name: str, value) -> bool:
    if value is not True and value is not False:
        raise errors.InputError(f"{name} must be a bool, got {type(value).__name__}", argument=name)
    return value


def _finish_mode(async_finish, return_recv_hook) -> tuple[bool, bool]:
    """A dispatch's or combine's ``async_finish`` and ``return_recv_hook``: bools, not both."""
    async_finish = _bool("async_finish", async_finish)
    return_recv_hook = _bool("return_recv_hook", return_recv_hook)
    if async_finish and return_recv_hook:
        raise errors.InputError("async_finish and return_recv_hook cannot both be True (as in DeepEP)",
                                argument="return_recv_hook")
    return async_finish, return_recv_hook


# ---------------------------------------------------------------------------
# Config, EventOverlap
# ---------------------------------------------------------------------------
class Config:
    """DeepEP's normal-mode tuning record. It can be made (engines build some at import);
    asking it for buffer sizes, or passing it to the normal mode, is refused."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise _normal_mode("Config.get_nvl_buffer_size_hint")

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise _normal_mode("Config.get_rdma_buffer_size_hint")

    def __repr__(self) -> str:
        return f"Config(num_sms={self.num_sms})"


class EventOverlap:
    """DeepEP's event handle: ``current_stream_wait()`` makes the current CUDA stream wait for
    the recorded event; as a context manager it does so on exit. a2ad's LL calls run on the
    caller's current stream, so the event is already ordered before later work there; on the
    CPU there is no event and both are no-ops."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


def _event_on(device: torch.device) -> EventOverlap:
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return EventOverlap(ev)
    return EventOverlap(None)


class _Handle(tuple):
    """DeepEP's handle ``(src_info, layout_range, num_max, hidden, num_experts)``, which also
    carries the a2ad round it belongs to (not part of the tuple)."""

    round = None


class _Comm:
    """A torch.distributed group (gloo works) as the collective the constructor needs."""

    def __init__(self, group):
        import torch.distributed as dist

        self._dist = dist
        self._group = group

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self._dist.get_rank(self._group)

    def Get_size(self) -> int:  # noqa: N802
        return self._dist.get_world_size(self._group)

    def bcast(self, data, root: int = 0):
        box = [data]
        src = self._dist.get_global_rank(self._group, root) if self._group is not None else root
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def allgather(self, data):
        out = [None] * self.Get_size()
        self._dist.all_gather_object(out, data, group=self._group)
        return out


class _Mapping:
    def __init__(self, rank: int, size: int):
        self.moe_ep_rank = rank
        self.moe_ep_size = size


# ---------------------------------------------------------------------------
# FP8 (DeepEP's per-token, per-128-channel e4m3 with float32 scales)
# ---------------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] (H % 128 == 0) as (float8_e4m3fn [T, H], float32 scales [T, H / 128]): each
    block of 128 channels gets ``scale = max(amax, 1e-4) / 448`` (with ``round_scale`` rounded up
    to a power of two), and ``fp8 * scale`` dequantizes."""
    t, h = x.shape
    xf = x.float().view(t, h // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(dim=2).clamp_min(FP8_AMAX_FLOOR)
    scale = amax / FP8_MAX
    if round_scale:  # the next power of two, exactly: scale = m * 2^e with m in [0.5, 1)
        m, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - (m == 0.5).to(e.dtype))
    q = (xf * (1.0 / scale).unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, h), scale


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales ``[..., S]`` (S % 4 == 0) as int32 ``[..., S / 4]``: the
    exponent byte of scale i in byte i % 4 (least significant first) of int i / 4."""
    exp = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    return exp.to(torch.uint8).contiguous().view(torch.int32)


# ---------------------------------------------------------------------------
# One LL round (what its handle carries to combine)
# ---------------------------------------------------------------------------
class _Round:
    __slots__ = ("geo", "slot", "num_tokens", "topk", "dest", "received", "pending", "done", "device")

    def __init__(self, geo, slot, num_tokens, topk, device):
        self.geo = geo
        self.slot = slot
        self.num_tokens = num_tokens
        self.topk = topk
        self.dest = None  # [R * rt] int64: each received slot's row in recv_x (flattened)
        self.received = None
        self.pending = None  # the receive half, until it ran
        self.done = False
        self.device = device


class _Geometry:
    """The a2ad jobs of one (num_max, hidden, num_experts, topk): up to MAX_OPEN_ROUNDS, each
    with one round open at a time, and the zero-copy combine buffers. ``kernels``: its rounds
    run the extension's kernels (``counts``: each slot's RECV_COUNTERS, which they read)."""

    def __init__(self, num_max, hidden, num_experts, topk, kernels=False):
        self.num_max = num_max
        self.hidden = hidden
        self.num_experts = num_experts
        self.topk = topk
        self.rt = num_max * topk
        self.slots: list = []  # MoeAlltoAll per slot
        self.open: list = []  # the _Round open on each slot, or None
        self.combine_buffers: list = []
        self.next_combine = 0
        self.kernels = kernels
        self.counts: list = []
        self.arrange_slots = 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned, as the extension's kernels read it (a copy only
    when it is not)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _early(a2a) -> bool:
    """Whether the kernel after ``a2a``'s dispatch (which waits for the peers) may be scheduled
    while that one still runs: not where the ranks share this GPU (their planes split its SMs,
    ``sm_budget``), since its waiting blocks could take the room the peers' kernels need to
    finish what that one waits for."""
    plane = getattr(a2a, "_plane", None)
    return not getattr(plane, "sm_budget", 0)


def _workspace_bytes(ep: int, rt: int, hidden: int) -> int:
    """A row that holds both the bf16 and the FP8 dispatch of ``rt`` pairs per peer (the rows,
    the scales, two int32 of metadata), each region 128-byte aligned, and a bf16 combine."""
    per_peer = ep * rt
    bf16 = L.pad_up(per_peer * 2 * hidden) + L.pad_up(per_peer * 8)
    fp8 = L.pad_up(per_peer * hidden) + L.pad_up(per_peer * 4 * max(1, hidden // FP8_BLOCK)) + L.pad_up(per_peer * 8)
    return (L.pad_up(L.aux_data_size(ep, rt)) + max(bf16, fp8) + L.pad_up(per_peer * 2 * hidden)
            + L.ALIGN_SLACK)


# ---------------------------------------------------------------------------
# Buffer
# ---------------------------------------------------------------------------
class Buffer:
    """DeepEP's ``Buffer`` in low-latency mode, on a2ad jobs (see the module doc).

    DeepEP's arguments are all accepted with their names and defaults. ``group`` (a
    ``torch.distributed`` ProcessGroup; gloo works) or ``comm`` (an mpi4py communicator) is
    used once, to agree on the jobs' name; the expert-parallel rank is the rank in it.
    ``num_nvl_bytes``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
    ``allow_mnnvl``, ``use_fabric``: no effect (the daemon allocates and maps the memory).
    ``num_rdma_bytes``: must be at least :meth:`get_low_latency_rdma_size_hint` of what is
    dispatched, as DeepEP asserts; a2ad sizes its jobs itself. ``low_latency_mode=False``
    constructs, but any dispatch then is refused (:class:`NotSupported`).

    a2ad's own, keyword-only: ``job`` (a name every rank passes alike, instead of agreeing
    through ``group``/``comm``), ``runtime_dir`` (the daemon's), ``timeout`` (seconds, bound
    of the rendezvous and of every wait on a peer), ``device`` (cuda backend: this rank's
    GPU, default the current one), ``kernels`` (cuda backend: the steps around a2ad's
    dispatch and combine as the extension's kernels instead of torch ops; default: on, unless
    the ``A2AD_DEEP_EP_KERNELS`` environment variable is 0; True on the host backend is
    refused).
    """

    #: SMs DeepEP's kernels use (its class attribute; a2ad's kernels size themselves).
    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, job: str | None = None, runtime_dir=None,
                 timeout: float = DEFAULT_TIMEOUT, device=None, kernels: bool | None = None):
        self._destroyed = True  # until constructed
        self._ctl = None
        self._ext = None
        explicit_kernels = kernels is not None
        kernels = _bool("kernels", kernels) if explicit_kernels else _kernels_from_env()
        self._geos: dict = {}
        self.num_nvl_bytes = _int("num_nvl_bytes", num_nvl_bytes, 0)
        self.num_rdma_bytes = _int("num_rdma_bytes", num_rdma_bytes, 0)
        self.low_latency_mode = _bool("low_latency_mode", low_latency_mode)
        self.num_qps_per_rank = _int("num_qps_per_rank", num_qps_per_rank, 0)
        self.allow_nvlink_for_low_latency_mode = _bool("allow_nvlink_for_low_latency_mode",
                                                       allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = _bool("allow_mnnvl", allow_mnnvl)
        self.use_fabric = _bool("use_fabric", use_fabric)
        self.explicitly_destroy = _bool("explicitly_destroy", explicitly_destroy)
        self.enable_shrink = _bool("enable_shrink", enable_shrink)
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise errors.InputError(f"timeout must be a positive number of seconds, got {timeout!r}",
                                    argument="timeout")
        if self.low_latency_mode and self.num_rdma_bytes % 128:
            raise errors.InputError(f"num_rdma_bytes must be a multiple of 128, got {self.num_rdma_bytes}",
                                    argument="num_rdma_bytes")
        self.timeout = float(timeout)
        self.group = group
        self.comm = comm
        if group is not None:
            c = _Comm(group)
        elif comm is not None:
            c = comm
        else:
            raise errors.InputError("Buffer needs group (a torch.distributed ProcessGroup) or comm (mpi4py)",
                                    argument="group")
        try:
            self.rank = int(c.Get_rank())
            self.group_size = int(c.Get_size())
        except Exception as exc:
            raise errors.InputError(f"cannot read the rank and size of the group: {exc}", argument="group") from None
        if not 0 <= self.rank < self.group_size <= L.MAX_EP_SIZE:
            raise errors.InputError(f"group of {self.group_size} ranks (rank {self.rank}): a2ad takes 1 to "
                                    f"{L.MAX_EP_SIZE}", argument="group")
        if job is None:
            if self.group_size == 1:
                job = f"dep-1-{secrets.token_hex(8)}"
            else:
                try:
                    job = c.bcast(f"dep-{self.group_size}-{secrets.token_hex(8)}" if self.rank == 0 else None, 0)
                except Exception as exc:
                    raise errors.InputError(f"agreeing on a job name through the group failed: {exc}; pass job=...",
                                            argument="group") from None
        if not isinstance(job, str) or not job or len(job) > 40:
            raise errors.InputError(f"job must be a name of 1 to 40 characters, got {job!r:.60}", argument="job")
        self.job = job
        self._runtime_dir = runtime_dir
        self._policy = "degrade" if self.enable_shrink else "raise"
        #: ranks this rank masked itself (low_latency_update_mask_buffer), and the same as a
        #: tensor on the device (1 = masked) for the sync-free query
        self._masked: set[int] = set()
        self._masked_dev = None
        self._status = None
        self._local_buffers: dict = {}
        # the constructor's job: its rendezvous is the collective DeepEP's constructor runs,
        # its control block reports lost ranks before any dispatch, its rounds are barriers
        from a2ad.client import MoeAlltoAll

        self._ctl = MoeAlltoAll(
            _Mapping(self.rank, self.group_size), 1, 1, self.group_size, hidden_size=16, job=f"{job}-ctl",
            runtime_dir=runtime_dir, device=device, timeout=self.timeout, on_peer_loss=self._policy,
            enable_rank_mask=self.enable_shrink)
        self.device = self._ctl.attachment.device
        self.backend = self._ctl.attachment.backend
        if self.enable_shrink:
            from a2ad.integrations._status import RankStatus

            # the constructor's job's control block as device tensors: a dead process is
            # counted out of every job it held at once, so this job's mask is the Buffer's
            self._status = RankStatus(self._ctl)
            self._masked_dev = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)
        if kernels and self.device.type != "cuda":
            if explicit_kernels:
                self._close()
                raise errors.InputError(f"kernels=True needs the cuda backend; this Buffer's jobs run on the "
                                        f"{self.backend} backend", argument="kernels")
            kernels = False
        if kernels:
            from a2ad.client import _ext

            self._ext = _ext.direct()
        #: whether the steps around a2ad's kernels run as the extension's kernels
        self.kernels = kernels
        self.runtime = _Runtime(self)
        self._destroyed = False

    # --- sizes --------------------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes DeepEP's LL layout takes for this geometry: two send and two receive buffers of
        ``num_experts * num_max`` messages of the larger of the dispatch message (16 bytes of
        header, then bf16 or FP8 with its scales) and the bf16 combine message, and two
        signalling areas of one int per expert, rounded up to 128 bytes. a2ad only checks
        ``num_rdma_bytes`` against it; the daemon sizes the jobs (docs/DEEPEP.md)."""
        num_max = _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        hidden = _int("hidden", hidden, 1)
        _int("num_ranks", num_ranks, 1, L.MAX_EP_SIZE)
        num_experts = _int("num_experts", num_experts, 1)
        dispatch_msg = 16 + max(2 * hidden, hidden + 4 * math.ceil(hidden / FP8_BLOCK))
        combine_msg = 16 + 2 * hidden
        per_buffer = num_experts * num_max * max(dispatch_msg, combine_msg)
        signalling = L.pad_up(4 * num_experts)
        return L.pad_up(2 * (2 * per_buffer + signalling))

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on the current CUDA stream (None event without CUDA)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            return EventOverlap(ev)
        return EventOverlap(None)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's normal-mode SM budget: kept as the class attribute, no other effect."""
        Buffer.num_sms = _int("new_num_sms", new_num_sms, 1)

    def get_comm_stream(self):
        """The stream the LL calls run on: the current CUDA stream (a2ad runs on the caller's
        stream), None on the host backend."""
        self._live()
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device)
        return None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's local buffer of ``num_rdma_bytes`` (``use_rdma_buffer``) or
        ``num_nvl_bytes`` bytes, as ``dtype`` from byte ``offset`` (``size``: a shape, else all
        of it). a2ad's data path does not use this buffer (its jobs' workspaces are the
        daemon's), so no memory of that size is held for it:

        - without ``size`` (the rest of the buffer, as vLLM's ``clean_buffers`` asks before
          zeroing it): a view whose elements all share one zeroed element (stride 0), so that
          ``zero_()`` / ``fill_()`` work and cost nothing, and an element-wise write is refused
          by torch ("more than one element ... refers to a single memory location");
        - with ``size``: private scratch of this rank, grown to ``offset`` + the view's bytes
          at the first call that needs it (views handed out before keep their memory)."""
        self._live()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        elem = torch.empty((), dtype=dtype).element_size()
        offset = _int("offset", offset, 0, total)
        if isinstance(size, int):
            size = (size,)
        count = (total - offset) // elem if size is None else math.prod(size)
        if offset + count * elem > total:
            raise errors.InputError(f"{count} elements of {dtype} from byte {offset} exceed the {total}-byte buffer",
                                    argument="size")
        if size is None:
            return torch.zeros(1, dtype=dtype, device=self.device).expand(count)
        end = offset + count * elem
        buf = self._local_buffers.get(use_rdma_buffer)
        if buf is None or buf.numel() < end:
            grown = torch.zeros(end, dtype=torch.uint8, device=self.device)
            if buf is not None:
                grown[: buf.numel()].copy_(buf)
            buf = self._local_buffers[use_rdma_buffer] = grown
        return buf[offset:end].view(dtype).view(*size)

    # --- normal mode (refused) ------------------------------------------------------------
    @staticmethod
    def get_dispatch_config(num_ranks: int):
        raise _normal_mode("get_dispatch_config")

    @staticmethod
    def get_combine_config(num_ranks: int):
        raise _normal_mode("get_combine_config")

    def get_dispatch_layout(self, *args, **kwargs):
        raise _normal_mode("get_dispatch_layout")

    def dispatch(self, *args, **kwargs):
        raise _normal_mode("dispatch")

    def combine(self, *args, **kwargs):
        raise _normal_mode("combine")

    def internode_dispatch(self, *args, **kwargs):
        raise _normal_mode("internode_dispatch")

    def internode_combine(self, *args, **kwargs):
        raise _normal_mode("internode_combine")

    # --- lifecycle ----------------------------------------------------------------------
    def _live(self) -> None:
        if self._destroyed:
            raise errors.StateError("this Buffer was destroyed")

    def destroy(self) -> None:
        """Leave every job (DeepEP: only with ``explicitly_destroy=True``, else StateError)."""
        if not self.explicitly_destroy:
            raise errors.StateError("destroy() needs the Buffer to be made with explicitly_destroy=True (as DeepEP "
                                    "asserts); without it the Buffer is released when it is garbage collected")
        self._close()

    def _close(self) -> None:
        if self._destroyed and self._ctl is None:
            return
        self._destroyed = True
        objs = [a for geo in self._geos.values() for a in geo.slots]
        if self._ctl is not None:
            objs.append(self._ctl)
        self._geos = {}
        if self._status is not None:
            self._status.close()  # before its job unmaps the control block
        self._ctl = None
        self._local_buffers = {}
        first = None
        for a in objs:
            try:
                a.close()
            except Exception as exc:  # close the rest first
                first = first or exc
        if first is not None:
            raise first

    def __del__(self):
        try:
            self._close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"a2ad.deep_ep.Buffer(job={self.job!r}, rank={self.rank}/{self.group_size}, "
                f"low_latency_mode={self.low_latency_mode}, enable_shrink={self.enable_shrink}, "
                f"{'destroyed' if self._destroyed else self.backend})")

    # --- masks ------------------------------------------------------------------------------
    def _need_shrink(self, what: str) -> None:
        self._live()
        if not self.enable_shrink:
            raise errors.StateError(f"{what} needs the Buffer to be made with enable_shrink=True")

    def _lost(self) -> set[int]:
        """Ranks the daemon counts out of this Buffer's jobs (degrade jobs only)."""
        lost = set()
        if self.enable_shrink:
            everyone = set(range(self.group_size))
            for a in [self._ctl, *(a for g in self._geos.values() for a in g.slots)]:
                lost |= everyone - set(a.active_ranks)
        return lost

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask rank ``rank_to_mask`` for this rank's next rounds:
        nothing is sent to or received from a masked rank. Every rank must mask the same ranks
        (a2ad's caller masks are per round); a rank cannot mask itself."""
        self._need_shrink("low_latency_update_mask_buffer")
        r = _int("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        if _bool("mask", mask):
            if r == self.rank:
                raise errors.InputError(f"rank {r} cannot mask itself", argument="rank_to_mask")
            self._masked.add(r)
        else:
            self._masked.discard(r)
        self._masked_dev.narrow(0, r, 1).fill_(int(mask))  # a fill kernel on the device, no copy or sync

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill int32 ``[group_size]`` ``mask_status`` in place: 1 for a masked rank (one this
        rank masked, or one the daemon counted lost), 0 for an active one. The daemon's view is
        read from the job's control block by a stream-ordered copy to the device: no host sync
        when ``mask_status`` is on the Buffer's device (it may sit in a CUDA graph, whose
        replays read the mask as it is then); a killed rank shows within milliseconds."""
        self._need_shrink("low_latency_query_mask_buffer")
        if (not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32
                or tuple(mask_status.shape) != (self.group_size,)):
            raise errors.InputError(f"mask_status must be an int32 tensor of shape [{self.group_size}]",
                                    argument="mask_status")
        mask_status.copy_(torch.maximum(self._status.masked(), self._masked_dev))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank this rank masked. Ranks the daemon counts lost stay masked until a
        replacement joins (then a2ad lets it back in at a round boundary)."""
        self._need_shrink("low_latency_clean_mask_buffer")
        self._masked.clear()
        self._masked_dev.zero_()

    def _caller_mask(self):
        if not self.enable_shrink:
            return None
        from a2ad.client import moe_a2a_active_rank_mask

        return moe_a2a_active_rank_mask([r for r in range(self.group_size) if r not in self._masked],
                                        self.group_size)

    # --- the barrier ------------------------------------------------------------------------
    def _barrier(self) -> None:
        """A round of the constructor's job (each rank sends one token to itself): returns once
        every active rank reached it."""
        a = self._ctl
        dev = self.device
        ids = torch.full((1, 1), self.rank, dtype=torch.int32, device=dev)
        mask = self._caller_mask()
        a.dispatch(ids, [ids], 1, active_rank_mask=mask)
        a.combine(torch.zeros(self.group_size, 1, 16, dtype=torch.bfloat16, device=dev), 1, active_rank_mask=mask)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP zeroes its signalling areas here; a2ad's are round-numbered and need no
        cleaning, so this only checks the arguments and runs a barrier among the active ranks
        (as DeepEP's does). Every rank must call it, with no LL round open."""
        self._live()
        _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _int("hidden", hidden, 1)
        self._check_experts_count(num_experts)
        if any(r is not None for g in self._geos.values() for r in g.open):
            raise errors.StateError("clean_low_latency_buffer called with a low-latency round open: combine it first")
        self._barrier()

    # --- dispatch ---------------------------------------------------------------------------
    def _check_experts_count(self, num_experts) -> int:
        e = _int("num_experts", num_experts, 1)
        if e % self.group_size:
            raise errors.InputError(f"num_experts ({e}) must be a multiple of the group size ({self.group_size})",
                                    argument="num_experts")
        return e

    def _geometry(self, num_max, hidden, num_experts, topk) -> _Geometry:
        key = (num_max, hidden, num_experts, topk)
        geo = self._geos.get(key)
        if geo is None:
            need = self.get_low_latency_rdma_size_hint(num_max, hidden, self.group_size, num_experts)
            if self.num_rdma_bytes < need:
                raise errors.InputError(
                    f"num_rdma_bytes ({self.num_rdma_bytes}) is less than get_low_latency_rdma_size_hint("
                    f"{num_max}, {hidden}, {self.group_size}, {num_experts}) = {need}, as DeepEP asserts",
                    argument="num_rdma_bytes")
            # the kernels take rows of whole 16-byte vectors and an arrangement whose counts fit
            # in shared memory; other geometries run the torch ops
            fits = (self.kernels and hidden % 8 == 0 and self.group_size * num_max * topk < 2 ** 31
                    and self._ext.ll_arrange_fits(num_experts // self.group_size, self.group_size, ARRANGE_MAX_SLOTS))
            geo = self._geos[key] = _Geometry(num_max, hidden, num_experts, topk, kernels=fits)
            if geo.kernels:
                from a2ad.client.cuda_plane import sm_count

                # ll_arrange's slots per block: a multiple of 32 making about two blocks per SM
                per = -(-self.group_size * geo.rt // (2 * sm_count(self.device)))
                geo.arrange_slots = min(ARRANGE_MAX_SLOTS, max(32, -(-per // 32) * 32))
        return geo

    def _prepare_geometry(self, num_max: int, hidden: int, num_experts: int, topk: int) -> None:
        """Make the jobs of a geometry's first low-latency round now, as its first dispatch
        would (a collective: every rank calls it, with no round of the geometry open). For a
        process whose ranks share one GPU: their planes' SM budgets can then be split before
        any round runs, where a first dispatch would run with the whole GPU on every rank."""
        self._live()
        geo = self._geometry(_int("num_max", num_max, 1), _int("hidden", hidden, 1),
                             self._check_experts_count(num_experts), _int("topk", topk, 1))
        if not geo.slots:
            self._slot(geo)

    def _slot(self, geo: _Geometry) -> int:
        for i, r in enumerate(geo.open):
            if r is None:
                return i
        if len(geo.slots) >= MAX_OPEN_ROUNDS:
            raise errors.StateError(
                f"{MAX_OPEN_ROUNDS} low-latency rounds of this geometry are open (dispatched, not combined): "
                "DeepEP's double buffer holds at most two; combine one first")
        from a2ad.client import MoeAlltoAll

        # a new job's rendezvous needs every rank: after a loss it could only time out
        self._ctl.check()  # raise jobs: PeerLost at once
        lost = self._lost()
        if lost:
            raise errors.StateError(
                f"rank(s) {sorted(lost)} of this Buffer were lost: a geometry first dispatched (or a second round of "
                "one opened) after a loss cannot be set up, since that needs every rank; dispatch each geometry "
                "once before (a warm-up round does)", lost_ranks=sorted(lost))
        i = len(geo.slots)
        name = f"{self.job}-{geo.num_max}x{geo.hidden}x{geo.num_experts}x{geo.topk}-{i}"
        # every rank makes it at the same call (the same sequence of LL calls on every rank)
        a = MoeAlltoAll(
            _Mapping(self.rank, self.group_size), geo.rt, 1, geo.num_experts,
            _workspace_bytes(self.group_size, geo.rt, geo.hidden), job=name, runtime_dir=self._runtime_dir,
            device=self.device if self.device.type == "cuda" else None, timeout=self.timeout, on_peer_loss=self._policy,
            enable_rank_mask=self.enable_shrink)
        geo.slots.append(a)
        geo.open.append(None)
        if geo.kernels:  # this rank's RECV_COUNTERS: how many slots each source filled this round
            from a2ad.client.moe_alltoall import RECV_COUNTERS_OFFSET_INDEX

            off = int(a.metainfo[RECV_COUNTERS_OFFSET_INDEX])
            geo.counts.append(a.workspace[self.rank, off:off + 4 * self.group_size].view(torch.int32))
        return i

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, use_nvfp4: bool = False, x_global_scale=None):
        """Send every token to the experts in ``topk_idx``; return what this rank's experts got.

        x: bf16 ``[T, hidden]``, ``T <= num_max_dispatch_tokens_per_rank``. topk_idx: int64
        (``topk_idx_t``; int32 taken) ``[T, topk]``, ``topk <= 11``, -1 for no expert; a token
        names an expert at most once. ``num_experts`` must be a multiple of the group size;
        rank r owns experts ``[r * L, (r + 1) * L)``, ``L = num_experts / group_size``.

        Returns ``(recv_x, recv_count, handle, event, hook)``: recv_x is bf16 ``[L, R * num_max,
        hidden]``, or with ``use_fp8`` ``(float8_e4m3fn [L, R * num_max, hidden], scales)`` with
        float32 scales ``[L, R * num_max, hidden / 128]`` (int32 ``hidden / 512`` packed UE8M0
        with ``use_ue8m0``), column-major in the last two dimensions; only rows
        ``[:recv_count[e]]`` of expert e are valid, one contiguous block per source rank (in
        ascending source order; inside a block the order is free). recv_count: int32 ``[L]``.
        handle: ``(src_info, layout_range, num_max, hidden, num_experts)`` for combine.
        event: an EventOverlap with ``async_finish``, else None. hook: with
        ``return_recv_hook`` a callable that runs the receive half (arranging the rows;
        recv_x, recv_count and handle are valid after it), else None.
        ``cumulative_local_expert_recv_stats`` (int32 ``[L]``) gets recv_count added.
        ``dispatch_wait_recv_cost_stats`` (int64 ``[R]``) is checked and left unchanged.
        """
        self._live()
        if use_nvfp4 is not False or x_global_scale is not None:
            arg = "use_nvfp4" if use_nvfp4 is not False else "x_global_scale"
            raise NotSupported(f"{arg}: NVFP4 dispatch (DeepEP's hybrid-ep branch) is not offered by a2ad.deep_ep; "
                               "use use_fp8=True or bf16", argument=arg)
        if not self.low_latency_mode:
            raise _normal_mode("low_latency_dispatch on a Buffer made with low_latency_mode=False")
        use_fp8 = _bool("use_fp8", use_fp8)
        round_scale = _bool("round_scale", round_scale)
        use_ue8m0 = _bool("use_ue8m0", use_ue8m0)
        async_finish, return_recv_hook = _finish_mode(async_finish, return_recv_hook)
        num_max = _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        num_experts = self._check_experts_count(num_experts)
        dev = self.device
        if not isinstance(x, torch.Tensor) or x.device != dev:
            raise errors.InputError(f"x must be a tensor on {dev}, got "
                                    f"{x.device if isinstance(x, torch.Tensor) else type(x).__name__}", argument="x")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] < 1:
            raise errors.InputError(f"x must be bfloat16 [num_tokens, hidden], got {list(x.shape)} {x.dtype}",
                                    argument="x")
        t, hidden = x.shape
        if t > num_max:
            raise errors.InputError(f"x has {t} tokens, more than num_max_dispatch_tokens_per_rank={num_max}",
                                    argument="x")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise errors.InputError("use_ue8m0=True needs use_fp8=True and round_scale=True (as in DeepEP)",
                                    argument="use_ue8m0")
        if use_fp8 and hidden % FP8_BLOCK:
            raise errors.InputError(f"use_fp8 needs hidden % {FP8_BLOCK} == 0, got hidden={hidden}", argument="x")
        if use_ue8m0 and hidden % (4 * FP8_BLOCK):
            raise errors.InputError(f"use_ue8m0 needs hidden % {4 * FP8_BLOCK} == 0, got hidden={hidden}",
                                    argument="x")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.device != dev:
            raise errors.InputError(f"topk_idx must be a tensor on {dev}", argument="topk_idx")
        if topk_idx.dtype not in (torch.int64, torch.int32) or topk_idx.dim() != 2 or topk_idx.shape[0] != t:
            raise errors.InputError(f"topk_idx must be {topk_idx_t} [num_tokens={t}, topk], got "
                                    f"{list(topk_idx.shape)} {topk_idx.dtype}", argument="topk_idx")
        topk = topk_idx.shape[1]
        if not 1 <= topk <= MAX_TOPK:
            raise errors.InputError(f"topk must be in [1, {MAX_TOPK}], got {topk}", argument="topk_idx")
        lx = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            s = cumulative_local_expert_recv_stats
            if (not isinstance(s, torch.Tensor) or s.device != dev or s.dtype != torch.int32
                    or tuple(s.shape) != (lx,)):
                raise errors.InputError(f"cumulative_local_expert_recv_stats must be int32 [{lx}] on {dev}",
                                        argument="cumulative_local_expert_recv_stats")
        if dispatch_wait_recv_cost_stats is not None:
            s = dispatch_wait_recv_cost_stats
            if (not isinstance(s, torch.Tensor) or s.device != dev or s.dtype != torch.int64
                    or tuple(s.shape) != (self.group_size,)):
                raise errors.InputError(f"dispatch_wait_recv_cost_stats must be int64 [{self.group_size}] on {dev}",
                                        argument="dispatch_wait_recv_cost_stats")
        idx = topk_idx.long()
        host_checks = dev.type == "cpu"
        if host_checks and t:
            bad = (idx < -1) | (idx >= num_experts)
            if bool(bad.any()):
                tok, k = (int(i) for i in bad.nonzero()[0])
                raise errors.InputError(f"topk_idx[{tok}, {k}] = {int(idx[tok, k])} is outside [-1, num_experts="
                                        f"{num_experts})", argument="topk_idx", token=tok, k=k)
            if topk > 1:
                srt = idx.sort(dim=1).values
                dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
                if bool(dup.any()):
                    tok = int(dup.any(1).nonzero()[0])
                    raise errors.InputError(f"token {tok} names an expert more than once in topk_idx: "
                                            f"{idx[tok].tolist()}", argument="topk_idx", token=tok)

        geo = self._geometry(num_max, hidden, num_experts, topk)
        slot = self._slot(geo)
        a2a = geo.slots[slot]
        # each (token, k) pair is one token of the top_k=1 job. bf16 on the kernels: a pair with
        # no expert (-1) sends nothing. Otherwise it goes to this rank's first expert, and its
        # metadata says it is empty.
        n = t * topk
        mask = self._caller_mask()
        if geo.kernels and not use_fp8:
            # one kernel: x's rows and each pair's metadata straight to the experts' owners
            received = a2a._dispatch_pairs(x.contiguous(), topk_idx.contiguous(), geo.rt, active_rank_mask=mask)
        elif geo.kernels:
            route, payloads = self._pack(x, topk_idx, n, hidden, lx, round_scale)
            received = a2a.dispatch(route, payloads, geo.rt, active_rank_mask=mask)  # (RECV_COUNTERS, no sanitize)
        else:
            flat = idx.reshape(n)
            valid = flat >= 0
            tok = torch.arange(n, device=dev, dtype=torch.int32) // topk
            route = torch.where(valid, flat, self.rank * lx).to(torch.int32).view(n, 1)
            meta = torch.stack([tok, torch.where(valid, flat, -1).to(torch.int32)], dim=1)
            if use_fp8:
                q, scales = quantize_fp8(x, round_scale)
                payloads = [q.index_select(0, tok), scales.index_select(0, tok), meta]
            else:
                payloads = [x.index_select(0, tok), meta]
            # slots no pair filled read as expert -1
            received = a2a.dispatch(route, payloads, geo.rt, -1, len(payloads) - 1, active_rank_mask=mask)
        rnd = _Round(geo, slot, t, topk, dev)
        geo.open[slot] = rnd

        r_total = self.group_size * num_max
        if use_fp8:
            data = torch.empty(lx, r_total, hidden, dtype=torch.float8_e4m3fn, device=dev)
            ns = hidden // FP8_BLOCK
            if use_ue8m0:
                sc = torch.empty(lx, ns // 4, r_total, dtype=torch.int32, device=dev).transpose(1, 2)
            else:
                sc = torch.empty(lx, ns, r_total, dtype=torch.float32, device=dev).transpose(1, 2)
            recv_x = (data, sc)
        else:
            data = torch.empty(lx, r_total, hidden, dtype=torch.bfloat16, device=dev)
            sc = None
            recv_x = data
        recv_count = torch.empty(lx, dtype=torch.int32, device=dev)
        src_info = torch.empty(lx, r_total, dtype=torch.int32, device=dev)
        layout_range = torch.empty(lx, self.group_size, dtype=torch.int64, device=dev)
        handle = _Handle((src_info, layout_range, num_max, hidden, num_experts))
        handle.round = rnd
        stats = cumulative_local_expert_recv_stats

        def receive() -> None:
            if rnd.pending is None:
                return
            rnd.pending = None
            if geo.kernels:
                self._arrange_kernel(rnd, received, data, sc, use_ue8m0, recv_count, src_info, layout_range, stats)
                return
            self._arrange(rnd, received, data, sc, use_ue8m0, recv_count, src_info, layout_range)
            if stats is not None:
                stats.add_(recv_count)

        rnd.pending = receive
        if return_recv_hook:
            return recv_x, recv_count, handle, None, receive
        receive()
        return recv_x, recv_count, handle, _event_on(dev) if async_finish else None, None

    def _pack(self, x, topk_idx, n, hidden, lx, round_scale):
        """An FP8 dispatch's pairs: their route and payloads by the extension's ll_pack (what the
        torch ops of low_latency_dispatch compute). A bf16 dispatch needs none: the dispatch
        kernel's pairs instantiation reads x and the ids as they are."""
        dev = self.device
        x = _aligned(x)
        topk_idx = topk_idx.contiguous()
        route = torch.empty(n, 1, dtype=torch.int32, device=dev)
        meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
        rows = torch.empty(n, hidden, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.empty(n, hidden // FP8_BLOCK, dtype=torch.float32, device=dev)
        if n:
            self._ext.ll_pack(x, topk_idx, route, meta, rows, scales, self.rank, lx, round_scale)
        return route, [rows, scales, meta]

    def _arrange_kernel(self, rnd: _Round, received, data, sc, ue8m0, recv_count, src_info, layout_range,
                        stats) -> None:
        """:meth:`_arrange` by the extension's ll_arrange, which reads the slots each source
        filled from RECV_COUNTERS (and adds recv_count to ``stats``)."""
        geo, ep = rnd.geo, self.group_size
        rnd.dest = torch.empty(ep * geo.rt, dtype=torch.int64, device=self.device)
        scales = received[1] if sc is not None else None
        self._ext.ll_arrange(received[-1], geo.counts[rnd.slot], received[0], scales, data, sc, recv_count, src_info,
                             layout_range, rnd.dest, stats, self.rank, geo.num_experts // ep, geo.num_max,
                             geo.arrange_slots, ue8m0, _early(geo.slots[rnd.slot]))

    def _arrange(self, rnd: _Round, received, data, sc, ue8m0, recv_count, src_info, layout_range) -> None:
        """The received pairs (``[R, rt]`` slots per source) expert-major: a stable sort by
        (local expert, source), then a gather of exactly the output's rows. Also records
        each slot's row for combine."""
        geo, dev, ep = rnd.geo, rnd.device, self.group_size
        lx = geo.num_experts // ep
        r_total = ep * geo.num_max
        meta = received[-1].reshape(ep * geo.rt, 2)
        expert = meta[:, 1].long() - self.rank * lx
        ok = (meta[:, 1] >= 0) & (expert >= 0) & (expert < lx)
        src = torch.arange(ep * geo.rt, device=dev) // geo.rt
        none = lx * ep
        key = torch.where(ok, expert * ep + src, none)
        counts = torch.zeros(none + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, key, torch.ones_like(key))
        per_block = counts[:none].view(lx, ep)  # [local expert, source]
        per_expert = per_block.sum(1)
        recv_count.copy_(per_expert.clamp(max=r_total))
        begin = per_block.cumsum(1) - per_block
        layout_range.copy_((begin << 32) | per_block)
        order = torch.argsort(key, stable=True)  # (expert, source, slot) order
        expert_start = per_expert.cumsum(0) - per_expert  # in the sorted order
        pos = torch.arange(r_total, device=dev)
        sorted_at = (expert_start.unsqueeze(1) + pos).clamp(max=order.numel() - 1)  # [lx, r_total]
        rows = order[sorted_at.view(-1)]  # the slot each output row comes from
        flat_tokens = received[0].reshape(ep * geo.rt, -1).view(torch.uint8)
        torch.index_select(flat_tokens, 0, rows, out=data.view(torch.uint8).view(lx * r_total, -1))
        if sc is not None:
            scales = received[1].reshape(ep * geo.rt, -1).index_select(0, rows).view(lx, r_total, -1)
            sc.copy_(pack_ue8m0(scales) if ue8m0 else scales)
        src_info.copy_(meta[:, 0].index_select(0, rows).view(lx, r_total))
        # every slot's row in recv_x (flattened), for combine; slots with no row point at row 0
        rank_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))
        e = expert.clamp(0, lx - 1)
        within = rank_of - expert_start[e]
        rnd.dest = torch.where(ok & (within < r_total), e * r_total + within, 0)

    # --- combine ------------------------------------------------------------------------------
    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The bf16 ``[L, R * num_max, hidden]`` buffer a ``zero_copy=True`` combine of ``handle``
        reads: write the expert outputs there instead of passing them."""
        self._live()
        rnd = self._round_of(handle)
        geo = rnd.geo
        while len(geo.combine_buffers) <= rnd.slot:
            geo.combine_buffers.append(None)
        buf = geo.combine_buffers[rnd.slot]
        if buf is None:
            lx = geo.num_experts // self.group_size
            buf = geo.combine_buffers[rnd.slot] = torch.empty(
                lx, self.group_size * geo.num_max, geo.hidden, dtype=torch.bfloat16, device=self.device)
        return buf

    def _round_of(self, handle) -> _Round:
        rnd = getattr(handle, "round", None)
        if not isinstance(handle, tuple) or len(handle) != 5 or not isinstance(rnd, _Round):
            raise errors.InputError("handle must be the handle low_latency_dispatch returned", argument="handle")
        if rnd.done or rnd.geo.open[rnd.slot] is not rnd or self._geos.get(
                (rnd.geo.num_max, rnd.geo.hidden, rnd.geo.num_experts, rnd.geo.topk)) is not rnd.geo:
            raise errors.StateError("this handle's round was already combined (or its Buffer destroyed)")
        return rnd

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, **overlap):
        """Return each token's weighted sum of its experts' outputs.

        x: bf16 ``[L, R * num_max, hidden]``, row i of expert e being the output for
        ``recv_x[e, i]`` (with ``zero_copy`` the data is taken from
        :meth:`get_next_low_latency_combine_buffer` instead). topk_idx / topk_weights: this
        rank's ``[T, topk]`` routing of the dispatch (float32 weights). The result, bf16 ``[T,
        hidden]``: ``sum over k with topk_idx >= 0 of w[t, k] * output``, summed in float32 and
        rounded once; an expert on a masked or lost rank contributes nothing. ``out``: written and
        returned. Returns ``(combined_x, event, hook)`` as dispatch does.
        """
        self._live()
        if overlap:
            unknown = sorted(set(overlap) - set(OVERLAP_ARGUMENTS))
            if unknown:
                raise TypeError(f"low_latency_combine() got an unexpected keyword argument {unknown[0]!r}")
            for name in OVERLAP_ARGUMENTS:  # given as None / False they ask for nothing
                if overlap.get(name) is not None and overlap.get(name) is not False:
                    raise NotSupported(f"{name}: DeepEP's single-batch-overlap combine arguments ("
                                       f"{', '.join(OVERLAP_ARGUMENTS)}) are not offered by a2ad.deep_ep",
                                       argument=name)
        if use_logfmt is not False:
            raise NotSupported("use_logfmt: the LogFMT combine format is not offered by a2ad.deep_ep (bf16 only)",
                               argument="use_logfmt")
        zero_copy = _bool("zero_copy", zero_copy)
        async_finish, return_recv_hook = _finish_mode(async_finish, return_recv_hook)
        rnd = self._round_of(handle)
        if rnd.pending is not None:  # the receive hook was not run: run it now
            rnd.pending()
        geo, dev, ep = rnd.geo, self.device, self.group_size
        lx = geo.num_experts // ep
        r_total = ep * geo.num_max
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        if not isinstance(x, torch.Tensor) or x.device != dev or x.dtype != torch.bfloat16 or \
                tuple(x.shape) != (lx, r_total, geo.hidden):
            raise errors.InputError(
                f"x must be bfloat16 [{lx}, {r_total}, {geo.hidden}] on {dev}, got "
                f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}", argument="x")
        t, topk = rnd.num_tokens, rnd.topk
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.device != dev or topk_idx.dtype not in
                (torch.int64, torch.int32) or tuple(topk_idx.shape) != (t, topk)):
            raise errors.InputError(f"topk_idx must be the dispatch's [{t}, {topk}] {topk_idx_t} on {dev}",
                                    argument="topk_idx")
        if (not isinstance(topk_weights, torch.Tensor) or topk_weights.device != dev
                or topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (t, topk)):
            raise errors.InputError(f"topk_weights must be float32 [{t}, {topk}] on {dev}", argument="topk_weights")
        if out is not None and (not isinstance(out, torch.Tensor) or out.device != dev or out.dtype != torch.bfloat16
                                or tuple(out.shape) != (t, geo.hidden) or not out.is_contiguous()):
            raise errors.InputError(f"out must be a contiguous bfloat16 [{t}, {geo.hidden}] tensor on {dev}",
                                    argument="out")
        if combine_wait_recv_cost_stats is not None:
            s = combine_wait_recv_cost_stats
            if not isinstance(s, torch.Tensor) or s.device != dev or s.dtype != torch.int64 or \
                    tuple(s.shape) != (ep,):
                raise errors.InputError(f"combine_wait_recv_cost_stats must be int64 [{ep}] on {dev}",
                                        argument="combine_wait_recv_cost_stats")
        a2a = geo.slots[rnd.slot]
        if geo.kernels:
            # one kernel: its staging reads each received slot's row from x through dest, and
            # each token's weighted sum of its pairs is pulled straight into the result
            rnd.done = True
            geo.open[rnd.slot] = None
            result = out if out is not None and out.data_ptr() % 16 == 0 else torch.empty(
                t, geo.hidden, dtype=torch.bfloat16, device=dev)
            a2a._combine_pairs(_aligned(x), geo.rt, rnd.dest, topk_idx.contiguous(), topk_weights.contiguous(), result,
                               active_rank_mask=self._caller_mask())
            if out is not None and result is not out:
                out.copy_(result)
                result = out

            def done() -> None:  # the result is complete on the stream already
                return None

            if return_recv_hook:
                return result, None, done
            return result, _event_on(dev) if async_finish else None, None
        # every received slot's output, in a2ad's combine region (no staging copy)
        region = a2a.get_combine_payload_tensor_in_workspace(geo.rt, geo.hidden, torch.bfloat16)
        torch.index_select(x.reshape(lx * r_total, geo.hidden), 0, rnd.dest, out=region.view(ep * geo.rt, geo.hidden))
        rnd.done = True
        geo.open[rnd.slot] = None
        pairs = a2a.combine(region, geo.rt, payload_in_workspace=True, active_rank_mask=self._caller_mask())
        result = out if out is not None else torch.empty(t, geo.hidden, dtype=torch.bfloat16, device=dev)

        def receive() -> None:
            if t == 0:
                return
            valid = (topk_idx >= 0).unsqueeze(2)
            rows = pairs.view(t, topk, geo.hidden).float() * topk_weights.unsqueeze(2)
            # where, not a product: a pair with no expert may hold anything (never summed)
            result.copy_(torch.where(valid, rows, 0.0).sum(1))

        if return_recv_hook:
            return result, None, receive
        receive()
        return result, _event_on(dev) if async_finish else None, None


class _Runtime:
    """What DeepEP's ``Buffer.runtime`` (its C++ runtime) answers that applies here: one node,
    no RDMA ranks."""

    def __init__(self, buf: Buffer):
        self._rank = buf.rank
        self._size = buf.group_size
        self._device = buf.device

    def is_available(self) -> bool:
        return True

    def get_num_rdma_ranks(self) -> int:
        return 1

    def get_rdma_rank(self) -> int:
        return 0

    def get_root_rdma_rank(self, global_: bool = False) -> int:
        return 0

    def get_local_device_id(self) -> int:
        return self._device.index if self._device.type == "cuda" and self._device.index is not None else 0

    def get_num_ranks(self) -> int:
        return self._size

    def get_rank(self) -> int:
        return self._rank

