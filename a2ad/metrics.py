"""The daemon's metrics in Prometheus text exposition format."""

from __future__ import annotations

import time

from . import layout as L


def _line(out: list[str], name: str, value, labels: dict | None = None) -> None:
    lab = ""
    if labels:
        lab = "{" + ",".join(f'{k}="{str(v)}"' for k, v in labels.items()) + "}"
    out.append(f"{name}{lab} {value}")


def render(d) -> str:
    out: list[str] = []
    now = time.monotonic()
    out.append("# HELP a2ad_up 1 while the daemon serves.\n# TYPE a2ad_up gauge")
    _line(out, "a2ad_up", 1)
    out.append("# HELP a2ad_uptime_seconds Seconds since the daemon started.\n# TYPE a2ad_uptime_seconds gauge")
    _line(out, "a2ad_uptime_seconds", round(now - d.started, 3))
    out.append("# HELP a2ad_jobs Jobs the daemon holds.\n# TYPE a2ad_jobs gauge")
    _line(out, "a2ad_jobs", len(d.jobs))
    out.append("# HELP a2ad_ranks Ranks by state.\n# TYPE a2ad_ranks gauge")
    for state, name in L.RANK_STATE_NAMES.items():
        n = sum(1 for j in d.jobs.values() for s in j.slots if s.state == state)
        _line(out, "a2ad_ranks", n, {"state": name})
    out.append("# HELP a2ad_job_bytes Workspace bytes the daemon holds.\n# TYPE a2ad_job_bytes gauge")
    _line(out, "a2ad_job_bytes", sum(j.job_bytes for j in d.jobs.values()))
    for key, value in d.counters.items():
        out.append(f"# HELP a2ad_{key}_total Count of {key} since start.\n# TYPE a2ad_{key}_total counter")
        _line(out, f"a2ad_{key}_total", value)
    return "\n".join(out) + "\n"
