"""One value shared by every poller of a route, taken at most once per `max_age_s`: what keeps many clients polling
back to back (dashboards, scrapers) from costing the engine and the event loop one computation, and one turn of the
loop, per poll."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedView(Generic[T]):
    """A poll gets the value being taken when it came, or a new one, taken at once if the last is `max_age_s` old
    and else when it will be. So every answer is taken after its poll arrived (or was being taken), and a client
    polling back to back gets one answer per `max_age_s`, costing the server next to nothing while it waits.
    `check` runs before every answer and may raise (an engine that failed gives no view, not even a cached one)."""

    def __init__(self, take: Callable[[], Awaitable[T]], max_age_s: float,
                 check: Callable[[], None] = lambda: None):
        self.max_age_s = max_age_s
        self.num_taken = 0
        self._take_value = take
        self._check = check
        self._value: T | None = None
        self._taken_at = -math.inf  # time.monotonic() of the last value
        self._taking: asyncio.Future | None = None

    async def value(self) -> T:
        """The shared value, as described above."""
        arrived_at = self._checked(time.monotonic())
        if self._taking is None and (wait_s := self._taken_at + self.max_age_s - arrived_at) > 0:
            await asyncio.sleep(wait_s)
            if self._taken_at >= arrived_at:  # another poller's, taken since this one came
                return self._checked(self._value)
        if self._taking is None:
            self._taking = asyncio.ensure_future(self._take())
        return self._checked(await asyncio.shield(self._taking))  # a poller that leaves cancels no one's view

    def _checked(self, value):
        self._check()
        return value

    async def _take(self) -> T:
        try:
            self._value = await self._take_value()
            self._taken_at = time.monotonic()
            self.num_taken += 1
            return self._value
        finally:
            self._taking = None
