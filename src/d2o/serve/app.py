"""The FastAPI application over an ``Engine``: the OpenAI endpoints, ``/health`` and ``/metrics``.

Handlers are async and never touch the model: they check a request, hand it to the engine, and
await its events (a streamed request turns them into server-sent events). A client that goes away
cancels its request: a stream's generator is cancelled at once, a plain request notices within
``POLL`` seconds; either way its row leaves its batch and frees its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from d2o.serve.engine import Engine, Job
from d2o.serve.protocol import (
    CHAT,
    TEXT,
    APIError,
    ChatRequest,
    CompletionRequest,
    chunk,
    new_id,
    response,
    usage_chunk,
)
from d2o.serve.stats import render

POLL = 0.5  # seconds between checks that a non-streaming client is still there


class ClientGone(Exception):
    pass


def create_app(engine: Engine) -> FastAPI:
    """The OpenAI-compatible application serving ``engine`` (which the caller starts and closes)."""
    app = FastAPI(title="d2o", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        first = error.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = where[0] if where and not where[0].isdigit() else None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return await api_error(None, APIError(400, f"{'.'.join(where)}: {message}" if param else message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return await api_error(None, APIError(error.status_code, str(error.detail), kind=kind))

    @app.exception_handler(Exception)
    async def failure(_, error: Exception):
        return await api_error(None, APIError(500, f"internal error: {error!r}", kind="server_error"))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        turns = [message.as_turn() for message in body.messages]
        return await answer(engine, CHAT, body, turns, body.max_completion_tokens or body.max_tokens, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(engine, TEXT, body, body.prompt, body.max_tokens, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0, "owned_by": "d2o"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(render(engine.metrics(), engine.stats), media_type=CONTENT_TYPE_LATEST)

    return app


async def answer(engine: Engine, kind: str, body, prompt, max_tokens: int | None, request: Request):
    job = engine.prepare(body, prompt, kind == CHAT, max_tokens, asyncio.get_running_loop())
    engine.submit(job)
    rid, done = new_id(kind), False
    try:
        event, payload = await next_event(job, request)  # "started" once prefilled, or an error
        if event == "error":
            raise payload
        if body.stream:
            done = True  # the stream owns the job from here
            return JobStream(engine, job, stream(engine, job, kind, rid, body.include_usage),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        while event != "done":
            event, payload = await next_event(job, request)
            if event == "error":
                raise payload
        done = True
        return response(kind, rid, engine.name, payload.text, payload, extras(engine, job))
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not done:
            engine.cancel(job)


class JobStream(StreamingResponse):
    """A stream that cancels its job however it ends (a finished job ignores it): sent whole, its
    client gone (uvicorn says so), or its task cancelled (Ray Serve cancels a request's task when
    its client goes, and a background task would then never run)."""

    def __init__(self, engine: Engine, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine, self.job = engine, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.cancel(self.job)


async def next_event(job: Job, request: Request):
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), POLL)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ClientGone from None


async def stream(engine: Engine, job: Job, kind: str, rid: str, include_usage: bool):
    """Server-sent events: the text as it becomes final, the finish reason, the usage if asked.
    A client that goes away ends it; ``JobStream`` then cancels the job."""
    name, finished = engine.name, False
    usage = {"usage": None} if include_usage else {}  # every chunk but the last then says it has none
    if kind == CHAT:
        yield sse({**chunk(kind, rid, name, "", first=True), **usage})
    while not finished:
        event, payload = await job.events.get()
        finished = event != "delta"
        if event == "delta":
            yield sse({**chunk(kind, rid, name, payload), **usage})
        elif event == "done":
            yield sse({**chunk(kind, rid, name, None, payload.finish_reason), **usage})
            if include_usage:
                yield sse({**usage_chunk(kind, rid, name, payload), **extras(engine, job)})
        else:
            yield sse(payload.body())
    yield "data: [DONE]\n\n"


def extras(engine: Engine, job: Job) -> dict:
    """The cache the request ran with, and which server (replica) answered."""
    return {"kv_method": job.key[0], "kv_budget": job.key[1], "system_fingerprint": engine.fingerprint}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"



def run(config, host: str = "127.0.0.1", port: int = 8000) -> None:
    """``d2o serve``: load the model, serve it with uvicorn until interrupted."""
    import uvicorn

    engine = Engine.load(config)
    try:
        uvicorn.run(create_app(engine), host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.close()


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1"):
    """``app`` under uvicorn in a thread of this process, on a socket bound here (no port race);
    yields its base URL. For tests and benchmarks."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
