"""One background save in flight per rank: a daemon thread runs it, the training thread waits for it when it must.

``submit(fn)`` starts ``fn`` (write, hash, commit) on its own thread; ``wait()`` blocks until it is done and returns
the seconds waited, re-raising its error in the training thread; ``take_done()`` hands back the results of saves that
finished, without blocking. A daemon thread: a rank that fails exits without waiting for a write that rank 0 could
never commit (the staging dir it leaves is never read as a checkpoint).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class BackgroundSave:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.done: list[Any] = []  # results of finished saves, not yet taken

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, fn: Callable[[], Any], name: str = "swiftslurm-save") -> None:
        if self._thread is not None:
            raise RuntimeError("a background save is in flight: wait() for it first")

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as exc:  # handed to the training thread by wait()
                self._error = exc

        self._result, self._error = None, None
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the save in flight (if any) is done; its result goes to ``done``. Returns the seconds waited."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self.done.append(self._result)
        return time.perf_counter() - start

    def take_done(self) -> list[Any]:
        """The results of finished saves (a save that finished in the meantime is collected; none is waited for)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()
        done, self.done = self.done, []
        return done
