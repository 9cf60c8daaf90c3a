"""The daemon's state file (``<runtime dir>/state.msgpack``): what a restarted daemon
needs, besides the fds themselves (kept by an a2ad.daemon.fdstore), to re-adopt its jobs.

- ``save()`` writes completely or not at all: a temp file written in full (short writes
  looped over), fsynced, then renamed over the good file. On any error the temp file is
  removed, the previous file stays as it was, and OSError is raised.
- ``StateWriter`` is what the daemon's loop holds: ``mark_dirty()`` on every change,
  ``flush()`` each turn; a failing write is retried with backoff and logged once per
  distinct failure.
- The disk-full path (``StateWriter(reserve=True)``, what the daemon uses): beside the state
  file the writer keeps ``state.msgpack.reserve``, space written in full while there is room
  (two copies' worth, at least 2 x the state). While the state file cannot be written, every
  change goes into that reserve in place, alternating between its two copies (header: magic,
  sequence number, length, CRC-32), which needs no new blocks on a non-copy-on-write
  filesystem (tmpfs, ext4, xfs), so a full disk cannot stop it and a kill -9 loses nothing.
  ``load()`` takes whichever of the file and the reserve's copies is newest (``seq``). When
  the state no longer fits one copy and the reserve cannot grow, ``refusal()`` says why a
  new job must be refused.
- The job's peer-loss policy travels in its spec (``on_peer_loss``; a record without it is a
  job of the default policy); its admit rounds live in the control block, which the fd store
  keeps with the workspaces, so a restarted daemon finds them as they were. The active-rank
  mask is recorded as the daemon decided it (``active_mask``, ``layout.mask_to_bytes`` bytes:
  msgpack carries at most 64-bit ints; the control block holds only a published copy that the
  job's clients can write); a record without it takes that copy.
- Versions: this daemon writes state version 2 and reads 1 and 2 (version 1, written for jobs
  of at most 64 ranks, holds the mask as an int). A job whose kept control block has another
  layout version than this daemon's (``layout.CONTROL_VERSION``; version 1 is the 64-rank
  block) is not adopted: the log names the job, its fd-store name and both versions, and its
  ranks, which still map the old block, find that no daemon holds it (JobDestroyed once
  they see the job orphaned) and must attach again. In an upgrade that makes the successor
  miss the job, so the upgrade is refused and the old daemon stays in charge.
- A job of a domain (one that may span nodes) records this node's name and whether the
  domain's decision on its spec had arrived (``domain``); a rank whose row another node
  holds is recorded as that node last reported it (``node``, ``remote``: its row's size and
  fabric handle), and a local row's fabric handle goes with it (``alloc.fabric``), so a
  restarted daemon serves remote ranks' handles at once and learns the rest from its peers.
- ``job_from_record()`` reads a record back into a Job (the registry's ``adopt`` then
  decides what each of this daemon's recorded ranks is now).
- ``load()`` never stops the daemon: a file that does not decode or has the wrong shape is
  moved aside (``state.msgpack.bad-<UTC time>``) and treated as absent; a file with some
  unusable job records is kept (a copy goes aside for inspection) and ``check_job_record``
  says which records to skip and why.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import msgpack

from a2ad import layout as L, mutations
from a2ad.runtime import STATE_FILE

log = logging.getLogger("a2ad")

STATE_VERSION = 2
#: State versions this daemon reads (1: the mask as an int, ep_size <= 64).
STATE_VERSIONS = (1, 2)
RANK_STATES = set(L.RANK_STATE_NAMES)
#: Bad state files kept aside at most (the oldest go first).
KEEP_BAD = 5
#: A job name as the protocol accepts it.
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def _slot_record(s) -> dict:
    rec = {
        "rank": s.rank,
        "state": s.state,
        "pid": s.pid,
        "uid": s.uid,
        "device": s.device,
        "lease": s.lease,
        "deaths": s.deaths,
        "attaches": s.attaches,
        "alloc": None if s.alloc is None else {"size": s.alloc.size, "handle_type": s.alloc.handle_type},
    }
    if s.alloc is not None and s.alloc.fabric_handle is not None:
        rec["alloc"]["fabric"] = s.alloc.fabric_handle
    if getattr(s, "node", None) is not None:
        remote = s.remote or {}
        rec["node"] = s.node
        rec["lease"] = None
        rec["remote"] = {k: remote.get(k) for k in ("size", "handle_type", "handle")}
        # counted dead because its node was lost: once that node says it is alive, the job
        # re-arms; a restart between the two must not make it a death for good
        if s.lost_with_node and not mutations.active("lost_mark_not_kept"):
            rec["lost_with_node"] = True
    return rec


def job_record(job) -> dict:
    rec = {
        "name": job.name,
        "ep_size": job.ep_size,
        "spec": job.spec,
        "size_per_rank": job.size_per_rank,
        "row_stride": job.row_stride,
        "lines_tail": getattr(job, "lines_tail", 0),
        "lines_checked": getattr(job, "lines_checked", False),
        "generation": job.generation,
        "rearms": job.rearms,
        "rendezvous_count": job.rendezvous_count,
        "needs_rearm": job.needs_rearm,
        "active_mask": None if getattr(job, "active_mask", None) is None else L.mask_to_bytes(job.active_mask),
        # (what the job's age says on the wall clock: informative, not read back)
        "created_wall": time.time() - max(0.0, time.monotonic() - job.created_at),
        "owner_uid": getattr(job, "owner_uid", None),
        "slots": [_slot_record(s) for s in job.slots],
    }
    if getattr(job, "domain", False):
        rec["domain"] = {"node": job.this_node, "confirmed": job.confirmed}
    return rec


def job_from_record(rec: dict, fds: dict[str, int], backend, this_node: str | None, used: set[str],
                    adopt_control, created_at: float = 0.0):
    """The Job that ``rec`` (a ``job_record``, checked by ``check_job_record``) describes,
    holding the kept fds ``fds`` (fd-store name -> fd): its control block mapped, its rows
    adopted by ``backend``, another node's ranks as that node last reported them. This
    daemon's own ranks are left empty: what a recorded rank is now (its process may have died
    while no daemon ran) is the registry's to decide (``Registry.adopt``). The names of the
    fds it took are added to ``used``. ``this_node``: this daemon's node name in its domain
    (None without one). Raises on a record that cannot be adopted."""
    from a2ad import errors
    from a2ad.daemon.core.jobs import Job, RankSlot
    from a2ad.daemon.core.names import cb_name, ws_name

    name, ep_size = rec["name"], rec["ep_size"]
    cfd = fds.get(cb_name(name))
    if cfd is None:
        raise errors.BackendError("its control block was not kept")
    aux = L.aux_layout(ep_size, rec["spec"]["max_num_tokens"])
    control = adopt_control(cfd, name)
    job = Job(
        name=name, ep_size=ep_size, spec=rec["spec"], size_per_rank=rec["size_per_rank"],
        row_stride=rec["row_stride"], aux=aux, control_fd=cfd, control=control, lines_tail=rec.get("lines_tail", 0),
        lines_checked=rec.get("lines_checked", False),
        slots=[RankSlot(rank=r) for r in range(ep_size)], owner_uid=rec.get("owner_uid"), created_at=created_at,
    )
    job.generation = rec["generation"]
    dom = rec.get("domain")
    if dom is not None:
        if this_node is None:
            log.warning("job %s spans a domain (node %s) but this daemon runs without --domain: its other nodes' "
                        "ranks cannot be reached", name, dom.get("node"))
        elif dom.get("node") != this_node:
            log.warning("job %s was held as node %s of its domain; this daemon is node %s", name, dom.get("node"),
                        this_node)
        job.domain = True
        job.this_node = this_node if this_node is not None else dom.get("node")
        job.confirmed = bool(dom.get("confirmed", True))
    job.rearms = rec.get("rearms", 0)
    job.rendezvous_count = rec.get("rendezvous_count", 0)
    job.needs_rearm = rec.get("needs_rearm", False)
    if rec.get("active_mask") is not None:
        job.active_mask = record_mask(rec["active_mask"]) & L.full_mask(ep_size)
    used.add(cb_name(name))
    try:
        for srec, slot in zip(rec["slots"], job.slots):
            if srec.get("node") is not None:  # another node's rank: what that node last reported
                slot.node, slot.pid, slot.device = srec["node"], srec["pid"], srec["device"]
                slot.deaths, slot.attaches = srec["deaths"], srec["attaches"]
                slot.remote = dict(srec.get("remote") or {})
                slot.lost_with_node = bool(srec.get("lost_with_node", False))
                job.set_rank_state(slot, srec["state"])
                continue
            slot.pid, slot.uid, slot.device = srec["pid"], srec["uid"], srec["device"]
            slot.lease, slot.deaths, slot.attaches = srec["lease"], srec["deaths"], srec["attaches"]
            if job.owner_uid is None and srec["uid"] is not None:
                job.owner_uid = srec["uid"]
            if srec["alloc"] is not None:
                fd = fds.get(ws_name(name, slot.rank))
                if fd is None:
                    raise errors.BackendError(f"rank {slot.rank}'s workspace was not kept")
                slot.alloc = backend.adopt(fd, srec["alloc"]["size"], srec["device"], srec["alloc"]["handle_type"],
                                           fabric=srec["alloc"].get("fabric"))
                used.add(ws_name(name, slot.rank))
    except BaseException:
        control.close()
        raise
    return job


def record_mask(v) -> int:
    """A record's ``active_mask``: bytes (state version 2) or an int (version 1)."""
    return L.mask_from_bytes(v) if isinstance(v, (bytes, bytearray)) else int(v)


