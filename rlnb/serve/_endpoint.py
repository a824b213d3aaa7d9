"""``Endpoint``: an OpenAI-compatible server on the session's engine, owned by the session.

uvicorn serves the app (:mod:`rlnb.serve._app`) as a task on the session's bridge
loop, the loop the rollouter and the engine live on, from a socket bound before it
starts (so the port is known at once and nothing else can take it). It binds
loopback and makes a bearer token of its own unless told otherwise; close stops
accepting, ends the calls in progress (their clients get 503) and the server's
connections, within a deadline. It is in the session's process, so a kernel restart
or a SIGKILL of the owner takes it down with the socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from rlnb._checks import check_int, require
from rlnb._errors import ConfigError, StateError, WaitTimeoutError
from rlnb.engines import SamplingParams
from rlnb.rollout import Served, ServedCall, ServedStatistics
from rlnb.runtime import AsyncBridge

__all__ = ["Endpoint", "EndpointStatistics", "ServeConfig"]

_START_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How ``sess.serve()`` serves.

    host: the address to listen on; loopback (``"127.0.0.1"``) by default. Any other
        is reachable from outside this machine: give it on purpose.
    port: 0 (the default) takes a free port.
    api_key: the bearer token clients must send; None makes a random one
        (``Endpoint.api_key``).
    max_body_bytes: a request body over this is refused with 413.
    max_concurrency: calls served at once; past it, 503 (connections, idle ones
        included, up to four times as many and 64 more).
    model: the model name ``/v1/models`` lists (None: the session's name); a call may
        name any model: the session's policy answers.
    """

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_concurrency: int = 512
    model: str | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.host, str) and bool(self.host), "ServeConfig.host", self.host, 'use "127.0.0.1"')
        check_int("ServeConfig.port", self.port, minimum=0, example="port=0 (a free one)")
        require(self.port <= 65535, "ServeConfig.port", self.port, "use a port in 0..65535 (0: a free one)")
        require(
            self.api_key is None or (isinstance(self.api_key, str) and len(self.api_key) >= 16),
            "ServeConfig.api_key",
            "<hidden>" if isinstance(self.api_key, str) else self.api_key,
            "use None (a random one), or a string of at least 16 characters",
        )
        check_int("ServeConfig.max_body_bytes", self.max_body_bytes, minimum=1024, example="max_body_bytes=8_388_608")
        check_int("ServeConfig.max_concurrency", self.max_concurrency, minimum=1, example="max_concurrency=512")
        require(
            self.model is None or (isinstance(self.model, str) and bool(self.model)),
            "ServeConfig.model",
            self.model,
            "use None (the session's name) or a non-empty string",
        )

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


@dataclasses.dataclass(frozen=True)
class EndpointStatistics:
    """The endpoint's requests (``requests``; by HTTP status; clients gone before
    their reply) and its served completions (:class:`~rlnb.rollout.ServedStatistics`)."""

    requests: int
    by_status: dict[int, int]
    disconnected: int
    served: ServedStatistics


