"""The endpoint's ASGI app (Starlette): routes, the bearer token, the body limit, and
a request that ends when its client goes away.

Every route is served at ``/v1/...`` (calls outside any episode) and at
``/episodes/{id}/v1/...`` (an agent episode's calls: its client's ``base_url``).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlnb._errors import ClosedError, InvalidValueError, RlnbError
from rlnb.engines import SamplingParams
from rlnb.rollout import Served, ServedChoice
from rlnb.serve._wire import (
    ChatRequest,
    CompletionRequest,
    WireError,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    parse,
)

__all__ = ["App", "Counts"]

_EPISODE = re.compile(r"^[0-9A-Za-z._-]{1,128}$")


class Counts:
    """What the app answered: requests, by status, and clients gone before their reply."""

    def __init__(self) -> None:
        self.requests = 0
        self.by_status: dict[int, int] = {}
        self.disconnected = 0

    def note(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1


class _Disconnected(Exception):
    """The client went away before its reply."""


class App:
    """The endpoint's app: serves ``served`` behind ``api_key`` (bodies up to
    ``max_body_bytes``, ``max_calls`` at once), answering as ``model``; ``defaults()`` gives the rollouts'
    sampling for fields a call leaves out; ``decode``/``piece`` give text of ids and
    of one token. :attr:`asgi` is the Starlette app; :meth:`cancel_all` ends every
    call in progress (the endpoint's close)."""

    def __init__(
        self,
        served: Served,
        *,
        api_key: str,
        model: str,
        max_body_bytes: int,
        max_calls: int,
        defaults: Callable[[], SamplingParams],
        decode: Callable[[list[int]], str],
        piece: Callable[[int], str],
    ) -> None:
        self._served, self._api_key, self.model = served, api_key, model
        self._max_body = max_body_bytes
        self._max_calls, self._active = max_calls, 0
        self._defaults, self._decode, self._piece = defaults, decode, piece
        self._calls: set[asyncio.Future[Any]] = set()
        self._closing = False
        self.counts = Counts()
        routes = []
        for prefix in ("", "/episodes/{episode}"):
            routes += [
                Route(f"{prefix}/v1/models", self._models, methods=["GET"]),
                Route(f"{prefix}/v1/chat/completions", self._chat, methods=["POST"]),
                Route(f"{prefix}/v1/completions", self._completions, methods=["POST"]),
            ]
        self.asgi = Starlette(routes=routes)
        self.asgi.add_exception_handler(404, self._not_found)
        self.asgi.add_exception_handler(405, self._not_allowed)

    def cancel_all(self) -> None:
        """Cancel every call in progress: their clients get 503."""
        self._closing = True
        for task in list(self._calls):
            task.cancel()

    # -- routes ------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return await self._answer(request, self._list_models)

    async def _chat(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._complete(request, "chat"))

    async def _completions(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._complete(request, "completion"))

    async def _list_models(self) -> Response:
        created = int(time.time())
        data = [{"id": self.model, "object": "model", "created": created, "owned_by": "rlnb"}]
        return JSONResponse({"object": "list", "data": data})

    async def _answer(self, request: Request, handle: Callable[[], Coroutine[Any, Any, Response]]) -> Response:
        """``handle()``'s response, once the token is checked; each refusal as OpenAI's error JSON."""
        self.counts.requests += 1
        self._active += 1
        try:
            self._authorize(request)
            if self._active > self._max_calls:
                raise WireError(
                    503,
                    f"the endpoint serves {self._max_calls} calls at once and has as many in progress: try again "
                    "(sess.serve(max_concurrency=...) sets how many)",
                    type="server_error",
                )
            response = await handle()
        except WireError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status)
        except (_Disconnected, ClientDisconnect):
            self.counts.disconnected += 1
            response = Response(status_code=499)
        finally:
            self._active -= 1
        self.counts.note(response.status_code)
        return response

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise WireError(
                401,
                "no valid API key: send the endpoint's key as 'Authorization: Bearer <key>' "
                "(sess.serve().api_key; sess.serve().client() sends it)",
                type="authentication_error",
            )
        episode = request.path_params.get("episode")
        if episode is not None and not _EPISODE.match(episode):
            raise WireError(404, f"no episode {episode!r}")

    async def _complete(self, request: Request, kind: str) -> Response:
        body = await self._body(request)
        parsed, served_request = parse(
            kind, body, defaults=self._defaults(), episode=request.path_params.get("episode")
        )
        choices = await self._until_disconnect(request, self._served.serve(served_request))
        version = max((c.version for c in choices if c.version is not None), default=None)
        headers = {} if version is None else {"x-rlnb-policy-version": str(version)}
        if parsed.stream:
            return StreamingResponse(
                _sse(self._chunks(parsed, choices)), media_type="text/event-stream", headers=headers
            )
        if isinstance(parsed, ChatRequest):
            return JSONResponse(chat_response(parsed, choices, piece=self._piece), headers=headers)
        return JSONResponse(completion_response(parsed, choices, piece=self._piece), headers=headers)

    def _chunks(self, parsed: Any, choices: list[ServedChoice]) -> Iterator[dict[str, Any]]:
        if isinstance(parsed, ChatRequest):
            return chat_chunks(parsed, choices, piece=self._piece, decode=self._decode)
        assert isinstance(parsed, CompletionRequest)
        return completion_chunks(parsed, choices, piece=self._piece, decode=self._decode)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body:
            raise WireError(413, self._too_big(int(declared)))
        # A call of its own, so that a close ends a client stuck mid-body with 503 at once
        # (uvicorn would wait for it, then cancel it with a traceback on stderr).
        read = asyncio.ensure_future(self._read(request))
        self._calls.add(read)
        try:
            return await read
        except asyncio.CancelledError:
            if read.cancelled() and self._closing:
                raise WireError(503, "the endpoint is closing (its session closes)", type="server_error") from None
            raise
        finally:
            self._calls.discard(read)
            read.cancel()

    async def _read(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body:
                raise WireError(413, self._too_big(size))
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_big(self, size: int) -> str:
        return (
            f"the body takes {size:,} bytes or more, over the endpoint's limit of {self._max_body:,} "
            "(sess.serve(max_body_bytes=...))"
        )

    async def _until_disconnect(
        self, request: Request, call: Coroutine[Any, Any, list[ServedChoice]]
    ) -> list[ServedChoice]:
        """``call``'s result; cancelled (its generation freed in the engine) if the
        client goes away first. Its failures as the client's errors."""
        task = asyncio.ensure_future(call)
        self._calls.add(task)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise _Disconnected
            return task.result()
        except asyncio.CancelledError:
            if task.cancelled() and not watch.done():  # the endpoint closes: not the client's doing
                raise WireError(503, "the endpoint is closing (its session closes)", type="server_error") from None
            raise
        except InvalidValueError as exc:
            raise WireError(400, str(exc)) from None
        except ClosedError as exc:
            raise WireError(503, f"the session is closed: {exc}", type="server_error") from None
        except RlnbError as exc:
            raise WireError(500, f"generation failed: {exc}", type="server_error") from None
        finally:
            watch.cancel()
            self._calls.discard(task)
            if not task.done():
                task.cancel()

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        error = WireError(
            404,
            f"no route {request.method} {request.url.path}: the endpoint serves /v1/chat/completions, "
            "/v1/completions and /v1/models",
            type="not_found_error",
        )
        self.counts.note(404)
        return JSONResponse(error.body(), status_code=404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        error = WireError(405, f"{request.method} is not allowed on {request.url.path}")
        self.counts.note(405)
        return JSONResponse(error.body(), status_code=405)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse(chunks: Iterator[dict[str, Any]]) -> Any:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
