"""``python -m a2ad.sim``: run seeded schedules of the simulated worlds and check their invariants.

Seed k (of ``--start S`` .. S+N-1) runs one world chosen from k alone: round robin over the
sorted names of the worlds that apply (``--world``; else the world of ``--mutation``; else
every default world; ``wide``, the large domains, runs only when named), so ``--replay k`` with the same ``--world``/``--mutation`` runs exactly the same
schedule again and prints its whole trace. The last line is ``sim: N schedules, F faults, V
violations``; the exit status is 0 only with no violation.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from a2ad import mutations

from .world import DEFAULT, WORLDS, Outcome

#: world modules that register themselves on import
WORLD_MODULES = ("a2ad.sim.plane", "a2ad.sim.daemon")
TAIL = 40  # trace lines printed with a violation (all of them with -v)
DETAILED = 5  # violations printed in full; the others one line each


def load_worlds() -> None:
    for name in WORLD_MODULES:
        importlib.import_module(name)


def world_names(world: str | None, mutation: str | None) -> list[str]:
    if world is not None:
        if world not in WORLDS:
            raise SystemExit(f"unknown world {world!r} (known: {', '.join(sorted(WORLDS))})")
        return [world]
    if mutation is not None:
        m = mutations.REGISTRY.get(mutation)
        if m is None:
            raise SystemExit(f"unknown mutation {mutation!r} (--list-mutations lists them)")
        if m.world not in WORLDS:
            raise SystemExit(f"mutation {mutation!r} is caught by world {m.world!r}, which this tree lacks")
        return [m.world]
    return sorted(DEFAULT)


def world_for(seed: int, names: list[str]) -> str:
    return names[seed % len(names)]


def run_one(seed: int, names: list[str], mutation: str | None) -> Outcome:
    return WORLDS[world_for(seed, names)](seed, mutation)


def report(out: Outcome, verbose: bool, file=sys.stdout) -> None:
    for v in out.violations:
        print(f"VIOLATION seed {out.seed} world {out.world}: {v.invariant} at t={v.time:.3f}: {v.detail}", file=file)
    lines = out.trace if verbose else out.trace[-TAIL:]
    if not verbose and len(out.trace) > TAIL:
        print(f"  trace (last {TAIL} of {len(out.trace)} lines; -v or --replay {out.seed} for all):", file=file)
    else:
        print(f"  trace ({len(out.trace)} lines):", file=file)
    for line in lines:
        print("   ", line, file=file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m a2ad.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds to run (default 100)")
    ap.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--world", help="run only this world")
    ap.add_argument("--mutation", help="re-introduce this historical bug (see --list-mutations)")
    ap.add_argument("--list-mutations", action="store_true", help="list the mutations and exit")
    ap.add_argument("--replay", type=int, metavar="SEED", help="run this one seed and print its whole trace")
    ap.add_argument("-v", "--verbose", action="store_true", help="print whole traces")
    ap.add_argument("-x", "--exitfirst", action="store_true",
                    help="stop after the first schedule with a violation (how soon a mutation is caught)")
    args = ap.parse_args(argv)
    load_worlds()

    if args.list_mutations:
        for m in sorted(mutations.REGISTRY.values(), key=lambda m: (m.world, m.name)):
            where = "" if m.world in WORLDS else " (world not in this tree)"
            fixed = f" [fixed in {m.fixed_in}]" if m.fixed_in else ""
            print(f"{m.name:<28} {m.world:<8} {m.description}{fixed}{where}")
        return 0

    names = world_names(args.world, args.mutation)
    if args.replay is not None:
        out = run_one(args.replay, names, args.mutation)
        print(f"seed {out.seed} world {out.world}: {out.steps} steps, {out.faults} faults, "
              f"{len(out.violations)} violations")
        report(out, True)
        print(f"sim: 1 schedules, {out.faults} faults, {len(out.violations)} violations")
        return 0 if not out.violations else 1

    t0 = last = time.monotonic()
    faults = violations = 0
    first_caught: int | None = None
    shown = 0
    per_world: dict[str, int] = {}
    ran = 0
    for i in range(args.seeds):
        ran = i + 1
        seed = args.start + i
        out = run_one(seed, names, args.mutation)
        faults += out.faults
        per_world[out.world] = per_world.get(out.world, 0) + 1
        if out.violations:
            violations += len(out.violations)
            if first_caught is None:
                first_caught = i + 1
            if shown < DETAILED:
                report(out, args.verbose)
            else:
                v = out.violations[0]
                print(f"VIOLATION seed {out.seed} world {out.world}: {v.invariant} (--replay {out.seed})")
            shown += 1
            if args.exitfirst:
                break
        now = time.monotonic()
        if now - last >= 5.0:
            last = now
            print(f"sim: {i + 1}/{args.seeds} seeds, {now - t0:.1f} s, {violations} violations so far",
                  file=sys.stderr, flush=True)
    took = time.monotonic() - t0
    worlds = ", ".join(f"{w} {n}" for w, n in sorted(per_world.items()))
    print(f"sim: seeds {args.start}..{args.start + ran - 1} ({worlds}) in {took:.1f} s "
          f"({ran / took if took else 0:.0f} seeds/s)")
    if args.mutation is not None:
        if first_caught is None:
            print(f"mutation {args.mutation}: NOT caught in {ran} seeds")
        else:
            print(f"mutation {args.mutation}: first caught after {first_caught} seeds "
                  f"(seed {args.start + first_caught - 1})")
    print(f"sim: {ran} schedules, {faults} faults, {violations} violations")
    return 0 if violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