def check_control_version(fd: int, job: str) -> None:
    """Raise BackendError naming the job, its kept control block and both layout versions when
    the block at ``fd`` was written by a daemon of another layout version (version 1: one mask
    word, ep_size <= 64, 4096 bytes). A block whose magic is wrong is left to the checks that
    follow (it is not a control block of any version)."""
    from a2ad import errors
    from a2ad.daemon.fdstore import cb_name

    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return  # too small for any version: adopt_memfd names the size
    magic, version = struct.unpack("<II", head)
    if magic == L.CONTROL_MAGIC and version != L.CONTROL_VERSION:
        raise errors.BackendError(
            f"its control block (kept as {cb_name(job)}, {os.fstat(fd).st_size} bytes) has layout version {version}; "
            f"this daemon reads version {L.CONTROL_VERSION} only (ep_size up to {L.MAX_EP_SIZE}), so the job is not "
            f"adopted: its ranks still map the old block and must attach again (a new job) once they see it "
            f"orphaned (a daemon of an a2ad release with control-block version {version} would adopt it)")


# --------------------------------------------------------------------------- writing
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # a regular file never does this, but a loop must not spin on it
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def encode_state(records: Iterable[dict], backend: str, seq: int | None = None) -> bytes:
    """The state file's bytes; OSError(EINVAL) for a record that cannot be encoded."""
    top = {"v": STATE_VERSION, "backend": backend, "jobs": list(records)}
    if seq is not None:
        top["seq"] = seq
    try:
        return msgpack.packb(top, use_bin_type=True)
    except Exception as exc:  # an unpackable record: a bug, but never a crash of the daemon
        raise OSError(errno.EINVAL, f"could not encode the state: {exc}") from exc


