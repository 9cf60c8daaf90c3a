"""Log lines at a bounded rate: a flood of the same problem says so once in a while."""

from __future__ import annotations

import logging

log = logging.getLogger("a2ad")


class RateLog:
    """At most one line per key every ``every`` seconds; how many were suppressed is said."""

    #: keys remembered at most (a flood of connections from many addresses must not grow it)
    MAX_KEYS = 1024

    def __init__(self, clock, every: float = 10.0):
        #: what the time is (the caller's event clock: the core reads none of its own)
        self.clock = clock
        self.every = every
        self._last: dict = {}

    def __call__(self, level: int, key, msg: str, *args) -> None:
        now = self.clock()
        if key not in self._last and len(self._last) >= self.MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every}
            if len(self._last) >= self.MAX_KEYS:
                self._last.clear()
        last, skipped = self._last.get(key, (None, 0))
        if last is not None and now - last < self.every:
            self._last[key] = (last, skipped + 1)
            return
        self._last[key] = (now, 0)
        if skipped:
            msg += f" ({skipped} more like it since the last report)"
        log.log(level, msg, *args)
