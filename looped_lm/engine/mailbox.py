"""Handing outputs from the engine's thread to asyncio consumers."""

from __future__ import annotations

import asyncio
import threading


class Mailbox:
    """Outputs bound for one event loop. The engine thread drops them in; one callback per burst (a step's
    outputs) hands them to their queues, instead of one cross-thread wake-up per output."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    def put(self, queue: asyncio.Queue, out) -> None:
        with self.lock:
            self.items.append((queue, out))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, out in items:
            queue.put_nowait(out)
