"""``VLLMEngine``: the :class:`~rlnb.engines.Engine` protocol on vLLM's ``AsyncLLM``.

vLLM runs ``EngineCore`` in a spawned child process and a ``Worker`` under it;
this process keeps the frontend, driven on the caller's event loop. A guard
process (``_guard``) kills both if this process dies without closing the
engine. Weights are loaded by a worker extension (``_vllm_worker``) reached with
``collective_rpc``, and each finished request reports which weight version
sampled each token (vLLM's weight-version spans).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from rlnb._errors import ClosedError, EngineError, InvalidValueError
from rlnb.config import EngineConfig, ModelConfig
from rlnb.engines._guard import Guard
from rlnb.engines._leftovers import engine_files, listening_sockets, remove_leftovers, socket_dir
from rlnb.engines._protocol import EngineStatistics, GenerateRequest, GenerateResult, PauseMode, PromptTooLong
from rlnb.engines._shared import DEFAULT_ENGINE, check_engine_config, check_model_config, deliver
from rlnb.engines._vllm_setup import (
    _FINISH,
    _WORKER_EXTENSION,
    _cancel,
    _check_model,
    _checkpoint_shapes,
    _Closed,
    _destroy,
    _in_thread,
    _Pending,
    _read_config,
    _retrieve,
    _stat_logger,
    _to_safetensors,
    _versions,
    import_vllm,
)
from rlnb.runtime import keep_zmq_gc, spawn_without_main

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """Serves a local Hugging Face model directory with vLLM; make one with
    ``await VLLMEngine.start(ModelConfig(path=...), EngineConfig(...), eos_id=...)`` on
    the event loop that will drive it.

    Semantics are :class:`~rlnb.engines.TinyEngine`'s: ``prefix_ids`` continue a
    partial rollout (only new tokens come back), each request samples with its
    own seed, log-probs are those of the distribution sampled from (after
    temperature, top-k and top-p), and every token carries the weight version that
    sampled it. ``close()`` stops vLLM's processes and waits for them to exit.
    """

    def __init__(
        self,
        llm: Any,
        guard: Guard,
        procs: list[psutil.Process],
        threads: list[threading.Thread],
        stats: dict[str, int],
        *,
        eos_id: int,
        max_len: int,
        name: str,
    ) -> None:
        self._llm = llm
        self._guard = guard
        self._procs = procs
        self._threads = threads
        self._stats = stats
        self._shapes: dict[str, tuple[int, ...]] = {}  # the checkpoint's, to vet a sync against
        self._mp_procs: list[Any] = []  # vLLM's multiprocessing.Process objects for EngineCore
        self._files: set[str] = set()  # what its processes would leave on disk (_leftovers)
        self._eos = eos_id
        self._max_len = max_len
        self.name = name
        self._lock = threading.Lock()
        self._sync = asyncio.Lock()
        self._version = 0
        self._paused: PauseMode | None = None
        self._pending: dict[int, _Pending] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._counts = {"finished": 0, "aborted": 0}
        self._closed = False
        self._loop: Callable[[], asyncio.AbstractEventLoop | None] = weakref.ref(asyncio.get_running_loop())

    @property
    def pids(self) -> tuple[int, ...]:
        """EngineCore's and its workers' process ids."""
        return tuple(p.pid for p in self._procs)

    @classmethod
    async def start(
        cls,
        model: ModelConfig,
        config: EngineConfig = DEFAULT_ENGINE,
        *,
        eos_id: int,
        seed: int = 0,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool = True,
        name: str = "rlnb-engine",
        prefix_caching: bool = True,
    ) -> VLLMEngine:
        """Start vLLM on ``model.path``; returns once it can generate (about 15 s on a CPU).

        ``model`` (a :class:`~rlnb.ModelConfig`): its ``path``, ``max_len`` and
        ``dtype`` are read. ``config`` (an :class:`~rlnb.EngineConfig`): its
        ``max_batch`` (sequences served together) and ``gpu_memory_utilization`` (the
        share of the GPU vLLM may take) are read.

        ``prefix_caching``: vLLM keeps the keys and values of prompts it has seen and
        reuses them for a request that starts the same way (a group's samples, a
        conversation's later turns); the cache is salted with the weight version, so
        nothing computed under old weights is reused after a sync.

        ``kv_cache_bytes`` None: 64 MiB on a CPU; on a GPU vLLM sizes the cache
        within ``gpu_memory_utilization``.
        Raises :class:`~rlnb.ConfigError` naming the path and field before any
        process starts when the configs, the directory, its ``config.json`` or the
        sizes do not fit, and :class:`~rlnb.EngineError` if vLLM fails to start
        (nothing is left running). Blocks only a thread of its own, not the loop.
        """
        model_dir = check_model_config(model, "VLLMEngine.start")
        check_engine_config(config, "VLLMEngine.start")
        path = Path(model_dir).expanduser().resolve()
        hf_config = _read_config(path)
        vllm = import_vllm()
        kv_cache_bytes = _check_model(
            path,
            hf_config,
            vllm,
            eos_id=eos_id,
            max_len=model.max_len,
            max_batch=config.max_batch,
            kv_cache_bytes=kv_cache_bytes,
            dtype=model.dtype,
        )
        # vllm's import keeps the frames it ran under alive (an exception it stores):
        # this frame is one of them, so vLLM is launched from another.
        sizes = (model.max_len, config.max_batch, kv_cache_bytes, config.gpu_memory_utilization)
        return await cls._launch(path, model.dtype, seed, sizes, (enforce_eager, prefix_caching), eos_id, name)

    @classmethod
    async def _launch(
        cls,
        path: Path,
        dtype: str,
        seed: int,
        sizes: tuple[int, int, int | None, float],
        flags: tuple[bool, bool],
        eos_id: int,
        name: str,
    ) -> VLLMEngine:
        vllm = import_vllm()
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        max_len, max_batch, kv_cache_bytes, gpu_memory_utilization = sizes
        enforce_eager, prefix_caching = flags
        # vLLM's CPU sampler cannot go on with a seeded request whose prefill was split
        # over two steps ("CPU Generator does not use offset": EngineCore dies), which
        # a step's token budget of 2048 does to long prompts, such as a conversation's
        # later turns: on a CPU a step takes every prefill whole.
        budget = {"max_num_batched_tokens": max(2048, max_batch * max_len)} if current_platform.is_cpu() else {}
        args = vllm.AsyncEngineArgs(
            model=str(path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_len,
            max_num_seqs=max_batch,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=prefix_caching,  # salted by weight version: see _run
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=True,
            **budget,
        )
        stats = {"running": 0, "waiting": 0, "tokens": 0, "steps": 0, "kv_cache_usage_pct": 0}
        before = set(threading.enumerate())

        sockets: list[str] = []  # the directory of vLLM's ipc:// sockets, once made

        def build() -> Any:
            with spawn_without_main(), socket_dir() as where:
                if where is not None:
                    sockets.append(where)
                    guard.send(f"remove {where}")
                return AsyncLLM.from_vllm_config(
                    args.create_engine_config(), stat_loggers=[_stat_logger(stats)], disable_log_stats=True
                )

        guard = Guard()
        guard.send("arm")
        ours_before = listening_sockets(os.getpid())

        def abandon(llm: Any) -> None:  # the caller gave up (Ctrl-C) while vLLM was starting
            with contextlib.suppress(Exception):
                llm.shutdown()
            guard.close(kill=True)

        try:
            llm = await _in_thread(build, abandon, name=f"{name}-start")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            guard.close(kill=True)
            raise EngineError(f"vLLM failed to start on {path}: {exc}") from exc
        try:
            threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("MPClient")]
            manager = llm.engine_core.resources.engine_manager
            core = [p.pid for p in getattr(manager, "processes", [])]
            workers = [int(pid) for pid in await llm.collective_rpc("rlnb_pid")]
            procs = guard.watch([*core, *workers])
            guard.send("disarm")
            # what a kill leaves on disk: its processes' sockets and shared memory, and
            # the socket dir (_leftovers); without one, the sockets this process bound
            files = engine_files([*core, *workers]) | (set(sockets) or listening_sockets(os.getpid()) - ours_before)
            for file in sorted(files):
                guard.send(f"remove {file}")
            await llm.update_weight_version("0")
        except BaseException:
            with contextlib.suppress(Exception):
                llm.shutdown()
            guard.close(kill=True)
            raise
        engine = cls(llm, guard, procs, threads, stats, eos_id=eos_id, max_len=max_len, name=name)
        engine._shapes = _checkpoint_shapes(path)
        engine._mp_procs = list(getattr(manager, "processes", []))
        engine._files = files
        return engine

    # -- the Engine protocol ----------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check_open()
        ids = [*request.prompt_ids, *request.prefix_ids]
        if len(ids) + 1 > self._max_len:
            raise PromptTooLong(
                f"request {request.request_id}: prompt and prefix take {len(ids)} tokens, "
                f"leaving no room in the model's context of {self._max_len}",
                tokens=len(ids),
                context=self._max_len,
            )
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[GenerateResult] = loop.create_future()
        task = loop.create_task(self._run(request, ids, waiter), name=f"{self.name}-{request.request_id}")
        task.add_done_callback(_retrieve)
        key = id(waiter)
        with self._lock:
            if self._closed:
                task.cancel()
                raise ClosedError("the engine is closed")
            self._pending[key] = (loop, waiter, task)
        try:
            return await waiter
        except asyncio.CancelledError:
            task.cancel()  # vLLM aborts the request when its stream is cancelled
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)

    async def abort(self, request_ids: list[str]) -> None:
        self._check_open()
        if request_ids:
            await self._llm.abort(list(request_ids))

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        mode = PauseMode(mode)
        self._check_open()
        self._paused = mode
        if mode is PauseMode.WAIT:
            self._pause_waiting()
            await asyncio.sleep(0)  # the pause is sent before anything asked for later
        else:
            await self._call(self._llm.pause_generation(mode=mode.value, clear_cache=False))

    async def resume(self) -> None:
        self._check_open()
        await self._call(self._llm.resume_generation())
        self._paused = None

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Load ``state`` (Hugging Face names, as in the model directory); later tokens
        carry ``version``. Raises ValueError, loading nothing, for a name the
        checkpoint lacks or a shape that differs: vLLM's worker dies on those."""
        self._check_open()
        self._vet(state)
        data = await asyncio.to_thread(_to_safetensors, state)  # off the loop: megabytes for a real model
        keep_zmq_gc()  # the send below starts it otherwise, for good
        async with self._sync:
            # Freeze the engine unless a pause already has, so no step runs between
            # loading the weights and labelling the tokens they sample.
            mode = self._paused
            freeze = mode is None or mode is PauseMode.WAIT
            if freeze:
                await self._call(self._llm.pause_generation(mode="keep", clear_cache=False))
            try:
                await self._call(self._llm.collective_rpc("rlnb_load_weights", args=(data,)))
                await self._call(self._llm.update_weight_version(str(version)))
                self._version = version
            finally:
                if freeze and not self._closed:
                    await self._call(self._llm.resume_generation())
                    if mode is PauseMode.WAIT:
                        self._pause_waiting()

    def statistics(self) -> EngineStatistics:
        with self._lock:
            in_flight = len(self._pending)
            running = min(self._stats["running"], in_flight)
            return EngineStatistics(
                version=self._version,
                paused=None if self._paused is None else self._paused.value,
                waiting=min(self._stats["waiting"], in_flight - running),
                running=running,
                finished=self._counts["finished"],
                aborted=self._counts["aborted"],
                generated_tokens=self._stats["tokens"],
                decode_steps=self._stats["steps"],
                extra={
                    "in_flight": in_flight,
                    "kv_cache_usage_pct": self._stats["kv_cache_usage_pct"],
                    "pids": self.pids,
                    "died": self._died(),
                },
            )

    def close(self, timeout: float | None = 10.0) -> None:
        """Abort what is pending (waiters get :class:`~rlnb.ClosedError`), shut vLLM
        down and wait for EngineCore and its workers to exit, killing them after
        ``timeout``; then let the guard go. Idempotent; blocks; any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            background, self._background = list(self._background), set()
        for loop, waiter, task in pending:
            deliver(loop, waiter, ClosedError("the engine closed"))
            _cancel(loop, task)
        for task in background:
            _cancel(task.get_loop(), task)
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        files = self._files | engine_files(self.pids)  # and any made since the start
        ctx = getattr(getattr(self._llm, "engine_core", None), "ctx", None)
        try:
            self._llm.shutdown(timeout=0)
        except Exception:  # what follows kills whatever it left
            pass
        if ctx is not None:
            self._destroy_context(ctx, max(0.1, deadline - time.monotonic()))
        # EngineCore is our child: multiprocessing must reap it (else it keeps its
        # pipes); the Worker is its child, watched through psutil.
        for proc in self._mp_procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        ours = {proc.pid for proc in self._mp_procs}
        others = [p for p in self._procs if p.pid not in ours]
        _, alive = psutil.wait_procs(others, timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._mp_procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5.0)
        remove_leftovers(files)  # the processes are gone: the sockets and shared memory they left
        for proc in self._mp_procs:
            with contextlib.suppress(ValueError):  # still running: the guard kills it
                proc.close()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._guard.close(kill=False)
        # AsyncLLM.__del__ shuts down again: let it run now rather than at interpreter
        # exit, when the modules it calls into are already torn down.
        self._llm = _Closed()

    # -- helpers ---

    def _destroy_context(self, ctx: Any, timeout: float) -> None:
        """Terminate the client's zmq context (its sockets and I/O threads), which
        ``AsyncLLM.shutdown`` leaves to the garbage collector. Its sockets belong to
        the loop, so it is done there, after the socket closes shutdown queued."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            _destroy(ctx)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _destroy(ctx)
            return
        done = threading.Event()

        def destroy() -> None:
            try:
                _destroy(ctx)
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(destroy)
        except RuntimeError:  # closed meanwhile
            _destroy(ctx)
            return
        done.wait(timeout)

    def _vet(self, state: Mapping[str, Any]) -> None:
        if not self._shapes:
            return  # no safetensors files to compare with
        for name, value in state.items():
            want = self._shapes.get(name)
            if want is None:
                raise InvalidValueError(f"update_weights: {name!r} is not a tensor of the served checkpoint")
            if tuple(value.shape) != want:
                raise InvalidValueError(
                    f"update_weights: {name!r} has shape {tuple(value.shape)}, the checkpoint's is {want}"
                )

    def _params(self, request: GenerateRequest, used: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=min(s.max_new_tokens, self._max_len - used),
            ignore_eos=s.ignore_eos,
            stop_token_ids=None if s.ignore_eos else [self._eos],
            seed=request.seed,
            logprobs=0,  # the sampled token's only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _run(self, request: GenerateRequest, ids: list[int], waiter: asyncio.Future[GenerateResult]) -> None:
        loop = asyncio.get_running_loop()
        version = self._version
        # Prefix-cache blocks computed under one weight version are never reused under another.
        prompt = {"type": "token", "prompt_token_ids": ids, "cache_salt": f"rlnb-weights-{version}"}
        final = None
        try:
            async for out in self._llm.generate(prompt, self._params(request, len(ids)), request.request_id):
                final = out
            if final is None:
                raise EngineError(f"vLLM returned nothing for request {request.request_id}")
            result = self._result(request, final.outputs[0], version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            deliver(loop, waiter, self._translate(exc))
            return
        deliver(loop, waiter, result)

    def _result(self, request: GenerateRequest, output: Any, version: int) -> GenerateResult:
        reason = _FINISH.get(str(output.finish_reason))
        if reason is None:
            raise EngineError(f"vLLM finished request {request.request_id} with {output.finish_reason!r}")
        tokens = tuple(int(t) for t in output.token_ids)
        logprobs = tuple(float(lp[t].logprob) for lp, t in zip(output.logprobs or [], tokens, strict=False))
        if len(logprobs) != len(tokens):
            raise EngineError(f"vLLM gave {len(logprobs)} log-probs for {len(tokens)} tokens")
        with self._lock:
            self._counts["aborted" if reason == "aborted" else "finished"] += 1
        return GenerateResult(request.request_id, tokens, logprobs, _versions(output, len(tokens), version), reason)

    def _pause_waiting(self) -> None:
        """Ask vLLM for a WAIT pause without waiting for it: its reply comes only once
        in-flight requests have drained (or never, if resumed first). It must not be
        cancelled while vLLM may still answer it, so it is kept until it does."""
        task = asyncio.get_running_loop().create_task(self._llm.pause_generation(mode="wait", clear_cache=False))
        task.add_done_callback(_retrieve)
        task.add_done_callback(self._background.discard)
        self._background.add(task)

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> Exception:
        if self._closed:
            return ClosedError("the engine closed")
        died = self._died()
        if died is not None:
            error = EngineError(f"{died}; close the session and make a new one")
            error.__cause__ = exc
            return error
        return exc

    def _died(self) -> str | None:
        try:
            dead = bool(self._llm.errored)
        except Exception:  # a half-shut-down client
            dead = True
        if not dead or self._closed:
            return None
        codes = []
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
            codes.append(str(proc.pid))
        return "the vLLM engine process died" + (f" (pid {', '.join(codes)} gone)" if codes else "")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")
        died = self._died()
        if died is not None:
            raise EngineError(f"{died}; close the session and make a new one")
