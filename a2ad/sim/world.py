"""What every simulated world shares: the outcome of one seeded run, the violation of an
invariant, and the registry of worlds that ``python -m a2ad.sim`` runs.

A world is a function ``run(seed, mutation) -> Outcome``: it builds its actors from the seed
alone (``random.Random(seed)``, fake time, no threads, clock, sockets or files), runs one
schedule, checks its invariants after every step and returns what happened. The same seed and
mutation give the same outcome, trace included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Violation:
    invariant: str  # its name, e.g. "foreign_outputs"
    detail: str  # what broke it, naming actors and rounds
    time: float  # fake time of the step that broke it


@dataclass
class Outcome:
    world: str
    seed: int
    steps: int  # steps the scheduler ran
    faults: int  # faults injected
    violations: list[Violation] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)  # "time actor event" lines, in order


RunFn = Callable[[int, Optional[str]], Outcome]

#: name -> run(seed, mutation)
WORLDS: dict[str, RunFn] = {}
#: the worlds a run without ``--world`` goes round (the others run only when named)
DEFAULT: set[str] = set()


def register(name: str, default: bool = True) -> Callable[[RunFn], RunFn]:
    """Decorator: add ``run`` to :data:`WORLDS` under ``name`` (and, with ``default``, to the
    worlds a run without ``--world`` goes round)."""

    def deco(fn: RunFn) -> RunFn:
        if name in WORLDS and WORLDS[name] is not fn:
            raise ValueError(f"world {name!r} is already registered")
        WORLDS[name] = fn
        if default:
            DEFAULT.add(name)
        return fn

    return deco
