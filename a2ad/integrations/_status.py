"""A job's rank mask and fault state as device tensors, read without a host sync.

The daemon publishes the job's active-rank mask, the abort word (with the rank whose loss
caused it) and every rank's status record in the job's control block, a page of shared
host memory that the cuda backend's plane registers for device access. :class:`RankStatus`
keeps CPU tensor views of the words it needs and turns them into device tensors with one
asynchronous copy each (``non_blocking`` from registered memory: stream-ordered, no sync,
capturable in a CUDA graph, where a replay reads the words as they are then); on the host
backend the device is the CPU and the views are read directly.

What it reports (the serving engines' conventions):

- :meth:`masked`: ``[ep_size]`` int32, 1 for a rank that does not serve: outside the
  active mask (``on_peer_loss="degrade"``: the daemon clears a lost rank's bit), or the
  rank named by the abort word (``"raise"``: the job was aborted for its loss).
- :meth:`fault`: a 0-d bool, True when :meth:`masked` differs from the baseline taken at
  the last :meth:`rebaseline`, the job is aborted, or this rank's last wait failed.
"""

from __future__ import annotations

import ctypes

import torch

from a2ad import layout as L

#: i32 words CB_MAGIC .. the end of the active mask: abort (4), abort rank (5), the mask's
#: MASK_WORDS u64 words as 2 * MASK_WORDS i32 words from 8 on (rank q: bit q & 31 of i32 word q >> 5)
_HDR_WORDS = (L.CB_ACTIVE_MASK + 8 * L.MASK_WORDS) >> 2
_ABORT = L.CB_ABORT >> 2
_ABORT_RANK = L.CB_ABORT_RANK >> 2
_MASK_LO = L.CB_ACTIVE_MASK >> 2


class RankStatus:
    """Device views of one attached rank's control block (see the module doc).

    ``alltoall``: an open :class:`a2ad.client.MoeAlltoAll`. The views die with it: call
    :meth:`close` before closing it (later calls then return the last baseline)."""

    def __init__(self, alltoall):
        att = alltoall.attachment
        self.ep_rank = int(att.ep_rank)
        self.ep_size = int(att.ep_size)
        self.device = att.workspace.device
        self.policy = att.spec.get("on_peer_loss", "raise")
        buf = (ctypes.c_char * L.CONTROL_BLOCK_SIZE).from_address(att.control.address())
        words = torch.frombuffer(buf, dtype=torch.int32)
        self._hdr = words[:_HDR_WORDS]
        st = (L.status_offset(self.ep_rank) + L.STATUS_CODE) >> 2
        self._status = words[st : st + 1]
        self._alltoall = alltoall
        self._ranks = torch.arange(self.ep_size, dtype=torch.int64, device=self.device)
        #: per rank, the i32 header word that holds its mask bit, and the bit's place in it
        self._mask_word = _MASK_LO + (self._ranks >> 5)
        self._mask_bit = self._ranks & 31
        self._baseline = torch.zeros(self.ep_size, dtype=torch.int32, device=self.device)
        self._last = self._baseline.clone()

    @property
    def closed(self) -> bool:
        return self._alltoall is None

    def _read(self, view: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return view.clone()
        return view.to(self.device, non_blocking=True)

    def _words(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(self._hdr), self._read(self._status)

    def _masked_from(self, hdr: torch.Tensor) -> torch.Tensor:
        words = hdr.to(torch.int64).index_select(0, self._mask_word) & 0xFFFFFFFF
        inactive = ((words >> self._mask_bit) & 1) == 0
        named = (hdr[_ABORT] != 0) & (self._ranks == hdr[_ABORT_RANK].to(torch.int64))
        return (inactive | named).to(torch.int32)

    def masked(self) -> torch.Tensor:
        """``[ep_size]`` int32 on the job's device, 1 = the rank does not serve (no sync)."""
        if self.closed:
            return self._last.clone()
        hdr, _ = self._words()
        self._last = self._masked_from(hdr)
        return self._last

    def active(self) -> torch.Tensor:
        """``[ep_size]`` int32, 1 = the rank serves (SGLang's ``active_ranks`` convention)."""
        return 1 - self.masked()

    def fault(self) -> torch.Tensor:
        """0-d bool on the job's device: a new fault since the last :meth:`rebaseline` (no sync)."""
        if self.closed:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        hdr, status = self._words()
        self._last = self._masked_from(hdr)
        return (self._last != self._baseline).any() | (hdr[_ABORT] != 0) | (status[0] != 0)

    def rebaseline(self) -> None:
        """Take the current mask as the baseline :meth:`fault` compares against."""
        if not self.closed:
            self._baseline.copy_(self.masked())

    def failed_on_host(self) -> bool:
        """Whether the job is aborted or this rank's last wait failed (a host read, no sync)."""
        return not self.closed and (int(self._hdr[_ABORT]) != 0 or int(self._status[0]) != 0)

    def close(self) -> None:
        """Drop the views (before the attachment unmaps the control block). Idempotent."""
        if self._alltoall is not None:
            self._last = self._last.clone()
            self._hdr = self._status = None
            self._alltoall = None
