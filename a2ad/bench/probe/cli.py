"""Probe what the cuda backend relies on, on a real GPU machine, in one go.

    python -m a2ad.bench.probe
    python -m a2ad.bench.probe --json out.json

Prints the driver version and every visible GPU, tries POSIX-fd and fabric
export, measures the daemon's per-GPU context overhead (in fresh processes in
which torch never touches CUDA, as the daemon), does an export/import round
trip across two processes (the exporter exits before the importer maps), and,
with two or more GPUs, a cross-GPU round trip: one row on each GPU, one importer
per GPU, each writes into the *other* GPU's row through its own mapping (peer
access through cuMemSetAccess only), then each reads what the other wrote. Ends
with a PASS/FAIL summary; exit status 1 when a required check failed, and at
once, with the reason on one line, when CUDA is unavailable here (no
cuda-bindings, no driver, no visible GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

from a2ad import cuda_driver as cd

from .checks import (
    Checks,
    check_cross_gpu,
    check_exporter_exits,
    check_fabric,
    check_hidden_gpu,
    check_inventory,
    check_overhead,
)

PROG = "python -m a2ad.bench.probe"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write all measurements to this file")
    return ap


def unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, on one line; None when it can."""
    try:
        exc = cd.unavailable()
    except Exception as e:  # a driver failure that cuda_driver does not classify
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None if exc is None else " ".join(str(exc).split())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    c = Checks()
    why = unavailable_reason()
    if why is not None:
        print(f"{PROG}: cannot probe: {why}", file=sys.stderr, flush=True)
        c.rows.append(("FAIL", "inventory", why))
        c.data["cuda_bindings"] = cd.bindings_version()
        _write_json(c, args.json)
        return 1

    if not c.run("inventory", lambda: check_inventory(c)):
        return summary(c, args.json)
    n = len(c.data["devices"])
    for o in range(n):
        c.run(f"handle types on GPU {o}", lambda o=o: check_fabric(c, o))
    for o in range(n):
        c.run(f"daemon context overhead on GPU {o}", lambda o=o: check_overhead(c, o))
    c.run("exporter exits, importer maps (same GPU)", lambda: check_exporter_exits(c, 0, 0))
    if n >= 2:
        c.run("exporter on GPU 0 exits, importer on GPU 1", lambda: check_exporter_exits(c, 0, 1))
        c.run("cross-GPU peer writes (2 GPUs)", lambda: check_cross_gpu(c, [0, 1]))
        if n > 2:
            c.run(f"cross-GPU peer writes ({n} GPUs)", lambda: check_cross_gpu(c, list(range(n))))
        c.run(
            "importer with CUDA_VISIBLE_DEVICES hiding the memory's GPU",
            lambda: check_hidden_gpu(c, 0, 1),
            required=False,
        )
    else:
        c.run("cross-GPU peer writes, 2 importers on one GPU", lambda: check_cross_gpu(c, [0, 0]))
        print("\n(only one GPU: cross-GPU checks skipped)")
    return summary(c, args.json)


def _write_json(c: Checks, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"checks": c.rows, "data": c.data}, f, indent=2, default=str)


def summary(c: Checks, json_path: str | None = None) -> int:
    """Print every check's row (and write ``--json``); the exit status: 1 when a required check failed."""
    print("\n================ summary ================")
    for status, name, detail in c.rows:
        print(f"{status:4}  {name}: {detail}")
    if json_path:
        _write_json(c, json_path)
        print(f"measurements written to {json_path}")
    return 1 if c.failed else 0
