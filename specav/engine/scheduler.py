"""Continuous batching: which requests run in the next step.

Owns: the waiting queue and the running set, admitting waiting requests up to the batch
limit between steps and retiring finished ones.

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

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
