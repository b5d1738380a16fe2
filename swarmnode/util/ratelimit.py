"""A token bucket per source, for the rate limits of untrusted callers (DHT strangers, dial-backs)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBuckets:
    """A token bucket per source (``rate_per_s`` refill, ``burst`` deep). Beyond ``max_sources`` the least
    recently seen source is forgotten: it starts again with a full bucket."""

    def __init__(
        self, rate_per_s: float, burst: int, max_sources: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate, self._burst, self._max_sources, self._clock = rate_per_s, burst, max_sources, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, when)

    def take(self, source: str) -> bool:
        """Spend one of ``source``'s tokens; False (nothing spent) when it has none left."""
        now = self._clock()
        tokens, then = self._buckets.pop(source, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - then) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self._max_sources:
            self._buckets.popitem(last=False)
        return allowed
