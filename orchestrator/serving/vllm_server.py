"""The vllm engine's replica: Ray Serve LLM's `LLMServer`, ready only once its engine answered.

vLLM's engine can start and still be unable to run the model (its CPU build refuses attention
head sizes below 32 at the first request, after the engine has started): Serve would call the
deployment RUNNING and every request would get `EngineDeadError`. Here a replica's start ends
with a one-token completion through the server's own completions path; an engine that cannot
start, or dies on it, fails the start with the root cause its processes wrote (root_cause.py),
which Serve shows as the deployment's error. A dead engine later fails the health check the
same way, and Serve replaces the replica, whose start tries the engine again. A warm-up that
hangs fails the start after WARM_UP_TIMEOUT_S (warm_up.py). `server_cls` in the LLMConfig
names this class (vllm_app.py); it runs on the serving nodes only.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.serve.llm import LLMServer

from orchestrator.serving.root_cause import ProcessOutput, why
from orchestrator.serving.warm_up import WARM_UP_PROMPT, WARM_UP_TIMEOUT_S, timed_out

logger = logging.getLogger("ray.serve")  # the replica's log


class VLLMServer(LLMServer):
    """`LLMServer` whose start proves the engine generates, and whose errors say why not."""

    async def start(self) -> None:
        output = ProcessOutput.mark()
        try:
            await super().start()
        except Exception as e:
            raise RuntimeError(f"the vllm engine could not start: {await _why(e, output)}") from e
        output = ProcessOutput.mark()  # what the warm-up alone makes them write
        started = time.monotonic()
        try:
            try:
                await asyncio.wait_for(self._warm_up(), WARM_UP_TIMEOUT_S)
            except TimeoutError:
                raise timed_out(WARM_UP_TIMEOUT_S) from None  # an engine stuck, not dead
        except Exception as e:
            raise RuntimeError(
                "the vllm engine started but failed its warm-up request (a one-token "
                f"completion): {await _why(e, output)}"
            ) from e
        logger.info("the vllm engine answered its warm-up in %.2f s", time.monotonic() - started)
        self._since_ready = ProcessOutput.mark()

    async def check_health(self) -> None:
        try:
            await super().check_health()
        except Exception as e:
            output = getattr(self, "_since_ready", None)
            raise RuntimeError(f"the vllm engine died: {await _why(e, output)}") from e

    async def _warm_up(self) -> None:
        """One greedy token for the base model, as a client's /v1/completions would ask."""
        from ray.serve.llm.openai_api_models import CompletionRequest, ErrorResponse

        config = await self.llm_config()
        assert config is not None
        request = CompletionRequest(
            model=config.model_id, prompt=WARM_UP_PROMPT, max_tokens=1, temperature=0.0
        )
        async for reply in await self.completions(request):
            if isinstance(reply, ErrorResponse):
                raise RuntimeError(f"{reply.error.type}: {reply.error.message}")


async def _why(e: BaseException, output: ProcessOutput | None) -> str:
    """`e` in one line, or the root cause the engine's processes wrote where `e` points at it
    (reading it waits a little for them: off the event loop)."""
    return await asyncio.to_thread(why, e, output)
