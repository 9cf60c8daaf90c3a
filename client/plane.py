"""The data-plane interface that ``MoeAlltoAll`` drives: one implementation per backend
(``host_plane.HostPlane`` over shared host memory, ``cuda_plane.CudaPlane`` with CUDA
kernels). ``MoeAlltoAll`` checks the inputs it can check from shapes, dtypes and devices,
computes the payload layout (``a2ad.layout.payload_layout``) and calls a plane; the plane
moves the data (docs/PROTOCOL.md) and reports failures."""

from __future__ import annotations

import abc

import torch

from a2ad import layout as L


class Plane(abc.ABC):
    #: Whether expert ids are checked on the host before a dispatch (host plane: the ids
    #: are CPU tensors). Otherwise the kernels route a bad id nowhere and report it
    #: through :meth:`check_input`, so that no call has to read the ids back.
    checks_ids_on_host: bool = False
    #: Whether the plane honours the control block's active-rank mask (docs/PROTOCOL.md,
    #: "Degraded mode"): rounds among the effective mask, waits that end for a peer whose
    #: bit is cleared, a replacement let in by round, and the per-token indicator. A job
    #: created with ``on_peer_loss="degrade"`` is refused on a plane without it.
    supports_degraded_mode: bool = False

    @abc.abstractmethod
    def dispatch(self, experts: torch.Tensor, payloads: list[torch.Tensor], rt: int, pl: L.PayloadLayout,
                 num_experts: int, *, eplb_local_stats: torch.Tensor | None = None,
                 eplb_gathered: torch.Tensor | None = None, caller_mask: torch.Tensor | None = None) -> None:
        """Route and send this rank's tokens; complete once every peer's tokens are here.

        experts: ``[T, top_k]`` int32, contiguous. payloads: ``[T, ...]`` contiguous tensors,
        ``pl.dispatch_bytes_per_token[i]`` bytes per token. The received payload i is
        ``workspace[ep_rank]`` at ``pl.dispatch_offsets[i]``, ``[ep_size, rt, bytes_i]``.
        ``pl.spec`` (count, widths, dtypes, EPLB experts) is compared with every peer's: a
        difference is an InputError on every rank (host: raised here; CUDA: by
        :meth:`check_input` after the call), the round moving no data.
        eplb_local_stats: int32 ``[pl.eplb_stats_num_experts]`` on this rank's device, sent to
        every rank; eplb_gathered: int32 ``[ep_size, E]``, filled by the round (zeros for a
        rank outside it). caller_mask: int64 ``[n]`` mask words, ``ceil(ep_size / 64) <= n <=
        MASK_WORDS`` (rank r takes part this round: bit r & 63 of word r >> 6; words past n
        count as zero), on the device or the CPU, ANDed with the job's mask."""

    @abc.abstractmethod
    def sanitize(self, recv_ids: torch.Tensor, rt: int, invalid_id: int) -> None:
        """Set every id of every slot that received no token to ``invalid_id``
        (``recv_ids``: ``[ep_size, rt, top_k]`` int32 view of this rank's received ids)."""

    @abc.abstractmethod
    def combine(self, payload: torch.Tensor, local_num_tokens: int, rt: int, pl: L.PayloadLayout,
                payload_in_workspace: bool, *, output: torch.Tensor | None = None, low_precision: bool = False,
                caller_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sum every token's expert outputs from the ranks it was sent to; returns
        ``[local_num_tokens, hidden]`` of the payload's dtype (``output`` when given).
        low_precision: FP8 e4m3 rows with a power-of-two scale per FP8_BLOCK elements on the
        wire, float32 sums, bfloat16 out (docs/PROTOCOL.md); the FP8 region is at
        ``layout.fp8_combine_offset`` (below the combine region when the payload is in the
        workspace: a caller that keeps the next dispatch's regions below the combine
        region must keep them below that). caller_mask: as for dispatch (pass the same)."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise PeerLost / PeerTimeout / JobDestroyed if the job or this rank's last wait
        failed. Never synchronizes."""

    @abc.abstractmethod
    def check_input(self) -> None:
        """Raise InputError for input that was found wrong after the call that passed it
        returned (and forget it). Never synchronizes."""

    @abc.abstractmethod
    def reset_status(self) -> None:
        """Forget this rank's failure records (only once the job was re-armed)."""

    def degraded_tokens(self) -> torch.Tensor | None:
        """``[local_num_tokens]`` bool on this rank's device, of the last combine: True for a
        token that lost at least one expert's contribution (an expert on a rank outside the
        combine's view of the mask). None before the first combine, and on a plane without
        degraded mode (its rounds never lose a contribution: they raise instead)."""
        return None

    def round_mask(self) -> int | None:
        """The ranks (bit mask) whose contributions the last combine summed; None before the
        first combine, and on a plane without degraded mode."""
        return None

    def round_mask_tensor(self) -> torch.Tensor | None:
        """:meth:`round_mask` as int64 ``[MASK_WORDS]`` words on this rank's device (rank q: bit
        q & 63 of word q >> 6), written in the stream order of the combine (a model may use it without a sync); None as there."""
        return None

    def close(self) -> None:
        """Release what the plane holds (idempotent)."""