def write_state(runtime_dir: Path, records: Iterable[dict], backend: str, seq: int | None = None,
                data: bytes | None = None) -> int:
    """Write the state file from job records (``job_record`` dicts), or the bytes ``data``
    encode_state made: all of it or nothing. Returns its size. Raises OSError on any failure,
    after removing the temp file; the previous state file is then untouched."""
    path = Path(runtime_dir) / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    if data is None:
        data = encode_state(records, backend, seq)
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException as exc:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) or not isinstance(exc, Exception):
            raise
        raise OSError(errno.EIO, f"could not write {path}: {exc!r}") from exc
    _fsync_dir(path.parent)
    return len(data)


# --------------------------------------------------------------------------- the reserve
RESERVE_FILE = STATE_FILE + ".reserve"
#: magic, sequence number, length, CRC-32 of the state that follows (then padding)
_RES_HEAD = struct.Struct("<8sQQI4x")
_RES_MAGIC = b"A2ADRSV1"
#: Smallest copy the reserve holds (bytes); it grows to twice the state when that outgrows it.
MIN_RESERVE_COPY = 256 << 10
_PAGE = 4096


class Reserve:
    """``state.msgpack.reserve``: two copies' worth of space, allocated (written) while the
    disk has room, overwritten in place while the state file cannot be written."""

    def __init__(self, runtime_dir: Path):
        self.path = Path(runtime_dir) / RESERVE_FILE
        self.copy = 0  # bytes per copy in the file as it stands (0: none)
        self._next = 0
        try:
            st = os.stat(self.path, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_size and st.st_size % (2 * _PAGE) == 0:
                self.copy = st.st_size // 2
                # overwrite the older (or torn) copy first: the newest intact one stays (never
                # read through a link: nothing in the runtime folder is)
                with os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                    seqs = [_intact_seq(f, i * self.copy, self.copy) for i in range(2)]
                self._next = 0 if seqs[0] <= seqs[1] else 1
        except (OSError, struct.error):
            pass

    def ensure(self, need: int) -> bool:
        """Make each copy hold at least ``need`` bytes of state (growing to 2 x that, at
        least MIN_RESERVE_COPY); False when the space cannot be had now."""
        need += _RES_HEAD.size
        if self.copy >= need:
            return True
        copy = max(MIN_RESERVE_COPY, 2 * need)
        copy = -(-copy // _PAGE) * _PAGE
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            zeros = bytes(1 << 16)
            left = 2 * copy
            while left:
                n = os.write(fd, zeros[: min(left, len(zeros))])  # written, not sparse: no block is allocated later
                if n <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                left -= n
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, self.path)
        except OSError:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        _fsync_dir(self.path.parent)
        self.copy = copy
        self._next = 0
        return True

    def write(self, data: bytes, seq: int) -> None:
        """Overwrite the older copy with ``data`` (state bytes) in place; OSError when it
        does not fit or cannot be written."""
        if _RES_HEAD.size + len(data) > self.copy:
            raise OSError(errno.ENOSPC, f"the state ({len(data)} bytes) does not fit the reserve's copies "
                                        f"({self.copy} bytes each)")
        fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            blob = _RES_HEAD.pack(_RES_MAGIC, seq, len(data), zlib.crc32(data)) + data
            view, off = memoryview(blob), self._next * self.copy
            while view:
                n = os.pwrite(fd, view, off)
                if n <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                view, off = view[n:], off + n
            os.fsync(fd)
        finally:
            os.close(fd)
        self._next ^= 1

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.copy = 0


def _intact_seq(f, offset: int, copy: int) -> int:
    """The sequence number of the reserve's copy at ``offset`` when it is intact, else -1."""
    f.seek(offset)
    head = f.read(_RES_HEAD.size)
    if len(head) != _RES_HEAD.size:
        return -1
    magic, seq, length, crc = _RES_HEAD.unpack(head)
    if magic != _RES_MAGIC or length > copy - _RES_HEAD.size:
        return -1
    data = f.read(length)
    return seq if len(data) == length and zlib.crc32(data) == crc else -1


def load_reserve(runtime_dir: Path) -> dict | None:
    """The newest intact state copy in the reserve (with its ``seq``), or None."""
    path = Path(runtime_dir) / RESERVE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    best = None
    try:
        size = os.fstat(fd).st_size
        copy = size // 2
        for i in range(2 if copy > _RES_HEAD.size else 0):
            head = os.pread(fd, _RES_HEAD.size, i * copy)
            if len(head) != _RES_HEAD.size:
                continue
            magic, seq, length, crc = _RES_HEAD.unpack(head)
            if magic != _RES_MAGIC or length > copy - _RES_HEAD.size or (best is not None and seq <= best["seq"]):
                continue
            data = os.pread(fd, length, i * copy + _RES_HEAD.size)
            if len(data) != length or zlib.crc32(data) != crc:
                continue  # a copy whose write did not finish: the other one stands
            try:
                obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
            except Exception:
                continue
            if (isinstance(obj, dict) and obj.get("v") in STATE_VERSIONS and isinstance(obj.get("backend"), str)
                    and isinstance(obj.get("jobs"), list)):
                obj["seq"] = seq
                best = obj
    except OSError:
        return best
    finally:
        os.close(fd)
    return best


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: the file itself is already complete)."""
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def save(runtime_dir: Path, jobs: dict, backend: str) -> None:
    """Write the state of ``jobs`` (name -> Job) atomically; see write_state."""
    write_state(runtime_dir, [job_record(j) for j in jobs.values()], backend)


class StateWriter:
    """Keeps the state file in step with the daemon's jobs.

    Usage from the poll loop::

        writer = StateWriter(runtime_dir)
        writer.mark_dirty()                        # on every change of a job
        writer.flush(records_fn, backend_name, time.monotonic())   # every loop turn

    ``records_fn()`` returns the job records to write (``[job_record(j) for j in jobs]``);
    it is called only when a write happens. A failed write keeps the state dirty and is
    retried after a backoff (``BACKOFF`` seconds, doubling up to ``MAX_BACKOFF``); it is
    logged as an error once per distinct failure, and the first success after failures is
    logged at info. ``healthy`` and ``last_error`` are for status reports."""

    BACKOFF = 0.5
    MAX_BACKOFF = 10.0

    def __init__(self, runtime_dir: Path, logger: logging.Logger | None = None, reserve: bool = False):
        self.runtime_dir = Path(runtime_dir)
        self.log = logger or log
        #: the disk-full path: changes go into the reserve while the file cannot be written
        self.reserve = Reserve(self.runtime_dir) if reserve else None
        #: changes made durable nowhere yet (neither the file nor the reserve has them)
        self.pending = False
        #: whether the reserve holds changes the state file lacks (the file is failing)
        self.in_reserve = False
        self.reserve_error: str | None = None
        #: size of the state at the last attempt, for refusal()
        self.last_size = 0
        self.seq = 0
        self.dirty = False
        self.healthy = True
        self.last_error: str | None = None
        #: Failed attempts since the last successful write.
        self.failures = 0
        #: Successful writes in all.
        self.writes = 0
        self._next_attempt = 0.0
        self._backoff = self.BACKOFF
        self._logged: str | None = None

    def mark_dirty(self) -> None:
        self.dirty = True
        self.pending = True

    def _next_seq(self) -> int:
        self.seq = max(self.seq + 1, time.time_ns())
        return self.seq

    def refusal(self, extra: int = 0) -> str | None:
        """Why a new job (about ``extra`` more bytes of state) must be refused now, or None:
        the state file cannot be written and the reserve could not keep it either."""
        if self.healthy:
            return None
        why = f"the state file {self.runtime_dir / STATE_FILE} cannot be written ({self.last_error})"
        if self.reserve is None:
            return f"{why}; a new job could not be kept across a restart"
        if self.reserve_error is not None:
            return f"{why} and its reserve cannot be written either ({self.reserve_error})"
        if _RES_HEAD.size + self.last_size + extra > self.reserve.copy:
            return (f"{why} and its reserve has no room for another job ({self.reserve.copy} bytes per copy, "
                    f"{self.last_size} in use)")
        return None
    def due(self, now: float) -> bool:
        return self.dirty and now >= self._next_attempt

    @property
    def retry_in(self) -> float | None:
        """Seconds until the next attempt while failing (None when healthy)."""
        if self.healthy:
            return None
        return max(0.0, self._next_attempt - time.monotonic())

    def flush(self, records_fn: Callable[[], Iterable[dict]], backend_name: str, now: float, force: bool = False) -> bool:
        """Write the state file if it is dirty and a write is due (``force``: ignore the
        backoff, e.g. right before an upgrade or shutdown). ``now``: time.monotonic().
        Returns True when the file was written by this call. Never raises."""
        if not self.dirty:
            return False
        if not force and now < self._next_attempt:
            if self.pending and self.reserve is not None and not self.healthy:
                self._to_reserve(records_fn, backend_name)  # no backoff for the reserve: it has room
            return False
        data = None
        try:
            seq = self._next_seq()
            data = encode_state(records_fn(), backend_name, seq if self.reserve is not None else None)
            self.last_size = len(data)
            write_state(self.runtime_dir, (), backend_name, data=data)
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            self.failures += 1
            self.healthy = False
            self.last_error = reason
            delay = self._backoff
            self._next_attempt = now + delay
            self._backoff = min(self._backoff * 2, self.MAX_BACKOFF)
            if reason != self._logged:
                self.log.error(
                    "could not write the state file %s: %s (kept in memory; retrying in %.1f s, then less often)",
                    self.runtime_dir / STATE_FILE, reason, delay,
                )
                self._logged = reason
            else:
                self.log.debug("state file write failed again (%d in a row): %s", self.failures, reason)
            if self.reserve is not None and data is not None:
                self._to_reserve(None, backend_name, data, seq)
            return False
        if self.reserve is not None:
            self.pending = False
            self.in_reserve = False
            self.reserve_error = None
            if not self.reserve.ensure(len(data)):
                self.log.warning("could not make room for the state file's reserve %s (%d bytes); "
                                 "a full disk could then stop new jobs", self.reserve.path, 2 * len(data))
        if not self.healthy:
            self.log.info("state file written again after %d failed attempt(s)", self.failures)
        self.dirty = False
        self.healthy = True
        self.last_error = None
        self.failures = 0
        self.writes += 1
        self._logged = None
        self._backoff = self.BACKOFF
        self._next_attempt = 0.0
        return True

    def _to_reserve(self, records_fn, backend_name: str, data: bytes | None = None, seq: int | None = None) -> None:
        """While the state file fails: the state into the reserve, in place."""
        try:
            if data is None:
                seq = self._next_seq()
                data = encode_state(records_fn(), backend_name, seq)
                self.last_size = len(data)
            self.reserve.write(data, seq)
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            if reason != self.reserve_error:
                self.log.error("could not keep the state in the reserve %s either: %s; a daemon crash now would "
                               "lose the jobs changed since the last write, and new jobs are refused",
                               self.reserve.path, reason)
            self.reserve_error = reason
            return
        if not self.in_reserve or self.reserve_error is not None:
            self.log.warning("the state is kept in the reserve %s (seq %d) while the state file cannot be written",
                             self.reserve.path, seq)
        self.pending = False
        self.in_reserve = True
        self.reserve_error = None

    def remove(self) -> None:
        """Nothing is left to re-adopt: remove the state file and the reserve."""
        for name in (STATE_FILE, RESERVE_FILE):
            try:
                os.unlink(self.runtime_dir / name)
            except FileNotFoundError:
                pass
        if self.reserve is not None:
            self.reserve.copy = 0


# --------------------------------------------------------------------------- reading
def _is_int(v, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)


def _opt_int(v) -> bool:
    return v is None or _is_int(v)


def check_job_record(rec) -> str | None:
    """Why the job record ``rec`` (from a loaded state file) cannot be adopted, or None when
    it has every field ``job_record`` writes, with the right types."""
    if not isinstance(rec, dict):
        return f"the record is a {type(rec).__name__}, not a map"
    name = rec.get("name")
    if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
        return f"bad job name {name!r}"
    ep = rec.get("ep_size")
    if not _is_int(ep, 1, L.MAX_EP_SIZE):
        return f"bad ep_size {ep!r}"
    spec = rec.get("spec")
    if not isinstance(spec, dict):
        return "spec is missing or not a map"
    if not _is_int(spec.get("max_num_tokens"), 1):
        return f"bad spec.max_num_tokens {spec.get('max_num_tokens')!r}"
    if "on_peer_loss" in spec and spec["on_peer_loss"] not in L.POLICY_CODES:
        return f"bad spec.on_peer_loss {spec['on_peer_loss']!r:.40}"
    for key in ("size_per_rank", "row_stride", "generation"):
        if not _is_int(rec.get(key)):
            return f"bad {key} {rec.get(key)!r}" if key in rec else f"{key} is missing"
    for key in ("rearms", "rendezvous_count"):
        if key in rec and not _is_int(rec[key]):
            return f"bad {key} {rec[key]!r}"
    if rec.get("lines_tail", 0) != 0:
        try:
            ok = _is_int(rec["lines_tail"]) and rec["lines_tail"] == L.lines_tail_offset(rec["size_per_rank"],
                                                                                         rec["row_stride"])
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return f"bad lines_tail {rec['lines_tail']!r:.40} (rows of {rec['row_stride']} bytes past {rec['size_per_rank']})"
    if "lines_checked" in rec and not isinstance(rec["lines_checked"], bool):
        return f"bad lines_checked {rec['lines_checked']!r:.40}"
    if "needs_rearm" in rec and not isinstance(rec["needs_rearm"], bool):
        return f"bad needs_rearm {rec['needs_rearm']!r}"
    am = rec.get("active_mask")
    if am is not None and not (_is_int(am) or (isinstance(am, bytes) and 8 <= len(am) <= L.MASK_BYTES
                                                and len(am) % 8 == 0)):
        return f"bad active_mask {am!r:.80}"
    if "created_wall" in rec and not (
        isinstance(rec["created_wall"], (int, float)) and not isinstance(rec["created_wall"], bool) and math.isfinite(rec["created_wall"])
    ):
        return f"bad created_wall {rec['created_wall']!r}"
    if rec.get("owner_uid") is not None and not _is_int(rec["owner_uid"]):
        return f"bad owner_uid {rec['owner_uid']!r}"
    dom = rec.get("domain")
    if dom is not None and not (isinstance(dom, dict) and isinstance(dom.get("node"), str)
                                and isinstance(dom.get("confirmed", True), bool)):
        return f"bad domain {dom!r:.80}"
    slots = rec.get("slots")
    if not isinstance(slots, list) or len(slots) != ep:
        return f"slots must be a list of {ep} entries"
    for i, s in enumerate(slots):
        why = _check_slot(s, i)
        if why:
            return f"slot {i}: {why}"
    return None


def _check_slot(s, i: int) -> str | None:
    if not isinstance(s, dict):
        return "not a map"
    missing = [k for k in ("rank", "state", "pid", "uid", "device", "lease", "deaths", "attaches", "alloc") if k not in s]
    if missing:
        return f"missing {', '.join(missing)}"
    if s["rank"] != i or not _is_int(s["rank"]):
        return f"rank {s['rank']!r} out of place"
    if not _is_int(s["state"]) or s["state"] not in RANK_STATES:
        return f"bad state {s['state']!r}"
    if not _opt_int(s["pid"]) or not _opt_int(s["uid"]):
        return "bad pid or uid"
    if s["device"] is not None and not isinstance(s["device"], str):
        return f"bad device {s['device']!r}"
    if s["lease"] is not None and not isinstance(s["lease"], bytes):
        return "bad lease"
    if not _is_int(s["deaths"]) or not _is_int(s["attaches"]):
        return "bad deaths or attaches"
    alloc = s["alloc"]
    if alloc is not None:
        if not isinstance(alloc, dict) or not _is_int(alloc.get("size"), 1) or not isinstance(alloc.get("handle_type"), str):
            return "bad alloc"
        if alloc.get("fabric") is not None and not (isinstance(alloc["fabric"], bytes) and 1 <= len(alloc["fabric"]) <= 256):
            return "bad alloc fabric handle"
        if not isinstance(s["device"], str):
            return "a row with memory but no device"
    node = s.get("node")
    if node is not None:
        if not isinstance(node, str) or alloc is not None:
            return "bad node (a remote rank has no row here)"
        remote = s.get("remote")
        if not isinstance(remote, dict) or not (remote.get("size") is None or _is_int(remote["size"], 1)) or not (
                remote.get("handle") is None or isinstance(remote["handle"], bytes)):
            return "bad remote row"
        if not isinstance(s.get("lost_with_node", False), bool):
            return "bad lost_with_node"
    return None


def _aside_name(path: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    cand = path.with_name(f"{path.name}.bad-{stamp}")
    n = 1
    while cand.exists():
        cand = path.with_name(f"{path.name}.bad-{stamp}.{n}")
        n += 1
    return cand


def _prune_bad(path: Path) -> None:
    bad = sorted(path.parent.glob(f"{path.name}.bad-*"), key=lambda p: p.stat().st_mtime if p.exists() else 0)
    for old in bad[:-KEEP_BAD] if len(bad) > KEEP_BAD else []:
        try:
            old.unlink()
        except OSError:
            pass


def _move_aside(path: Path, why: str) -> Path | None:
    dest = _aside_name(path)
    try:
        os.rename(path, dest)
    except OSError as exc:
        log.warning("state file %s is unusable (%s) and could not be moved aside (%s); ignoring it", path, why, exc)
        return None
    log.warning("state file %s is unusable (%s): moved aside to %s; starting without it", path, why, dest.name)
    _prune_bad(path)
    return dest


def _copy_aside(path: Path, raw: bytes) -> Path | None:
    dest = _aside_name(path)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, raw)
        finally:
            os.close(fd)
    except OSError:
        try:
            dest.unlink()
        except OSError:
            pass
        return None
    _prune_bad(path)
    return dest


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, never through a symlink and only from a plain file (a FIFO or a
    device planted there would block or feed garbage)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a plain file")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def load(runtime_dir: Path) -> dict | None:
    """The previous daemon's state (see _load_file), or the reserve's copy when that is newer
    (a daemon that ran on a full disk kept its latest state there)."""
    main = _load_file(runtime_dir)
    spare = load_reserve(runtime_dir)
    if spare is None or (main is not None and _seq(main) >= spare["seq"]):
        return main
    log.warning("state: the copy in %s (seq %d) is newer than %s%s; using it", RESERVE_FILE, spare["seq"], STATE_FILE,
                "" if main is None else f" (seq {_seq(main)})")
    return spare


def _seq(obj: dict) -> int:
    seq = obj.get("seq")
    return seq if _is_int(seq) else 0


def _load_file(runtime_dir: Path) -> dict | None:
    """The previous daemon's state ``{"v", "backend", "jobs": [record, ...]}``, or None when
    there is none usable. Never raises for a bad file: one that does not decode, or whose
    top level has the wrong shape, is moved aside to ``state.msgpack.bad-<UTC time>`` with a
    warning (None is returned). Job records are not filtered: run ``check_job_record`` on
    each; when some are unusable a copy of the file is kept aside and a warning names them."""
    path = Path(runtime_dir) / STATE_FILE
    try:
        raw = _read_private(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _move_aside(path, f"unreadable: {exc}")
        return None
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types for garbage
        _move_aside(path, f"does not decode: {type(exc).__name__}: {exc}")
        return None
    why = None
    if not isinstance(obj, dict):
        why = f"top level is a {type(obj).__name__}, not a map"
    elif obj.get("v") not in STATE_VERSIONS:
        why = f"version {obj.get('v')!r}, this daemon reads {' or '.join(map(str, STATE_VERSIONS))}"
    elif not isinstance(obj.get("backend"), str):
        why = "no backend name"
    elif not isinstance(obj.get("jobs"), list):
        why = f"'jobs' is {type(obj.get('jobs')).__name__}, not a list"
    if why:
        _move_aside(path, why)
        return None
    bad = [(i, r) for i, r in enumerate(obj["jobs"]) for r in [check_job_record(r)] if r]
    if bad:
        dest = _copy_aside(path, raw)
        log.warning(
            "state file %s has %d unusable job record(s) of %d (%s)%s; the others can be adopted",
            path, len(bad), len(obj["jobs"]),
            "; ".join(f"record {i}: {r}" for i, r in bad[:5]) + (" ..." if len(bad) > 5 else ""),
            f"; a copy is kept as {dest.name}" if dest else "",
        )
    return obj
