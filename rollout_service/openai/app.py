"""The FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health.

Every route but /health needs the bearer token. A call runs the client's synchronous work on the app's own
threads (one per in-flight call), never on the event loop, so one slow call blocks no other; at most
`max_in_flight` calls run at once and the next is a 429 with Retry-After. While a call waits for its
samples the app watches its connection: a client gone mid-call aborts the request and leaves its session
as it was, and nothing else notices.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout_service.api.deltas import TokenDelta
from rollout_service.openai import calls, responses as out
from rollout_service.openai.auth import check_bearer, resolve_token
from rollout_service.openai.schemas import ApiError, Limits, parse_chat, parse_completion
from rollout_service.openai.templates import renderer_for
from rollout_service.openai.token_stream import CallStream, Diverged
from rollout_service.openai.tool_calls import reads_by_template
from rollout_service.openai.trajectories import remember_store, sessions_for

logger = logging.getLogger("rollout_service.openai")
POLL_S = 0.1  # how often a waiting call looks at its connection


class ClientGone(Exception):
    """The HTTP client disconnected while its call ran."""


class Runtime:
    """An app's moving parts: the service, its threads, the in-flight count (touched on the loop only)."""

    def __init__(self, svc: calls.Service):
        self.svc = svc
        self.pool = ThreadPoolExecutor(svc.limits.max_in_flight + 2, thread_name_prefix="openai")
        self.in_flight = 0

    def enter(self) -> None:
        if self.in_flight >= self.svc.limits.max_in_flight:
            raise ApiError(429, f"this server runs at most {self.svc.limits.max_in_flight} calls at once: retry "
                                "shortly", None, "too_many_requests", "rate_limit_error", {"Retry-After": "1"})
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def next(self, it: Any, p: calls.Prepared, request: Request) -> Any:
        """The call's next sample, watching the connection meanwhile (ClientGone if it drops)."""
        return await self.watched(request, calls.next_result, it, p)

    async def watched(self, request: Request, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the app's threads, watching the connection meanwhile (ClientGone if it drops)."""
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        fut.add_done_callback(_retrieved)  # a call given up on (client gone) still ends, maybe in an error
        while True:
            done, _ = await asyncio.wait({fut}, timeout=POLL_S)
            if done:
                return fut.result()
            if await request.is_disconnected():
                raise ClientGone()

    def abort(self, p: calls.Prepared) -> None:
        """Abort the call's request in the background (the loop must not wait on the service)."""
        self.pool.submit(_quietly, self.svc.client.abort, [p.request.request_id])


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # marks it read: asyncio would log an error nobody awaited


def _quietly(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # an abort of a request already gone, a closed client: nothing left to stop
        logger.debug(f"openai: abort failed: {e}")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, read no further than `limit` bytes (413 past it)."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"request body over this server's bound of {limit} bytes", None, "body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise too_big
    try:
        body = json.loads(data)
    except ValueError as e:
        raise ApiError(400, f"body: not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object", None, "invalid_json")
    return body


class _Whole:
    """A call answered in one body: prepared, run and recorded in one go on a thread (each hop between the loop and
    a thread adds to its latency), while the loop watches the connection. A client gone first makes the thread
    submit nothing; gone later, its request is aborted and its session left as it was."""

    def __init__(self, rt: Runtime, call: Any, prepare: Callable):
        self.rt, self.call, self.prepare = rt, call, prepare
        self.p: calls.Prepared | None = None
        self.gone = False

    def run(self) -> tuple[calls.Prepared, list]:
        svc = self.rt.svc
        p = self.prepare(svc, self.call)
        try:
            self.p = p
            if self.gone:
                raise ClientGone()
            it = calls.open_stream(svc, p)
            if self.gone:  # the client left while the request was queued: the loop's abort may have come first
                self.rt.abort(p)
            results = calls.collect(it, p)
            if self.gone:
                raise ClientGone()
            calls.settle(svc, p, results)
            return p, results
        finally:
            calls.done(svc, p)

    async def answer(self, request: Request) -> tuple[calls.Prepared, list]:
        try:
            return await self.rt.watched(request, self.run)
        except BaseException:
            self.gone = True
            if self.p is not None:
                self.rt.abort(self.p)
            raise


def _chat_body(rt: Runtime, p: calls.Prepared, call: Any, results: list) -> dict:
    body = out.envelope("chat.completion", out.new_id("chatcmpl"), rt.svc.model,
                        choices=[out.chat_choice(r, rt.svc.renderer, call.logprobs, _offered(call, p))
                                 for r in results],
                        usage=out.usage(len(p.prompt_ids), results), prompt_token_ids=list(p.prompt_ids))
    if call.session_id is not None:
        body.update(session_id=call.session_id, drift=p.drifted)
    return body


def _offered(call: Any, p: calls.Prepared) -> out.Tools:
    return out.Tools(call.tools, call.tool_choice, p.prompt_ids)


def _completion_body(rt: Runtime, p: calls.Prepared, call: Any, results: list) -> dict:
    return out.envelope("text_completion", out.new_id("cmpl"), rt.svc.model,
                        choices=[out.completion_choice(r, rt.svc.renderer, call.logprobs) for r in results],
                        usage=out.usage(len(p.prompt_ids), results))


class _Stream(StreamingResponse):
    """A stream that lets go of its call's slot and session however it ends: also when the connection fails
    before the body began (the generator, never started, would run no finally of its own)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # runs the generator's finally now (abort), not at GC
            finally:
                self._release()


def _releaser(rt: Runtime, p: calls.Prepared) -> Callable[[], None]:
    """The call's release of its session and slot, to be called once or more (it acts once)."""
    held = {"slot": True}

    def release() -> None:
        if held["slot"]:
            held["slot"] = False
            calls.done(rt.svc, p)
            rt.leave()
    return release


async def _events(rt: Runtime, p: calls.Prepared, call: Any, chat: bool, request: Request,
                  release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The SSE stream of one call: role chunks at once (chat), each choice's text as it is sampled (a chat call
    that may call tools: its content while surely content, the calls at the end; where a tokenizer's response
    template reads the calls, each choice whole once done), the usage chunk if asked for, then `data: [DONE]`. An
    error after the stream began is an error event."""
    rid, model, results, finished, failed = out.new_id("chatcmpl" if chat else "cmpl"), rt.svc.model, [], False, False
    tools = _offered(call, p) if chat and call.tools and call.tool_choice != "none" else None
    whole = tools is not None and reads_by_template(rt.svc.renderer.tokenizer)  # a format read once done
    pieces = None if whole else CallStream(rt.svc.renderer, call.sampling.stop, chat, call.logprobs, rid, model,
                                           tools)
    try:
        for i in range(call.sampling.n if chat else 0):
            yield out.sse(out.chat_role_chunk(i, rid, model))
        it = await rt.run(calls.open_stream, rt.svc, p, pieces is not None)
        while (r := await rt.next(it, p, request)) is not None:
            if isinstance(r, TokenDelta):
                if (chunk := pieces.on_delta(r)) is not None:
                    yield out.sse(chunk)
                continue
            results.append(r)
            yield out.sse(_last_chunk(rt, r, call, p, chat, pieces, rid))
        finished = True
        calls.settle(rt.svc, p, results)  # after the chunks went out: a client gone before them left no record
        if call.include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            yield out.sse(out.envelope(kind, rid, model, choices=[], usage=out.usage(len(p.prompt_ids), results)))
        yield out.sse("[DONE]")
    except ApiError as e:
        failed = True
        yield out.sse(e.body())
        yield out.sse("[DONE]")
    except ClientGone:  # seen by our polling; the server may instead cancel this generator: the same below
        pass
    finally:
        if not finished:
            rt.abort(p)
            if not failed:
                logger.info(f"openai: client gone mid-stream; request {p.request.request_id} aborted")
        release()


def _last_chunk(rt: Runtime, r: Any, call: Any, p: calls.Prepared, chat: bool, pieces: CallStream | None,
                rid: str) -> dict:
    """A finished choice's chunk: the rest of its text, or (not token-streamed) all of it."""
    if pieces is not None:
        try:
            return pieces.on_result(r)
        except Diverged as e:
            raise ApiError(503, str(e), None, "regenerated", "server_error", {"Retry-After": "1"}) from None
    renderer, model = rt.svc.renderer, rt.svc.model
    return (out.chat_chunk(r, renderer, call.logprobs, rid, model, _offered(call, p)) if chat
            else out.completion_chunk(r, renderer, call.logprobs, rid, model))


async def _serve(rt: Runtime, request: Request, call: Any, prepare: Callable, to_body: Callable) -> Response:
    rt.enter()
    if not call.stream:
        try:
            p, results = await _Whole(rt, call, prepare).answer(request)
            return JSONResponse(to_body(rt, p, call, results))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the connection is gone
        finally:
            rt.leave()
    try:
        p = await rt.run(prepare, rt.svc, call)
    except BaseException:
        rt.leave()
        raise
    release = _releaser(rt, p)
    return _Stream(_events(rt, p, call, to_body is _chat_body, request, release), release)


def _model_name(client: Any, model_name: str | None) -> str:
    if model_name is not None:
        return model_name
    model = getattr(getattr(getattr(client, "engine", None), "config", None), "model", None)
    return model if isinstance(model, str) else "rollout-service"


def openai_app(client: Any, *, token: str | None = None, token_file: Any = None, tokenizer: Any = None,
               model_name: str | None = None, limits: Limits | None = None, **limit_overrides: Any) -> FastAPI:
    """An OpenAI-compatible FastAPI app in front of `client` (a RolloutClient; docs/openai.md).

    `token`: the bearer token callers must send; None makes a new one, written to `token_file` (default
    ~/.rollout_service/openai_token, mode 0600); read it back from `app.state.token`. `tokenizer`: the model's
    (default: the in-process engine's; a Ray client needs it given). `model_name`: what /v1/models lists.
    `limits` or keyword overrides of its fields (schemas.Limits): body bytes, n × max_tokens, n, default
    max_tokens, calls in flight, sessions held and their idle timeout."""
    limits = Limits.of(limits, **limit_overrides)
    token, path = resolve_token(token, token_file)
    sessions = sessions_for(client, limits)
    rt = Runtime(calls.Service(client, renderer_for(client, tokenizer), sessions, limits, _model_name(client, model_name)))
    app = FastAPI(title="rollout_service OpenAI endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.token, app.state.token_file, app.state.sessions, app.state.runtime = token, path, sessions, rt
    remember_store(client, sessions)
    _routes(app, rt, token)
    return app


def _routes(app: FastAPI, rt: Runtime, token: str) -> None:
    limits = rt.svc.limits

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:  # still OpenAI's shape, and logged
        logger.exception(f"openai: {request.url.path} failed")
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error",
                                     "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_bearer(request.headers.get("authorization"), token)
        return {"object": "list", "data": [{"id": rt.svc.model, "object": "model", "created": 0,
                                            "owned_by": "rollout_service"}]}

    async def chat(request: Request) -> Response:
        check_bearer(request.headers.get("authorization"), token)
        call = parse_chat(await read_json(request, limits.max_body_bytes), limits, request.headers.get("x-session-id"))
        return await _serve(rt, request, call, calls.prepare_chat, _chat_body)

    async def completions(request: Request) -> Response:
        check_bearer(request.headers.get("authorization"), token)
        call = parse_completion(await read_json(request, limits.max_body_bytes), limits)
        return await _serve(rt, request, call, calls.prepare_completion, _completion_body)

    # plain Starlette routes: they take the Request as it is, so FastAPI's per-call parameter solving (~0.1 ms of
    # a call's added latency) is skipped; the app's middleware and error handlers still apply
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
