"""The FastAPI application: OpenAI-compatible chat/text completions over one model worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .. import __version__
from ..decode import COPY_DRAFTS
from .auth import APIKeyMiddleware
from .errors import APIError, error_body, install_handlers
from .prompts import check_context, check_token_ids, chat_prompt_ids, text_prompt_ids
from .responses import Shaper, sse
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from .worker import Delta, Done, Failed, Job, ModelWorker

DEFAULT_CONTEXT = 4096
DEFAULT_MAX_TOKENS = 512  # when a request names no limit (capped by the room left in the context)
DISCONNECT_POLL_S = 0.25  # how often a request checks that its client is still there


def context_size(model: Any) -> int:
    """The target's context length from its config, or DEFAULT_CONTEXT."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length", "n_ctx"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def create_app(
    model: Any,
    drafter: Any,
    tokenizer: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    max_context: int | None = None,
    block_size: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    copy_drafts: bool = COPY_DRAFTS,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model`` (with ``drafter``; None: the target alone)."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    worker = ModelWorker(model, drafter, tokenizer, block_size, copy_drafts)
    ctx = max_context or context_size(model)
    vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mlx-dflash", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server for lossless DFlash speculative decoding.")
    install_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.worker = worker
    app.state.model_name = model_name
    app.state.max_context = ctx

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "mlx-dflash"}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{model_name}'.", param="model", code="model_not_found")

    def make_job(body: SamplingRequest, ids: list[int], param: str) -> Job:
        check_context(len(ids), ctx, param)
        requested, name = body.requested_max_tokens()
        if requested is not None and requested > ctx:
            raise APIError(400, f"'{name}' is {requested}, more than this model's context size "
                           f"of {ctx} tokens.", param=name, code="invalid_value")
        return Job(
            prompt=ids,
            max_tokens=min(requested or default_max_tokens, ctx - len(ids)),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            loop=asyncio.get_running_loop(),
        )

    async def respond(body: SamplingRequest, job: Job, chat: bool, request: Request) -> Response:
        shaper = Shaper(chat, model_name, include_usage=body.include_usage)
        worker.submit(job)
        if body.stream:
            return StreamingResponse(stream_events(job, shaper, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(job, shaper, request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "pending": worker.pending}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        ids = chat_prompt_ids(tokenizer, body.messages)
        return await respond(body, make_job(body, ids, "messages"), True, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt = body.single_prompt()
        if prompt is None:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt",
                           code="invalid_value")
        ids = text_prompt_ids(tokenizer, prompt)
        if isinstance(prompt, list):
            check_token_ids(ids, vocab_size)
        return await respond(body, make_job(body, ids, "prompt"), False, request)

    return app


async def stream_events(job: Job, shaper: Shaper, request: Request) -> AsyncIterator[str]:
    """SSE chunks until the job is done; a client that leaves early cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    try:
        if (first := shaper.first_chunk()) is not None:
            yield sse(first)
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                yield sse(shaper.text_chunk(event.text))
            elif isinstance(event, Done):
                yield sse(shaper.final_chunk(event))
                if shaper.include_usage:
                    yield sse(shaper.usage_chunk(event))
                break
            elif isinstance(event, Failed):  # the status line is gone: the error goes in-stream
                yield sse(error_body(f"Internal error: {event.message}", "server_error"))
                break
            else:  # the client is gone
                return
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        job.cancel()


async def collect(job: Job, shaper: Shaper, request: Request) -> Response:
    """Wait for the whole reply; a client that goes away meanwhile cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    parts: list[str] = []
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Done):
                return JSONResponse(shaper.whole("".join(parts), event))
            elif isinstance(event, Failed):
                err = APIError(500, f"Internal error: {event.message}", type="server_error")
                return JSONResponse(err.body(), status_code=500)
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
