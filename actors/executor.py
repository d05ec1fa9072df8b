"""The node's engine thread: model loads and engine calls, one at a time, abortable.

The node's event loop never blocks: it hands every load and every call to the one
engine thread here and awaits it. ``abort`` stops the call in progress (an inference
call through ONNX Runtime's terminate flag, a generation at its next token boundary),
or, when it comes first, the call that is about to start.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from actors.decoder import DecoderEngine, Generation
from actors.engine import Engine
from actors.models import ModelManager
from edgefleet.clock import Clock

LoadHook = Callable[[str, float], None]  # (model, seconds) after each load


class EngineThread:
    """Runs a node's loads and engine calls on its single engine thread."""

    def __init__(self, name: str, models: ModelManager, clock: Clock, loaded: LoadHook) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{name}")
        self._models = models
        self._clock = clock
        self._loaded = loaded
        self._engine: Engine | None = None  # the engine running a call now
        self._stop: threading.Event | None = None  # set to abort the call in progress
        self.switching: str | None = None  # the model being loaded now

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread (probing, closing)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def load(self, model: str) -> Engine:
        """``model``'s engine, loading it first (and evicting others) when not resident."""
        engine = self._models.resident(model)
        if engine is not None:
            return engine
        self.switching = model
        t0 = self._clock.now()
        try:
            loop = asyncio.get_running_loop()
            engine = await loop.run_in_executor(self._pool, self._models.ensure, model)
        finally:
            self.switching = None
        self._loaded(model, self._clock.now() - t0)
        return engine

    async def run(
        self, model: str, inputs: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]]:
        """One inference call of ``model`` over a batch; RunAborted when aborted."""
        stop = self._stop = threading.Event()
        try:
            engine = await self.load(model)
            self._engine = engine
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, engine.run, inputs, stop)
        finally:
            self._engine = self._stop = None

    async def advance(self, model: str, gen: Generation, before: Callable[[], None]) -> str | None:
        """Decode ``gen`` until it ends (its finish reason) or is aborted (None: paused
        at a token boundary). ``before`` runs once the model is resident."""
        stop = self._stop = threading.Event()
        try:
            engine = await self.load(model)
            assert isinstance(engine, DecoderEngine), f"{model} is not a decoder"
            self._engine = engine
            before()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, engine.advance, gen, stop)
        finally:
            self._engine = self._stop = None

    def abort(self) -> None:
        # The stop event first: a call the engine thread has not entered yet sees it
        # and never starts; a call in progress is interrupted by abort().
        if self._stop is not None:
            self._stop.set()
        if self._engine is not None:
            self._engine.abort()

    async def close(self) -> None:
        """Unload every model, then let the thread go."""
        await self.call(self._models.close)
        self._pool.shutdown(wait=False)
