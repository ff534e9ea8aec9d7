"""The transformers engine as a Ray Serve deployment: the OpenAI API on CPU nodes (or any node).

The replica sets the deployment's variables (secrets resolved here, on the serving node),
downloads its checkpoints from the storage root, then loads them; Serve reports it ready only
after that, so a deployment that answers has its model loaded. Stopped, it lets go of the
downloaded copies, and the node's last replica using one removes it (staging.py).

No `from __future__ import annotations` here: FastAPI must see `Request` itself in the
signatures of the ingress methods Serve wraps, not a string it resolves elsewhere.
"""

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.serving import openai_api
from orchestrator.serving.served_model import ServedModel
from orchestrator.serving.staging import release, set_environment, stage

api = FastAPI(title="orchestrator: OpenAI-compatible API")
openai_api.install_error_handlers(api)


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
        self.staged = stage(served)
        try:
            self.engine = TransformersEngine(
                served.name, self.staged.model_dir, self.staged.adapters
            )
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
