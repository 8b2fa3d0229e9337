"""Leases on shared-memory regions: a region registered with a lease lapses
on the service unless renewed, so the regions of a client that goes away
without unregistering them (a crash, a kill) are forgotten. The client
renews its leased regions in the background, a third of the lease apart."""
from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable, List, Optional, Set

DEFAULT_LEASE_S = 30.0
_SHORTEST_S, _LONGEST_S = 0.1, 7 * 24 * 3600.0


def lease_ms(lease: Optional[float]) -> int:
    """The request's lease_ms for `lease` seconds (None or 0: no lease)."""
    if not lease:
        return 0
    if not _SHORTEST_S <= float(lease) <= _LONGEST_S:
        raise ValueError(f"shared_memory_lease: {lease} s; a lease is 0.1 s to 7 days, or None for none")
    return int(round(float(lease) * 1000))


class LeaseRenewer:
    """Renews the names it holds every `period` seconds on a daemon thread
    (started with the first name); `renew(names)` returns those that lapsed,
    which it drops. A failed renewal is tried again at the next period."""

    def __init__(self, renew: Callable[[List[str]], List[str]], period: float) -> None:
        self._renew, self._period = renew, period
        self._names: Set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def add(self, name: str) -> None:
        with self._lock:
            self._names.add(name)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="shardgemm-lease", daemon=True)
                self._thread.start()

    def discard(self, name: str) -> None:
        with self._lock:
            self._names.discard(name)

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self._names)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self._period + 15)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            names = self.names()
            if not names:
                continue
            try:
                lapsed = self._renew(names)
            except Exception:  # the service unreachable for now: the next period tries again
                continue
            with self._lock:
                self._names.difference_update(lapsed)


class AsyncLeaseRenewer:
    """LeaseRenewer for the asyncio client: a task of the running loop."""

    def __init__(self, renew: Callable[[List[str]], Awaitable[List[str]]], period: float) -> None:
        self._renew, self._period = renew, period
        self._names: Set[str] = set()
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    def add(self, name: str) -> None:
        self._names.add(name)
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, name: str) -> None:
        self._names.discard(name)

    def names(self) -> List[str]:
        return sorted(self._names)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            names = self.names()
            if not names:
                continue
            try:
                lapsed = await self._renew(names)
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            self._names.difference_update(lapsed)
