"""A seeded, single-threaded scheduler with fake time: a heap of timed events, each a callable
run at its time (ties broken by the order they were scheduled), one ``random.Random(seed)``
for every choice, and a trace of short lines. Nothing reads a clock or starts a thread."""

from __future__ import annotations

import heapq
import random
from typing import Callable


class Scheduler:
    def __init__(self, seed: int, trace_limit: int = 200_000):
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.steps = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._trace: list[tuple[float, str, str]] = []
        self._trace_limit = trace_limit

    # --- events -------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at fake time ``when`` (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run(self, until: float, after_step: Callable[[], bool] | None = None) -> None:
        """Run events up to time ``until``; ``after_step()`` after each, returning False to stop."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn = heapq.heappop(heap)
            self.now = when
            self.steps += 1
            fn()
            if after_step is not None and not after_step():
                return
        self.now = max(self.now, until)

    # --- trace ----------------------------------------------------------------------
    def log(self, actor: str, event: str) -> None:
        if len(self._trace) < self._trace_limit:
            self._trace.append((self.now, actor, event))

    def trace_lines(self) -> list[str]:
        return [f"{t:9.3f} {a:<7} {e}" for t, a, e in self._trace]
