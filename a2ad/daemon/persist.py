"""The daemon's state file (``<runtime dir>/state.msgpack``): what a restarted daemon
needs, besides the fds themselves (kept by an a2ad.daemon.fdstore), to re-adopt its jobs.

- ``save()`` writes completely or not at all: a temp file written in full (short writes
  looped over), fsynced, then renamed over the good file. On any error the temp file is
  removed, the previous file stays as it was, and OSError is raised.
- ``StateWriter`` is what the daemon's loop holds: ``mark_dirty()`` on every change,
  ``flush()`` each turn; a failing write is retried with backoff and logged once per
  distinct failure.
- The job's peer-loss policy travels in its spec (``on_peer_loss``; a record without it is a
  job of the default policy); its admit rounds live in the control block, which the fd store
  keeps with the workspaces, so a restarted daemon finds them as they were. The active-rank
  mask is recorded as the daemon decided it (``active_mask``; the control block holds only a
  published copy that the job's clients can write); a record without it takes that copy.
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
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgpack

from a2ad import layout as L
from a2ad.runtime import STATE_FILE

log = logging.getLogger("a2ad")

STATE_VERSION = 1
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
    return rec


def job_record(job) -> dict:
    rec = {
        "name": job.name,
        "ep_size": job.ep_size,
        "spec": job.spec,
        "size_per_rank": job.size_per_rank,
        "row_stride": job.row_stride,
        "generation": job.generation,
        "rearms": job.rearms,
        "rendezvous_count": job.rendezvous_count,
        "needs_rearm": job.needs_rearm,
        "active_mask": getattr(job, "active_mask", None),
        "created_wall": job.created_wall,
        "owner_uid": getattr(job, "owner_uid", None),
        "slots": [_slot_record(s) for s in job.slots],
    }
    if getattr(job, "domain", False):
        rec["domain"] = {"node": job.this_node, "confirmed": job.confirmed}
    return rec


def job_from_record(rec: dict, fds: dict[str, int], backend, this_node: str | None, used: set[str]):
    """The Job that ``rec`` (a ``job_record``, checked by ``check_job_record``) describes,
    holding the kept fds ``fds`` (fd-store name -> fd): its control block mapped, its rows
    adopted by ``backend``, another node's ranks as that node last reported them. This
    daemon's own ranks are left empty: what a recorded rank is now (its process may have died
    while no daemon ran) is the registry's to decide (``Registry.adopt``). The names of the
    fds it took are added to ``used``. ``this_node``: this daemon's node name in its domain
    (None without one). Raises on a record that cannot be adopted."""
    from a2ad import errors
    from a2ad.control import ControlBlock
    from a2ad.daemon import memfd
    from a2ad.daemon.fdstore import cb_name, ws_name
    from a2ad.daemon.jobs import Job, RankSlot

    name, ep_size = rec["name"], rec["ep_size"]
    cfd = fds.get(cb_name(name))
    if cfd is None:
        raise errors.BackendError("its control block was not kept")
    if not memfd.adopt_memfd(cfd, L.CONTROL_BLOCK_SIZE, "control block"):
        log.warning("job %s: its control block cannot be sealed (from an older daemon)", name)
    aux = L.aux_layout(ep_size, rec["spec"]["max_num_tokens"])
    control = ControlBlock.map_fd(cfd)
    job = Job(
        name=name, ep_size=ep_size, spec=rec["spec"], size_per_rank=rec["size_per_rank"],
        row_stride=rec["row_stride"], aux=aux, control_fd=cfd, control=control,
        slots=[RankSlot(rank=r) for r in range(ep_size)], owner_uid=rec.get("owner_uid"),
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
        job.active_mask = rec["active_mask"] & L.full_mask(ep_size)
    used.add(cb_name(name))
    try:
        for srec, slot in zip(rec["slots"], job.slots):
            if srec.get("node") is not None:  # another node's rank: what that node last reported
                slot.node, slot.pid, slot.device = srec["node"], srec["pid"], srec["device"]
                slot.deaths, slot.attaches = srec["deaths"], srec["attaches"]
                slot.remote = dict(srec.get("remote") or {})
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


# --------------------------------------------------------------------------- writing
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # a regular file never does this, but a loop must not spin on it
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def write_state(runtime_dir: Path, records: Iterable[dict], backend: str) -> None:
    """Write the state file from job records (``job_record`` dicts): all of it or nothing.
    Raises OSError on any failure, after removing the temp file; the previous state file is
    then untouched."""
    path = Path(runtime_dir) / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        data = msgpack.packb({"v": STATE_VERSION, "backend": backend, "jobs": list(records)}, use_bin_type=True)
    except Exception as exc:  # an unpackable record: a bug, but never a crash of the daemon
        raise OSError(errno.EINVAL, f"could not encode the state: {exc}") from exc
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

    def __init__(self, runtime_dir: Path, logger: logging.Logger | None = None):
        self.runtime_dir = Path(runtime_dir)
        self.log = logger or log
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
        if not self.dirty or (not force and now < self._next_attempt):
            return False
        try:
            write_state(self.runtime_dir, records_fn(), backend_name)
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
            return False
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
    if "needs_rearm" in rec and not isinstance(rec["needs_rearm"], bool):
        return f"bad needs_rearm {rec['needs_rearm']!r}"
    if rec.get("active_mask") is not None and not _is_int(rec["active_mask"]):
        return f"bad active_mask {rec['active_mask']!r}"
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
    elif obj.get("v") != STATE_VERSION:
        why = f"version {obj.get('v')!r}, expected {STATE_VERSION}"
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
