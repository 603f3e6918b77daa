"""The notifiers' asyncio loop in a thread of its own: a slow receiver never touches the
request loop or the alert engine (``submit`` is thread-safe)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class NotifierThread:
    """The notifiers' asyncio loop in a thread of its own, so that a slow receiver
    never touches the request loop or the engine: ``submit`` is thread-safe."""

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainwarden-notify", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self.dispatcher.start())
            self._ready.set()
            loop.run_forever()
        finally:
            loop.close()

    def submit(self, note: Any) -> bool:
        """Queue ``note`` for its receivers (thread-safe, never blocks); False: dropped."""
        return bool(self.dispatcher.submit(note))

    def drain(self, timeout_s: float) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.dispatcher.drain(timeout_s), self._loop).result(
                timeout_s + 5
            )

    def stop(self, deadline_s: float = 5.0) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.dispatcher.stop(deadline_s), loop).result(
                deadline_s + 5
            )
        except Exception:
            log.exception("notifiers did not stop cleanly")
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
