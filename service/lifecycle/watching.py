"""When the served models change, per model control mode: the first load at start, then
rescans of the repository on SIGHUP and, in poll mode, every interval."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from service.inference import errors
from service.lifecycle.lifecycle import Lifecycle, LifecycleOptions
from service.lifecycle.repository import RepositoryError

log = logging.getLogger("paddlequic.models")
# What RepositoryIndex says of a model a memory budget has not loaded yet.
NOT_LOADED_YET = "not loaded yet: loads on its first request"


class RepositoryWatcher:
    """Drives the lifecycle: the first load, then SIGHUP rescans and polling."""

    def __init__(self, lifecycle: Lifecycle, options: LifecycleOptions) -> None:
        mode = options.model_control_mode
        if options.poll_repository > 0 and mode == "none":
            mode = "poll"
        self.lifecycle = lifecycle
        self.mode = mode
        self.interval = options.poll_repository or 5.0
        self.startup = [n.strip() for n in options.load_model.split(",") if n.strip()]
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.lifecycle.budget is not None:
            explicit = self.mode == "explicit" and "*" not in self.startup
            await self._offer_all(self.startup if explicit else [])
        elif self.mode == "explicit" and "*" not in self.startup:
            await self.lifecycle.load_all(self.startup)
        else:
            await self.lifecycle.load_all()
        if self.mode == "poll":
            self._spawn(self._poll())

    async def _offer_all(self, pinned: list[str]) -> None:
        """Under a memory budget the start loads only the models explicit mode names, pinned;
        every other model of the repository loads on its first request."""
        lifecycle = self.lifecycle
        for name in lifecycle.repository.model_names():
            lifecycle.registry.offer(name, NOT_LOADED_YET)
        for name in pinned:
            try:
                await lifecycle.load_model(name, explicit=True)
            except errors.ServiceError as exc:
                log.error("model %s not loaded: %s", name, exc.message)
        lifecycle.registry.loading_done = True
        lifecycle.registry.changed()

    def rescan_soon(self) -> None:
        log.info("SIGHUP: rescanning the model repository")
        self._spawn(self._rescan())

    def stop_watching(self) -> None:
        """No more rescans: the server is shutting down."""
        for task in self._tasks:
            task.cancel()

    async def _rescan(self) -> None:
        await self.rescan(unload_missing=self.mode == "poll", only_loaded=self.mode == "explicit")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._rescan()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def rescan(self, unload_missing: bool, only_loaded: bool) -> None:
        """Pick up what changed in the repository (SIGHUP, polling)."""
        lifecycle = self.lifecycle
        try:
            names = set(lifecycle.repository.model_names())
        except (RepositoryError, OSError) as exc:
            log.error("rescan: %s", exc)  # the models already loaded keep serving
            return
        loaded = set(lifecycle.registry.loaded_names())
        if lifecycle.budget is not None:
            # Under a memory budget a rescan reloads what is in memory; a new model loads on
            # its first request.
            only_loaded = True
            for name in sorted(names - loaded):
                lifecycle.registry.offer(name, NOT_LOADED_YET)
        targets = sorted(loaded) if only_loaded else sorted(names)
        for name in targets:
            if name not in names:
                continue
            if lifecycle.loaded_with_its_own(name):
                # Its config or files came with its last RepositoryModelLoad, not from here.
                log.info("rescan: %s keeps the config and files of its last load", name)
                continue
            try:
                await lifecycle.load_model(name)
            except errors.ServiceError as exc:
                log.error("reload of %s: %s", name, exc.message)
        if unload_missing:
            for name in sorted(loaded - names):
                await lifecycle.unload_model(name)
