"""The engine's one background thread, and the asyncio side's handle on it.

Owns: stepping the engine in a thread of its own, so a step (hundreds of milliseconds of torch
work on the real pair) never blocks the event loop that accepts connections; handing requests
and aborts to that thread between steps (continuous batching: requests join and leave at step
boundaries); delivering each step's outputs to the waiting handler's asyncio queue; and
bounding how many requests may be live at once (running plus waiting), so an overload is
answered with 429 instead of an ever longer queue.

Threads. The event loop calls `submit`, `abort` and `release`; only the engine thread calls
into the engine. Outputs cross back with `loop.call_soon_threadsafe`. A step that raises
(a bug, not bad input) fails the requests of that batch with finish_reason "error" and the
loop goes on with the rest.

Must not know: HTTP, the OpenAI formats, tensors.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from specav.config import SamplingParams
from specav.request import StepOutput

log = logging.getLogger("specav.server")


class Overloaded(RuntimeError):
    """As many requests are live as the server allows; the caller should retry later."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused a request before running it (its message says why)."""

    request_id: str
    message: str


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineLoop:
    def __init__(self, engine, max_live: int, on_idle: Callable[[], None] | None = None) -> None:
        """max_live: requests that may be running or waiting at once (beyond it, `submit` raises
        Overloaded). on_idle: called on the engine thread after every step and when idle."""
        self.engine = engine
        self.max_live = max_live
        self.on_idle = on_idle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specav-engine", daemon=True)

    # ---- the event loop's side --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort every live request, finish the current step, and end the thread."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_live(self) -> int:
        """Requests submitted and not yet released by their handlers."""
        return len(self._streams)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request for the engine; its StepOutputs (or a Refused) arrive on the returned queue.
        Call on the event loop; raises Overloaded when max_live requests are live."""
        if len(self._streams) >= self.max_live:
            raise Overloaded(f"the server is at its limit of {self.max_live} live requests "
                             f"({self.engine.config.max_batch_size} running, the rest queued); retry later")
        if request_id in self._streams:
            raise ValueError(f"request {request_id}: a live request already has this id")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, list(prompt_ids), params))
        self._wake.set()
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Finish a request at the next step boundary and free its caches (a client that went away)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The handler is done with a request (finished, or aborted): it stops counting as live."""
        self._streams.pop(request_id, None)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if self.engine.has_work():
                self._step()
            else:
                self._notify_idle()
                self._wake.wait(0.5)
                self._wake.clear()
        self._drain_inbox()
        if self.engine.has_work():
            self._step()  # ends the requests stop() aborted, freeing their caches

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, request_id, prompt_ids, params = message
                try:
                    self.engine.add_request(prompt_ids, params, request_id=request_id)
                except ValueError as e:
                    self._deliver_to(request_id, Refused(request_id, str(e)))
            else:
                self.engine.abort(message[1])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug: fail this batch, keep serving the others
            log.exception("engine step failed")
            outputs = []
            for request in list(self.engine.scheduler.running):
                request.fail(f"request {request.request_id}: the engine step failed ({type(e).__name__}: {e})")
                self.engine.abort(request.request_id)  # retired, caches freed, at the next boundary
        for output in outputs:
            self._deliver_to(output.request_id, output)
        self._notify_idle()

    def _notify_idle(self) -> None:
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:
                log.exception("on_idle callback failed")

    def _deliver_to(self, request_id: str, item: StepOutput | Refused) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return  # the handler is gone (client disconnected): nothing to deliver to
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed (shutdown)


def is_final(item: StepOutput | Refused) -> bool:
    return isinstance(item, Refused) or item.finished

