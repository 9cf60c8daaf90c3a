"""The daemon's state file (``<runtime dir>/state.msgpack``): what a restarted daemon
needs, besides the fds themselves (kept by an a2ad.daemon.fdstore), to re-adopt its jobs.
Written atomically (temp file + rename), mode 0600, on every change of a job."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack

from a2ad import layout as L
from a2ad.runtime import STATE_FILE

STATE_VERSION = 1


def job_record(job) -> dict:
    return {
        "name": job.name,
        "ep_size": job.ep_size,
        "spec": job.spec,
        "size_per_rank": job.size_per_rank,
        "row_stride": job.row_stride,
        "generation": job.generation,
        "rearms": job.rearms,
        "rendezvous_count": job.rendezvous_count,
        "needs_rearm": job.needs_rearm,
        "created_wall": job.created_wall,
        "slots": [
            {
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
            for s in job.slots
        ],
    }


def save(runtime_dir: Path, jobs: dict, backend: str) -> None:
    data = msgpack.packb(
        {"v": STATE_VERSION, "backend": backend, "jobs": [job_record(j) for j in jobs.values()]}, use_bin_type=True
    )
    path = runtime_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load(runtime_dir: Path) -> dict | None:
    path = runtime_dir / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    obj = msgpack.unpackb(raw, raw=False)
    if not isinstance(obj, dict) or obj.get("v") != STATE_VERSION:
        raise ValueError(f"{path} is not a version-{STATE_VERSION} a2ad state file")
    return obj


RANK_STATES = set(L.RANK_STATE_NAMES)
