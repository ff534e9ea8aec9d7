"""The transformers engine as a Ray Serve deployment: the OpenAI API on CPU nodes (or any node).

The replica sets the deployment's variables (secrets resolved here, on the serving node),
downloads its checkpoints from the storage root, loads them and generates one token; Serve
reports it ready only after that, so a deployment that is RUNNING has generated, and one whose
model cannot load or run fails saying why in one line (the last of Serve's message). Stopped,
it lets go of the downloaded copies, and the node's last replica using one removes it
(staging.py).

No `from __future__ import annotations` here: FastAPI must see `Request` itself in the
signatures of the ingress methods Serve wraps, not a string it resolves elsewhere.
"""

import logging
import os
import time
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.serving import openai_api
from orchestrator.serving.root_cause import error_line
from orchestrator.serving.served_model import ServedModel
from orchestrator.serving.staging import release, set_environment, stage
from orchestrator.serving.warm_up import WARM_UP_TIMEOUT_S, within

logger = logging.getLogger("ray.serve")  # the replica's log
api = FastAPI(title="orchestrator: OpenAI-compatible API")
openai_api.install_error_handlers(api)


# Above the class: `serve.ingress` copies the class as it is defined, with only the globals
# defined by then.
def _failed(what: str, e: Exception, secrets: list[str]) -> RuntimeError:
    """The replica's start error: `what`, then `e` in one line with the deployment's secret values
    masked (Serve shows its traceback to whoever lists deployments: raised `from None`); `e`'s
    traceback goes to the replica's log only."""
    logger.error("%s", what, exc_info=e)
    return RuntimeError(f"{what}: {error_line(e, secrets)}")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=16,  # requests queue in the engine, one generation at a time
    health_check_period_s=10,
    # A missing secret or checkpoint fails every try alike (storage reads retry on their own).
    max_constructor_retry_count=1,
)
@serve.ingress(api)
class TransformersServer:
    def __init__(self, model: dict[str, Any]) -> None:
        from orchestrator.serving.transformers_engine import TransformersEngine  # torch: slow

        served = ServedModel.model_validate(model)
        set_environment(served)
        secrets = [os.environ[v] for v in served.secret_env]  # never in a cause
        self.staged = stage(served)
        try:
            try:
                self.engine = TransformersEngine(
                    served.name, self.staged.model_dir, self.staged.adapters
                )
            except Exception as e:
                what = "the transformers engine could not load the model"
                raise _failed(what, e, secrets) from None
            started = time.monotonic()
            try:
                within(WARM_UP_TIMEOUT_S, self.engine.warm_up)
            except Exception as e:
                what = "the transformers engine loaded the model but failed its warm-up request"
                raise _failed(f"{what} (one token)", e, secrets) from None
            logger.info("the transformers engine answered its warm-up in %.2f s",
                        time.monotonic() - started)  # fmt: skip
        except BaseException:
            release(self.staged.held)  # a replica that could not load holds nothing
            del self.staged
            raise

    def __del__(self) -> None:
        """Serve calls this as it stops the replica: its copies leave the node's disk."""
        staged, self.staged = getattr(self, "staged", None), None  # once: GC may call it again
        if staged is not None:
            release(staged.held)

    @api.get("/v1/models")
    async def models(self) -> Response:
        return await openai_api.list_models(self.engine)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await openai_api.completions(self.engine, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await openai_api.chat_completions(self.engine, request)


def build_app(args: dict[str, Any]) -> Application:
    """`import_path` target of the Serve config: `args` is `{"model": ServedModel}`."""
    ServedModel.model_validate(args["model"])  # a bad config fails the build, with its reason
    return TransformersServer.bind(args["model"])
