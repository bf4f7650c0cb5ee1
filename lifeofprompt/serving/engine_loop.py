"""The engine thread: ``engine.step()`` in a loop, each output routed to the HTTP request that owns it.

The thread does nothing but step while there is work, and hands each ``RequestOutput`` to the
asyncio queue of its HTTP request through ``loop.call_soon_threadsafe``. A request that failed
alone in a step (``RequestOutput.error``) gets its typed error in its queue; a step that raises
as a whole (a bug, a kernel failure) fails the requests in flight, and the thread goes on.

Shutdown (``begin_shutdown``, on SIGTERM): new requests are refused (``ShuttingDownError``, a
503), requests still queued are aborted at once, running ones get ``timeout`` seconds to finish
and are then aborted. An aborted request still reaches its client: a last output whose
finish_reason is "abort".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback

from ..engine.sampling_params import SamplingParams
from ..errors import RequestNotFoundError, ShuttingDownError
from .server_metrics import ServerStats

logger = logging.getLogger("lifeofprompt.server")


class EngineLoop:
    """Drives ``engine.step()`` in its own thread and routes each output to its waiting request.

    ``routes`` maps a request id to the asyncio loop and queue of the HTTP request that owns it.
    The route is registered *before* ``add_request``, so no output can arrive unclaimed; it is
    dropped when the request finishes or is aborted, so late outputs of an aborted request fall
    on the floor.
    """

    def __init__(self, engine, stats: ServerStats | None = None, idle_wait: float = 0.05):
        self.engine = engine
        self.stats = stats or ServerStats()
        self.idle_wait = idle_wait
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when work arrives, so an idle loop starts at once
        self.stopping = threading.Event()
        self.resumed = threading.Event()  # cleared by pause(): tests hold the engine still
        self.resumed.set()
        self.held = threading.Event()  # set while the thread sits paused
        self.thread: threading.Thread | None = None
        self.num_steps = 0
        self.last_error: str | None = None
        self.draining = False  # set by begin_shutdown: no new requests
        self.drain_deadline: float | None = None

    # -- lifecycle
    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.stopping.clear()
            self.thread = threading.Thread(target=self._run, name="lifeofprompt-engine", daemon=True)
            self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping.set()
        self.resumed.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout)
        self.thread = None

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def pause(self, timeout: float = 30.0) -> None:
        """Stop stepping after the current step and wait until the thread is held (requests still
        queue up in the engine's inbox): for tests of a full queue."""
        self.resumed.clear()
        self.wake.set()
        if self.alive and not self.held.wait(timeout):
            raise RuntimeError("the engine thread did not pause")

    def resume(self) -> None:
        self.resumed.set()
        self.wake.set()

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests, abort the queued ones now and the running ones after ``timeout`` s."""
        if not self.draining:
            logger.info("shutting down: queued requests aborted now, running ones in %.0f s at most", timeout)
            self.drain_deadline = time.monotonic() + timeout
            self.draining = True
        self.wake.set()

    @property
    def idle(self) -> bool:
        with self.lock:
            return not self.routes

    # -- called from the event loop
    def add(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        queue: asyncio.Queue,
        loop: asyncio.AbstractEventLoop,
        arrival_time: float | None = None,
    ) -> None:
        """Register the route, then hand the request to the engine (its typed errors propagate)."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down: send this request to another replica")
        with self.lock:
            self.routes[request_id] = (loop, queue)
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
        except BaseException:
            with self.lock:
                self.routes.pop(request_id, None)
            raise
        self.wake.set()

    def abort(self, request_id: str) -> None:
        """Forget the route and free the request's blocks; a request that already finished is fine."""
        with self.lock:
            known = self.routes.pop(request_id, None) is not None
        if known:
            try:
                self.engine.abort(request_id)
            except RequestNotFoundError:
                pass
            self.wake.set()

    # -- the thread
    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self.resumed.is_set():
                self.held.set()
                self.resumed.wait()
                self.held.clear()
            if self.stopping.is_set():
                break
            self.wake.clear()
            if self.draining:
                self._drain()
            if not self.engine.has_unfinished_requests():
                self.wake.wait(self.idle_wait)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not kill the server: fail the requests in flight
                self.last_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all(exc)
                continue
            self.num_steps += 1
            for output in outputs:
                self._deliver(output)

    def _drain(self) -> None:
        """Abort (keeping the routes, so each client gets its "abort" output) the queued requests,
        and every request once the deadline has passed."""
        if time.monotonic() >= self.drain_deadline:
            with self.lock:
                request_ids = list(self.routes)
        else:
            request_ids = self.engine.queued_request_ids()
        for request_id in request_ids:
            try:
                self.engine.abort(request_id)
            except RequestNotFoundError:
                pass

    def _deliver(self, output) -> None:
        with self.lock:
            route = self.routes.get(output.request_id)
            if route is not None and output.finished:
                del self.routes[output.request_id]
        if output.finished:
            self.stats.observe_finished(output)
        if route is None:
            return
        loop, queue = route
        try:  # a request that failed alone gets its typed error; everyone else's outputs go on
            loop.call_soon_threadsafe(queue.put_nowait, output if output.error is None else output.error)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def _fail_all(self, exc: Exception) -> None:
        with self.lock:
            routes, self.routes = self.routes, {}
        for request_id, (loop, queue) in routes.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                pass
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:
                pass
