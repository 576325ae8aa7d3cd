"""A batch of raw prompts (`"prompt": ["a", [1, 2], ...]`): one engine request per prompt.

llama-server queues every prompt of a request as its own task and answers one result per prompt
(`handle_completions_impl`: an array on /completion, the choices merged on /v1/completions; in a
stream the results interleave, each carrying its `index`). Here the whole request holds one
ingress unit, as a rerank does, and its prompts run a lane's worth (--max-concurrency) at a time
in order. The first lane's worth is submitted before the response starts, so a refusal of one of
them (context_length_exceeded, overload) is the HTTP error; a later one, like a failure while
generating, ends the stream with an error event. The first failure cancels every other prompt.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols.raw_prompt import RawPlan
from ninfer_core.protocols.raw_prompt_input import tokenize_prompts
from ninfer_core.protocols.raw_submit import RawSubmission, cancelled_error, submit_prompt
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import engine_error_body
from ninfer_core.server.sse import KEEPALIVE, sse_data

T = TypeVar("T")


class ErrorFrame(str):
    """An SSE error event: the last frame of a prompt's stream. A single-prompt stream writes it
    like any frame; a batch stops every prompt when one yields it."""


class RawBatch:
    """The prompts of one raw request, run a lane's worth at a time; `open()` first, `release()` last."""

    def __init__(self, request: Any, ctx: ServerContext, plan: RawPlan, logprobs: int | None):
        self.request, self.ctx, self.plan, self.logprobs = request, ctx, plan, logprobs
        self.subs: list[RawSubmission] = []
        self.release: Callable[[], None] = lambda: None
        self._lanes = asyncio.Semaphore(max(1, ctx.options.engine.max_concurrency))
        self._deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
        self._ids: list[list[int]] = []
        self._opened: dict[int, RawSubmission] = {}
        self._cancelled = False

    def __len__(self) -> int:
        return len(self.plan.prompts)

    async def open(self) -> None:
        """Hold the ingress unit, tokenize every prompt (a worker thread), submit the first lane's
        worth; an error here is the response's."""
        self.release = self.ctx.ingress.acquire()
        try:
            from ninfer_core.structured.request import compile_request

            self._compiled = await anyio.to_thread.run_sync(compile_request, self.ctx, self.plan.response_format)
            self._ids = await anyio.to_thread.run_sync(tokenize_prompts, self.ctx, self.plan.prompts)
            for i in range(min(len(self), self.ctx.options.engine.max_concurrency)):
                await self._lanes.acquire()
                self._opened[i] = self._submit(i)
        except BaseException:
            self.cancel()
            self.release()
            raise

    def cancel(self) -> None:
        """Cancel every submitted prompt and submit no more (idempotent, thread-safe per handle)."""
        self._cancelled = True
        for sub in self.subs:
            sub.handle.cancel()

    def _submit(self, i: int) -> RawSubmission:
        if self._cancelled:
            raise cancelled_error()
        sub = submit_prompt(self.request, self.ctx, self.plan, self._ids[i], i, self.logprobs, self._deadline,
                            self.release, getattr(self, "_compiled", None))
        self.subs.append(sub)
        return sub

    async def _submission(self, i: int) -> RawSubmission:
        """Prompt i's submission once it holds a lane (the first lane's worth already does)."""
        sub = self._opened.pop(i, None)
        if sub is not None:
            return sub
        await self._lanes.acquire()
        try:
            return self._submit(i)
        except BaseException:
            self._lanes.release()
            raise

    async def gather(self, work: Callable[[RawSubmission], Awaitable[T]]) -> list[T]:
        """`work(sub)` for every prompt, results in prompt order; the first failure cancels the rest."""
        async def one(i: int) -> T:
            sub = await self._submission(i)
            try:
                return await work(sub)
            finally:
                self._lanes.release()

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(self))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            self.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def merged(self, frames: Callable[[RawSubmission], AsyncIterator[str]], keepalive_s: float
                     ) -> AsyncIterator[str]:
        """Every prompt's stream frames as they come (their own keep-alives dropped: one comment
        after `keepalive_s` without any frame); ends after the last prompt, or at the first
        ErrorFrame, which cancels the others."""
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int) -> None:
            try:
                sub = await self._submission(i)
            except EngineError as e:
                queue.put_nowait(ErrorFrame(sse_data(engine_error_body(e))))
                return
            try:
                async for frame in frames(sub):
                    if frame != KEEPALIVE:
                        queue.put_nowait(frame)
            finally:
                self._lanes.release()
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(self))]
        running = len(tasks)
        try:
            while running:
                try:
                    item = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield KEEPALIVE
                    continue
                if item is None:
                    running -= 1
                    continue
                yield item
                if isinstance(item, ErrorFrame):
                    return
        finally:
            self.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
