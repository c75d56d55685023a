"""ComputeThread: one long-lived thread for all of an engine's torch work (loading, warm-up, every step).

torch's CPU ops run on GNU OpenMP, which gives every thread that starts parallel regions its own team of
workers. Once a process holds more OpenMP threads than CPUs, libgomp stops letting idle workers spin between
regions (its "throttled" spin count, which neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY raises), so each region
waits for a futex wake-up. A server that loaded its model on the main thread and stepped it on a second
thread would pay that wake-up in every one of a decode step's ~100 regions. Running the load and the steps
on one thread keeps one team.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    """A daemon thread that runs submitted callables one after another (a daemon, so a server that exits
    without stopping it is not held up by a running engine loop)."""

    def __init__(self, name: str = "mcp2026-engine-loop") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; its future holds the result or the exception it raised."""
        if self._stopped or not self._thread.is_alive():
            raise RuntimeError(f"compute thread {self._thread.name!r} has stopped")
        future: Future[T] = Future()
        self._tasks.put((functools.partial(fn, *args), future))
        return future

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this thread, waiting for it; its exception is raised here."""
        if threading.current_thread() is self._thread:
            return fn(*args)  # already on it: queueing would wait for ourselves
        return self.submit(fn, *args).result()

    def stop(self) -> None:
        """Let the thread end after the tasks queued so far; later submissions are refused."""
        self._stopped = True
        self._tasks.put(None)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it through the future
                future.set_exception(e)
            # while idle, hold nothing: the last task's closure or result can be a whole loaded model
            del task, fn, future