class Endpoint:
    """The session's OpenAI-compatible server (``sess.serve()`` makes it; the session
    closes it). ``base_url`` and ``api_key`` are what a client needs; :meth:`client`
    makes one. Calls go to ``served`` (the session's rollouts) on ``bridge``'s loop."""

    def __init__(
        self,
        served: Served,
        config: ServeConfig,
        *,
        bridge: AsyncBridge,
        name: str,
        defaults: Callable[[], SamplingParams],
        decode: Callable[[list[int]], str],
    ) -> None:
        try:
            import uvicorn

            from rlnb.serve._app import App
        except ImportError as exc:
            raise ConfigError(
                f"sess.serve() needs the server packages ({exc.name} is missing): pip install 'rlnb[serve]'"
            ) from None
        self.config = config
        self.api_key = config.api_key or f"rlnb-{secrets.token_urlsafe(24)}"
        self._bridge = bridge
        self._app = App(
            served,
            api_key=self.api_key,
            model=config.model or name,
            max_body_bytes=config.max_body_bytes,
            max_calls=config.max_concurrency,
            defaults=defaults,
            decode=decode,
            piece=lambda token: decode([token]),
        )
        self._served = served
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((config.host, config.port))
            self._socket.listen(min(config.max_concurrency, socket.SOMAXCONN))
            self._socket.setblocking(False)
        except OSError as exc:
            self._socket.close()
            raise ConfigError(f"sess.serve() cannot listen on {config.host}:{config.port}: {exc}") from None
        self.host, self.port = config.host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(
                self._app.asgi,
                log_config=None,  # leave the process's logging as it is
                access_log=False,
                lifespan="off",
                # The app refuses calls past max_concurrency itself (503 in OpenAI's shape); uvicorn's
                # own limit, which counts idle keep-alive connections too and answers in plain text
                # on stderr, is only a backstop.
                limit_concurrency=4 * config.max_concurrency + 64,
                timeout_graceful_shutdown=1,
                # Longer than a client keeps an idle connection (httpx: 5 s): with equal times the
                # client could send on a connection the server was closing, and the call failed
                # ("Server disconnected"; an agent's client does not retry, it would serve twice).
                timeout_keep_alive=75,
            )
        )
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        try:
            bridge.run(self._start(), timeout=_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    @property
    def model(self) -> str:
        return self._app.model

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: a client's ``base_url``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def episode_url(self, episode: str) -> str:
        """The ``base_url`` of one agent episode's calls."""
        return self.base_url.removesuffix("/v1") + f"/episodes/{episode}/v1"

    @property
    def closed(self) -> bool:
        return self._closed

    def client(self, *, sync: bool = False, episode: str | None = None, **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` for this endpoint (``sync``: an ``openai.OpenAI``),
        with its key; ``options`` go to the client (``timeout=``, ``max_retries=``, ...).
        ``episode``: a client whose calls belong to that agent episode."""
        if self._closed:
            raise StateError("the endpoint is closed: sess.serve() starts it again")
        try:
            import openai
        except ImportError:
            raise ConfigError("Endpoint.client() needs the openai package: pip install 'rlnb[serve]'") from None
        url = self.base_url if episode is None else self.episode_url(episode)
        kind = openai.OpenAI if sync else openai.AsyncOpenAI
        return kind(base_url=url, api_key=self.api_key, **options)

    def agent_client(self, *, sync: bool = False) -> tuple[Any, Callable[[], Any]]:
        """The client agent episodes get copies of (``with_options(base_url=``
        :meth:`episode_url` ``)``), and what closes its connections (a coroutine
        function for an async one). Its calls are not retried (a retry would be served,
        and trained on, twice) and never time out (a pause holds a call as long as it
        lasts; ``Task.agent_timeout`` bounds the episode); an episode's client closing
        leaves the shared connections open."""
        if self._closed:
            raise StateError("the endpoint is closed: sess.serve() starts it again")
        import openai

        if sync:
            pool: Any = _pool_classes()[1](timeout=None)
            client: Any = openai.OpenAI(
                base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=None, http_client=pool
            )
        else:
            pool = _pool_classes()[0](timeout=None)
            client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=None, http_client=pool
            )
        return client, pool.close_pool

    def statistics(self) -> EndpointStatistics:
        counts = self._app.counts
        return EndpointStatistics(
            requests=counts.requests,
            by_status=dict(counts.by_status),
            disconnected=counts.disconnected,
            served=self._served.statistics(),
        )

    def log(self) -> list[ServedCall]:
        """The latest calls served, oldest first (also those of the session's rollouts)."""
        return self._served.log()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.base_url
        return f"<rlnb Endpoint {state} model={self.model!r}>"

    async def _start(self) -> None:
        server = self._server
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[self._socket]), name="rlnb-endpoint")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if self._task.done():
                self._task.result()  # its failure
                raise StateError("the endpoint's server stopped before it started")
            if time.monotonic() > deadline:
                raise WaitTimeoutError(f"the endpoint's server did not start within {_START_TIMEOUT_S} s")
            await asyncio.sleep(0.005)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting calls, end those in progress (503) and the connections, within
        ``timeout`` s; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._task is not None and not self._bridge.closed:
                self._bridge.run(self._stop(timeout), timeout=timeout + 1.0)
        finally:
            self._socket.close()

    async def _stop(self, timeout: float) -> None:
        task = self._task
        if task is None:
            return
        self._app.cancel_all()
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            self._server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except Exception:  # the server failed on its way out: it is gone all the same
            pass


@functools.cache
def _pool_classes() -> tuple[type[Any], type[Any]]:
    import openai

    class AsyncPool(openai.DefaultAsyncHttpxClient):
        """Connections shared by agent episodes' clients: closing one leaves them open."""

        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    class SyncPool(openai.DefaultHttpxClient):
        """Connections shared by agent episodes' clients: closing one leaves them open."""

        def close(self) -> None:
            pass

        def close_pool(self) -> None:
            super().close()

    return AsyncPool, SyncPool
