"""Continuous batching: which requests run in the next step.

Owns: the waiting queue and the running set, admitting waiting requests up to the batch
limit between steps, retiring finished ones, and finding or removing a live request by id
(abort). Request ids are unique among live requests (the engine refuses a duplicate).

Must not know: models, drafting or verification.
"""

from __future__ import annotations

from collections import deque

from specav.request import Request


class Scheduler:
    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """The batch for the next step: running requests, topped up from the waiting queue."""
        while self.waiting and len(self.running) < self.max_batch_size:
            self.running.append(self.waiting.popleft())
        return list(self.running)

    def retire(self) -> list[Request]:
        """Remove and return the finished requests."""
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    def get(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, if any."""
        return next((r for r in (*self.running, *self.waiting) if r.request_id == request_id), None)

    def remove(self, request_id: str) -> Request | None:
        """Take a live request out of the queue or the running set; returns it (None if not live)."""
        request = self.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        return request

    @property
    def num_live(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
