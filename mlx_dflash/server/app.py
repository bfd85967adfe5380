"""The FastAPI application: OpenAI's chat and text completions (chat.py) and Responses API
(responses.py) and Anthropic's Messages API (anthropic.py) over one model worker, for one or
several models served by name. Each API surface turns its request into a rendered prompt
(prompts.chat_prompt) and one ``Job`` the worker runs; each shapes the job's events into its
own wire format, sharing the reply's parsing (reply.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Sequence

import mlx.core as mx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..grammar import Grammar, GrammarError, Matcher
from ..policy import COPY_DRAFTS
from ..target import as_target
from .anthropic import CountTokensRequest, MessageShaper, MessagesRequest
from .auth import APIKeyMiddleware
from .chat import Shaper
from .dashboard import add_dashboard
from .metrics import Metrics
from .errors import APIError, error_response, install_handlers
from .models import (
    DEFAULT_CONTEXT,  # noqa: F401  (re-exported)
    CacheSettings,
    ModelPool,
    ServedModel,
    context_size,  # noqa: F401  (re-exported)
    served_model,
)
from .prompts import ChatPrompt, chat_prompt, check_context, check_token_ids, text_prompt_ids
from .reply import Reply
from .responses import ResponseShaper, ResponsesRequest, ResponseStore, conversation
from .schemas import ChatCompletionRequest, CompletionRequest
from .structured import NO_THINKING
from .tools import template_tools
from .worker import Delta, Done, Failed, Job, ModelBusy, ModelWorker, Started

DISCONNECT_POLL_S = 0.25  # how often a request checks that its client is still there
KEEPALIVE_S = 10.0  # a stream silent this long (a long prefill) gets a ping or an SSE comment


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
    default_max_tokens: int | None = None,
    max_tokens_cap: int | None = None,
    default_temperature: float | None = None,
    copy_drafts: bool = COPY_DRAFTS,
    max_batch: int = 8,
    tree: int | str | None = None,
    allowed_origins: Sequence[str] = (),
    ttl: float | None = None,
) -> FastAPI:
    """An app serving ``model`` (with ``drafter``; None: the target alone) as ``model_name``,
    or several ``models`` by name (the first is the default; at most ``model_memory`` bytes of
    weights stay loaded). ``cache``: the prefix caches (default: in memory only).
    ``max_batch``: how many requests decode together (1: one at a time). ``tree``: tree
    drafts of that many nodes, or "auto" (tree.py), for the model pairs that take them.
    ``default_max_tokens``: a reply's limit when a request names none (None: until the
    context ends); ``max_tokens_cap``: no reply longer than that, whatever a request asks;
    ``default_temperature``: for requests that name none (None: each API's own default, 1.0;
    agents send none). ``allowed_origins``: web pages that may call the API from a browser
    (CORS; none by default; the API key, if any, is still required of their requests).
    ``ttl``: seconds a loaded model may sit idle before it is unloaded (None: never)."""
    if models is None:
        if model_name is None:
            raise ValueError("model_name is required with a single model")
        models = [served_model(model_name, model, drafter, tokenizer, block_size=block_size,
                               max_context=max_context)]
    pool = ModelPool(models, max_bytes=model_memory, cache=cache, ttl=ttl)
    worker = ModelWorker(pool, copy_drafts, max_batch, tree)
    stored = ResponseStore()  # the Responses API's store: true
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
    if allowed_origins:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])

    def server_state() -> dict[str, Any]:
        models, serving = {}, worker.serving
        for m in pool.models.values():
            cache = m.prefix_cache
            tiers = {} if cache is None else {"memory": cache.nbytes} | (
                {"disk": cache.disk.nbytes()} if cache.disk is not None else {})
            models[m.name] = {"loaded": m.loaded, "drafter": m.drafter_label,
                              "block_size": m.block_size, "context": m.context,
                              "weights_bytes": m.nbytes, "prefix_cache": tiers,
                              "pinned": m.pinned, "decoding": m.name in serving,
                              "last_pass": worker.last_pass(m.name)}
        return {"running": worker.running, "waiting": worker.waiting, "models": models}

    metrics = worker.metrics = Metrics(server_state)
    app.state.worker = worker
    app.state.pool = pool
    app.state.model_name = pool.default
    app.state.max_context = pool.get(None).context

    def model_card(name: str) -> dict[str, Any]:
        served = pool.get(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "mlx-dflash",
                "context_length": served.context, "drafter": served.drafter_label,
                "loaded": served.loaded, "pinned": served.pinned}

    def served(name: str) -> ServedModel:
        found = pool.get(name)
        if found is None:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in pool.names)}.", param="model",
                           code="model_not_found")
        return found

    def check_fit(name: str, param: str | None = None) -> None:
        """A 507 naming the sizes when the model is not loaded and cannot be without swapping."""
        if problem := pool.fit_problem(name, busy=worker.serving):
            raise APIError(507, f"The model cannot be loaded: {problem}.", param=param,
                           code="model_does_not_fit", type="server_error")

    def make_job(body: Any, model: ServedModel, prompt: ChatPrompt, param: str,
                 requested: int | None, requested_name: str, api: str = "openai",
                 grammar: Grammar | None = None) -> Job:
        """The worker's job for ``prompt``: a reply of at most ``requested`` tokens (None: until
        the context ends), cut to the room the context leaves. ``api``: "openai" (a limit
        beyond the whole context is a 400, as OpenAI's chat API has it), "responses" or
        "anthropic" (always cut; agents ask for more than any local context)."""
        check_fit(model.name, param="model")
        ctx, n = model.context, len(prompt.ids)
        if api == "anthropic" and n >= ctx:  # Anthropic's wording: Claude Code's compaction
            raise APIError(400, f"prompt is too long: {n} tokens > {ctx - 1} maximum",
                           param=param)
        check_context(n, ctx, param)
        if api == "openai" and requested is not None and requested > ctx:
            raise APIError(400, f"'{requested_name}' is {requested}, more than this model's "
                           f"context size of {ctx} tokens.", param=requested_name,
                           code="invalid_value")
        room = ctx - n
        if grammar is not None:
            try:  # the grammar against this model's vocabulary, before the job is queued
                Matcher(grammar, model.tokenizer,
                        model.vocab_size or as_target(model.model).vocab_size)
            except GrammarError as e:
                raise APIError(400, f"The requested structured output cannot be enforced "
                               f"with this model: {e}", code="unsupported_value") from None
        return Job(
            prompt=prompt.ids,
            max_tokens=min(requested or default_max_tokens or room, room,
                           max_tokens_cap or room),
            model=model.name,
            checkpoints=prompt.checkpoints,
            temperature=(body.temperature if default_temperature is None
                         or "temperature" in body.model_fields_set else default_temperature),
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            grammar=grammar,
            loop=asyncio.get_running_loop(),
        )

    def structured(kwargs: dict | None, grammar: Grammar | None) -> dict | None:
        """The template's arguments: no thinking block before a structured reply."""
        return {**(kwargs or {}), **NO_THINKING} if grammar is not None else kwargs

    def render(model: ServedModel, convo: list, tools: list | None, choice: Any,
               kwargs: dict | None, param: str = "tool_choice") -> ChatPrompt:
        return chat_prompt(model.tokenizer, convo, tools, tool_choice=choice,
                           template_kwargs={**model.template_kwargs, **(kwargs or {})},
                           checkpoints=model.checkpoints, param=param)

    async def respond(job: Job, shaper: Any, stream: bool, request: Request) -> Response:
        job.endpoint = request.url.path
        worker.submit(job)
        if stream:
            return StreamingResponse(stream_events(job, shaper, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(job, shaper, request)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, Any]:
        # Agents (Claude Code) probe the base URL before their first request.
        return {"object": "server", "name": "mlx-dflash", "version": __version__,
                "models": pool.names, "dashboard": "/dashboard"}

    add_dashboard(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": pool.default, "models": pool.names,
                "loaded": pool.loaded(), "running": worker.running,
                "waiting": worker.waiting, "pending": worker.pending,
                "memory": {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(),
                           "peak": mx.get_peak_memory()},
                "prefix_cache": {m.name: m.prefix_cache.nbytes for m in pool.models.values()
                                 if m.prefix_cache is not None}}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus' text format (metrics.py): nothing secret, so no key is asked for."""
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """What /metrics shows, as JSON (the counters, and the state they are read with)."""
        metrics.sample()
        return {"version": __version__, "uptime_s": time.time() - metrics.started,
                **metrics.refresh(), "totals": metrics.totals(), "requests": worker.requests(),
                "history": list(metrics.history)}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in pool.names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return model_card(served(model_id).name)

    async def on_worker(fn: Any) -> Any:
        return await asyncio.wrap_future(worker.call(fn))

    @app.post("/v1/models/{model_id:path}/load")
    async def load_model(model_id: str) -> dict[str, Any]:
        """Load the model now (after the fit check)."""
        name = served(model_id).name
        check_fit(name)
        await on_worker(lambda: worker.load_model(name))
        return model_card(name)

    @app.post("/v1/models/{model_id:path}/unload")
    async def unload_model(model_id: str) -> dict[str, Any]:
        """Unload the model's weights (not a pinned one, nor one with requests)."""
        name = served(model_id).name
        try:
            await on_worker(lambda: worker.unload_model(name))
        except ModelBusy as e:
            raise APIError(409, str(e), code="model_busy") from None
        except ValueError as e:
            raise APIError(409, str(e), code="model_pinned") from None
        return model_card(name)

    @app.post("/v1/models/{model_id:path}/pin")
    async def pin_model(model_id: str) -> dict[str, Any]:
        """Keep the model loaded (loading it now if need be): never unloaded until unpinned."""
        model = served(model_id)
        check_fit(model.name)
        await on_worker(lambda: worker.load_model(model.name))
        model.pinned = True
        return model_card(model.name)

    @app.post("/v1/models/{model_id:path}/unpin")
    async def unpin_model(model_id: str) -> dict[str, Any]:
        model = served(model_id)
        model.pinned = False
        pool.touch(model.name)  # its idle time starts now
        return model_card(model.name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = served(body.model)
        body.check_supported()
        grammar = body.grammar()
        prompt = render(model, body.messages, template_tools(body.tools), body.choice(),
                        structured(body.chat_template_kwargs, grammar))
        requested, name = body.requested_max_tokens()
        job = make_job(body, model, prompt, "messages", requested, name,
                       grammar=grammar or prompt.grammar)
        job.origins = body.stream and body.token_origins
        shaper = Shaper(True, model.name, body.include_usage,
                        Reply(model.tokenizer, prompt.ids, prompt.tools))
        return await respond(job, shaper, body.stream, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = served(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        if prompt is None:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt",
                           code="invalid_value")
        ids = text_prompt_ids(model.tokenizer, prompt)
        if isinstance(prompt, list):
            check_token_ids(ids, model.vocab_size)
        requested, name = body.requested_max_tokens()
        job = make_job(body, model, ChatPrompt(ids), "prompt", requested, name,
                       grammar=body.grammar())
        return await respond(job, Shaper(False, model.name, body.include_usage), body.stream,
                             request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        model = served(body.model)
        body.check_supported()
        grammar = body.grammar()
        prompt = render(model, body.conversation(), body.template_tools(), body.choice(),
                        structured(body.template_kwargs(), grammar))
        job = make_job(body, model, prompt, "messages", body.max_tokens, "max_tokens",
                       api="anthropic", grammar=grammar or prompt.grammar)
        shaper = MessageShaper(model.name, Reply(model.tokenizer, prompt.ids, prompt.tools))
        return await respond(job, shaper, body.stream, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        model = served(body.model)
        prompt = render(model, body.conversation(), body.template_tools(), body.choice(),
                        body.template_kwargs())
        return {"input_tokens": len(prompt.ids)}

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        model = served(body.model)
        body.check_supported()
        items = [{"type": "message", "role": "user", "content": body.input}] \
            if isinstance(body.input, str) else list(body.input)
        if body.previous_response_id is not None:
            items = stored.items(body.previous_response_id) + items
        try:  # items and tools are free-form JSON: a malformed one is the client's error
            tools, namespaced = body.template_tools()
            convo = conversation(body.instructions, items)
        except (AttributeError, TypeError, KeyError) as e:
            raise APIError(400, f"Malformed 'input' or 'tools': {type(e).__name__}: {e}.",
                           param="input") from e
        grammar = body.grammar()
        prompt = render(model, convo, tools, body.choice(),
                        structured(body.template_kwargs(), grammar))
        job = make_job(body, model, prompt, "input", body.max_output_tokens,
                       "max_output_tokens", api="responses", grammar=grammar or prompt.grammar)
        keep = (lambda response: stored.put(response, items)) if body.store else None
        shaper = ResponseShaper(model.name, body, Reply(model.tokenizer, prompt.ids,
                                                        prompt.tools), namespaced, keep)
        return await respond(job, shaper, body.stream, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored.get(response_id)

    return app


async def stream_events(job: Job, shaper: Any, request: Request) -> AsyncIterator[str]:
    """Server-sent events until the job is done; a client that leaves early cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    try:
        for event in shaper.open():
            yield event
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:  # a long prefill: keep the client's connection alive
                for out in shaper.keepalive():
                    yield out
                continue
            if isinstance(event, Started):
                for out in shaper.started(event):
                    yield out
            elif isinstance(event, Delta):
                for out in shaper.delta(event.text):
                    yield out
                if event.pieces is not None:  # asked for by chat requests only (token_origins)
                    for out in shaper.origins(event.pieces):
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
