"""The FastAPI application: OpenAI-compatible chat/text completions and Anthropic's Messages API
over one model worker, for one or several models served by name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from ..policy import COPY_DRAFTS
from .anthropic import MessageShaper, MessagesRequest
from .auth import APIKeyMiddleware
from .errors import APIError, error_response, install_handlers
from .models import (
    DEFAULT_CONTEXT,  # noqa: F401  (re-exported)
    CacheSettings,
    ModelPool,
    ServedModel,
    context_size,  # noqa: F401  (re-exported)
    served_model,
)
from .prompts import (
    check_context,
    check_token_ids,
    chat_prompt_ids,
    earlier_turns_end,
    text_prompt_ids,
)
from .responses import Shaper
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from .tools import ToolCalls, template_tools
from .worker import Delta, Done, Failed, Job, ModelWorker, Started

DEFAULT_MAX_TOKENS = 512  # when a request names no limit (capped by the room left in the context)
DISCONNECT_POLL_S = 0.25  # how often a request checks that its client is still there


def create_app(
    model: Any = None,
    drafter: Any = None,
    tokenizer: Any = None,
    *,
    model_name: str | None = None,
    models: list[ServedModel] | None = None,
    model_memory: int | None = None,
    cache: CacheSettings | None = None,
    api_key: str | None = None,
    max_context: int | None = None,
    block_size: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    copy_drafts: bool = COPY_DRAFTS,
    max_batch: int = 8,
    tree: int | str | None = None,
) -> FastAPI:
    """An app serving ``model`` (with ``drafter``; None: the target alone) as ``model_name``,
    or several ``models`` by name (the first is the default; at most ``model_memory`` bytes of
    weights stay loaded). ``cache``: the prefix caches (default: in memory only).
    ``max_batch``: how many requests decode together (1: one at a time). ``tree``: tree
    drafts of that many nodes, or "auto" (tree.py), for the model pairs that take them."""
    if models is None:
        if model_name is None:
            raise ValueError("model_name is required with a single model")
        models = [served_model(model_name, model, drafter, tokenizer, block_size=block_size,
                               max_context=max_context)]
    pool = ModelPool(models, max_bytes=model_memory, cache=cache)
    worker = ModelWorker(pool, copy_drafts, max_batch, tree)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mlx-dflash", version=__version__, lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible server for lossless DFlash "
                  "speculative decoding.")
    install_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.worker = worker
    app.state.pool = pool
    app.state.model_name = pool.default
    app.state.max_context = pool.get(None).context

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "mlx-dflash"}

    def served(name: str) -> ServedModel:
        found = pool.get(name)
        if found is None:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in pool.names)}.", param="model",
                           code="model_not_found")
        return found

    def make_job(body: Any, model: ServedModel, ids: list[int], param: str, requested: int | None,
                 requested_name: str, checkpoints: list[int] | None = None) -> Job:
        ctx = model.context
        check_context(len(ids), ctx, param)
        if requested is not None and requested > ctx:
            raise APIError(400, f"'{requested_name}' is {requested}, more than this model's "
                           f"context size of {ctx} tokens.", param=requested_name,
                           code="invalid_value")
        return Job(
            prompt=ids,
            max_tokens=min(requested or default_max_tokens, ctx - len(ids)),
            model=model.name,
            checkpoints=checkpoints or [],
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            loop=asyncio.get_running_loop(),
        )

    def sampling_job(body: SamplingRequest, model: ServedModel, ids: list[int], param: str,
                     checkpoints: list[int] | None = None) -> Job:
        requested, name = body.requested_max_tokens()
        return make_job(body, model, ids, param, requested, name, checkpoints)

    async def respond(job: Job, shaper: Any, stream: bool, request: Request) -> Response:
        worker.submit(job)
        if stream:
            return StreamingResponse(stream_events(job, shaper, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(job, shaper, request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": pool.default, "models": pool.names,
                "loaded": pool.loaded(), "running": worker.running,
                "waiting": worker.waiting, "pending": worker.pending}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in pool.names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return model_card(served(model_id).name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = served(body.model)
        tools = template_tools(body.tools)
        ids = chat_prompt_ids(model.tokenizer, body.messages, tools)
        checkpoints = (earlier_turns_end(model.tokenizer, body.messages, tools, ids)
                       if model.checkpoints else [])
        job = sampling_job(body, model, ids, "messages", checkpoints)
        shaper = Shaper(True, model.name, body.include_usage,
                        ToolCalls.for_request(model.tokenizer, tools))
        return await respond(job, shaper, body.stream, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = served(body.model)
        prompt = body.single_prompt()
        if prompt is None:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt",
                           code="invalid_value")
        ids = text_prompt_ids(model.tokenizer, prompt)
        if isinstance(prompt, list):
            check_token_ids(ids, model.vocab_size)
        job = sampling_job(body, model, ids, "prompt")
        return await respond(job, Shaper(False, model.name, body.include_usage), body.stream,
                             request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        model = served(body.model)
        convo, tools = body.conversation(), body.template_tools()
        ids = chat_prompt_ids(model.tokenizer, convo, tools)
        checkpoints = (earlier_turns_end(model.tokenizer, convo, tools, ids)
                       if model.checkpoints else [])
        job = make_job(body, model, ids, "messages", body.max_tokens, "max_tokens", checkpoints)
        shaper = MessageShaper(model.name, ToolCalls.for_request(model.tokenizer, tools))
        return await respond(job, shaper, body.stream, request)

    return app


async def stream_events(job: Job, shaper: Any, request: Request) -> AsyncIterator[str]:
    """Server-sent events until the job is done; a client that leaves early cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    try:
        for event in shaper.open():
            yield event
        while True:
            event = await job.events.get()
            if isinstance(event, Started):
                for out in shaper.started(event):
                    yield out
            elif isinstance(event, Delta):
                for out in shaper.delta(event.text):
                    yield out
            elif isinstance(event, Done):
                for out in shaper.close(event):
                    yield out
                break
            elif isinstance(event, Failed):
                for out in shaper.error(event.message):
                    yield out
                break
            else:  # the client is gone
                return
    finally:
        watcher.cancel()
        job.cancel()


async def collect(job: Job, shaper: Any, request: Request) -> Response:
    """Wait for the whole reply; a client that goes away meanwhile cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    parts: list[str] = []
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, Started):
                continue
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Done):
                return JSONResponse(shaper.whole("".join(parts), event))
            elif isinstance(event, Failed):
                err = APIError(500, f"Internal error: {event.message}", type="server_error")
                return error_response(err, path=request.url.path)
            else:  # the client is gone: nobody will read this
                return Response(status_code=499)
    finally:
        watcher.cancel()
        job.cancel()


async def _watch_disconnect(job: Job, request: Request) -> None:
    # Uvicorn does not cancel a handler whose client left, so poll; events may flow meanwhile.
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()
    job.events.put_nowait(None)
