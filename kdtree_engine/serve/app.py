"""The HTTP front: FastAPI routes over the worker (docs/serve.md lists endpoints, fields and errors).

Handlers check the request (auth, body size, fields, model name, the prompt against the context), tokenize it
and queue a :class:`Job`; the worker thread generates and sends text back. A streamed request that loses its
client is cancelled when the stream is torn down; a whole-response request watches for the disconnect itself.
Every error is an OpenAI error object; anything unexpected is logged and answered with a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import BadInput, PromptError, SamplingError
from ..speculative.decode import check_prompt
from .metrics import CONTENT_TYPE_LATEST, ServeMetrics
from .protocol import ApiError, Chat, Completion, parse_body, sampling_for
from .responses import DONE, Shape, sse
from .worker import BatchWorker, Delta, Done, Failed, Job, QueueFull, SerialWorker, Worker

log = logging.getLogger("kdtree_engine.serve")

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServeSettings:
    """What the app needs besides the model (flags of ``kdtree serve``). ``batching``: requests run concurrently
    through one continuous batch of at most ``max_batch_tokens`` rows per forward (None: the scheduler's default);
    off: one at a time through ``llm.generate`` (``kdtree serve`` turns it on at tp 1 unless ``--no-batching``)."""

    served_model_name: str
    max_queue: int = 64
    batching: bool = False
    max_batch_tokens: int | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout_s: float = 10.0


def build_app(llm: Any, settings: ServeSettings) -> FastAPI:
    """The app over a loaded :class:`kdtree_engine.LLM` (its target, tokenizer and ``generate``)."""
    name = settings.served_model_name
    metrics = ServeMetrics(name)
    context = llm.target.cfg.max_position_embeddings
    worker = make_worker(llm, settings, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        if not await asyncio.to_thread(worker.stop, settings.shutdown_timeout_s):
            log.error("the engine thread did not end within %.0f s", settings.shutdown_timeout_s)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = metrics

    def error_response(e: ApiError) -> JSONResponse:
        metrics.reject(e.status)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        what = "not_found" if e.status_code == 404 else None
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       code=what))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(internal(e))

    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {settings.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        cap = settings.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {cap} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def prompt_ids(body: Completion | Chat) -> list[int]:
        if isinstance(body, Completion):
            prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) \
                else body.prompt
            if isinstance(prompt, str) and llm.tokenizer is None:
                raise ApiError(400, "prompt: this model has no tokenizer; send the prompt as token ids", "prompt")
            return llm.encode(prompt)
        if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
            raise ApiError(400, "messages: this model has no chat template (use /v1/completions)", "messages")
        try:
            text = llm.tokenizer.render_chat([m.as_dict() for m in body.messages], add_generation_prompt=True)
        except BadInput as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        return llm.tokenizer.encode(text, special=True)

    def make_job(body: Completion | Chat) -> Job:
        if body.model != name:
            raise ApiError(404, f"model: {body.model!r} is not served here; this server serves {name!r}",
                           "model", code="model_not_found")
        ids = prompt_ids(body)
        where = "prompt" if isinstance(body, Completion) else "messages"
        try:
            params = sampling_for(body, len(ids), context)
            check_prompt(llm.target, ids)
        except PromptError as e:
            raise ApiError(400, f"{where}: {e}", where) from None
        except SamplingError as e:
            raise ApiError(400, str(e)) from None
        return Job(ids, params, body.stop_strings(), asyncio.get_running_loop())

    async def handle(request: Request, cls: type[Completion] | type[Chat]) -> Response:
        check_auth(request)
        body = parse_body(cls, await read_body(request))
        job = make_job(body)
        try:
            worker.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry later", type="server_error", code="queue_full") from None
        shape = Shape(chat=cls is Chat, model=name,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage))
        if body.stream:
            return StreamingResponse(stream(job, shape, worker), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(job, shape, request, worker)

    async def guarded(request: Request, cls: type[Completion] | type[Chat]) -> Response:
        try:
            return await handle(request, cls)
        except ApiError:
            raise
        except Exception as e:
            log.exception("unexpected error on %s %s", request.method, request.url.path)
            raise internal(e) from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(request, Completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(request, Chat)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "kdtree-engine", "max_model_len": context}]}

    @app.get("/health")
    async def health() -> Response:
        if worker.closed or worker.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def make_worker(llm: Any, settings: ServeSettings, metrics: ServeMetrics) -> Worker:
    """The worker of ``settings.batching``: the engine's continuous batch, or one request at a time."""
    if settings.batching:
        return BatchWorker(lambda: llm.scheduler(settings.max_batch_tokens),
                           lambda sched, ids, params, on_tokens: llm.submit(sched, ids, params, on_tokens=on_tokens),
                           llm.decode, metrics, settings.max_queue)
    # stoppable: a stop string or a client gone ends the request after the round (on every rank at --tp > 1)
    return SerialWorker(lambda ids, params, on_tokens: llm.generate(ids, params, on_tokens=on_tokens,
                                                                    stoppable=True)[0],
                        llm.decode, metrics, settings.max_queue)


def internal(e: Exception) -> ApiError:
    return ApiError(500, f"internal error ({type(e).__name__}); the server log has the details",
                    type="server_error")


async def stream(job: Job, shape: Shape, worker: Worker) -> AsyncIterator[str]:
    """Server-sent events: the chunks, a usage chunk when asked for, then ``[DONE]``. Torn down early (the client
    went away): the job is cancelled, the worker ends it at the next round."""
    ended = False
    try:
        if shape.chat:
            yield shape.chunk(None, role=True)
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                yield shape.chunk(event.text)
                continue
            ended = True
            if isinstance(event, Failed):
                yield sse(ApiError(500, event.message, type="server_error").body())
            elif isinstance(event, Done):
                yield shape.chunk(None if shape.chat else "", event.finish_reason)
                if shape.include_usage:
                    yield shape.usage_chunk(event.prompt_tokens, event.completion_tokens)
            break
        yield DONE
    finally:
        if not ended:
            worker.cancel(job)


async def wait_disconnect(receive: Callable[[], Any]) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def whole(job: Job, shape: Shape, request: Request, worker: Worker) -> Response:
    """The whole response once the job is done; a client gone before that cancels the job."""
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    text: list[str] = []
    try:
        while True:
            get = asyncio.ensure_future(job.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                worker.cancel(job)
                return Response(status_code=499)   # nobody reads it
            event = get.result()
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed):
                raise ApiError(500, event.message, type="server_error")
            else:
                return JSONResponse(shape.whole("".join(text), event.finish_reason, event.prompt_tokens,
                                                event.completion_tokens))
    finally:
        gone.cancel()
        worker.cancel(job)   # a no-op once the job is done; ends it when this task was cancelled (shutdown)
