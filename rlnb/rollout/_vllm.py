"""``VLLMEngine``: the :class:`~rlnb.rollout.Engine` protocol on vLLM's ``AsyncLLM``.

vLLM runs ``EngineCore`` in a spawned child process and a ``Worker`` under it;
this process keeps the frontend, driven on the caller's event loop. A guard
process (``_vllm_guard``) kills both if this process dies without closing the
engine. Weights are loaded by a worker extension (``_vllm_worker``) reached with
``collective_rpc``, and each finished request reports which weight version
sampled each token (vLLM's weight-version spans).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing.spawn
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from rlnb._errors import ClosedError, ConfigError, EngineError
from rlnb.rollout import _vllm_guard
from rlnb.rollout._engine import EngineStatistics, GenerateRequest, GenerateResult, PauseMode

__all__ = ["VLLMEngine", "compare_logprobs", "import_vllm"]

_WORKER_EXTENSION = "rlnb.rollout._vllm_worker.RlnbWorkerExtension"
_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def import_vllm() -> Any:
    """Import vllm (its import trips torch's deprecation of ``torch.jit.script_method``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*torch.jit.script_method", DeprecationWarning)
        import vllm
        import vllm.v1.engine.async_llm
    return vllm


# -- checks made before any process starts ------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ConfigError(f"model_dir={str(path)!r} is not a directory: give a local Hugging Face model directory")
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model_dir={str(path)!r} has no config.json: is it a Hugging Face model directory?"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot be read as JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: holds {type(config).__name__}, not a JSON object")
    return config


def _check_model(
    path: Path,
    config: Mapping[str, Any],
    vllm: Any,
    *,
    eos_id: int,
    max_len: int,
    max_batch: int,
    kv_cache_bytes: int,
    dtype: str,
) -> None:
    """Raise ConfigError naming the file and field that vLLM would fail on later."""
    file = path / "config.json"
    for field, value in (("max_len", max_len), ("max_batch", max_batch), ("kv_cache_bytes", kv_cache_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"VLLMEngine.start({field}={value!r}): must be a positive int")
    archs = config.get("architectures")
    supported = vllm.ModelRegistry.get_supported_archs()
    if not isinstance(archs, list) or not any(a in supported for a in archs):
        raise ConfigError(
            f"{file}: architectures={archs!r} is not a model vLLM {vllm.__version__} can serve "
            "(for example LlamaForCausalLM or Qwen2ForCausalLM)"
        )
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    vocab = text.get("vocab_size")
    if isinstance(vocab, int) and not 0 <= eos_id < vocab:
        raise ConfigError(f"eos_id={eos_id} is outside {file}'s vocab_size={vocab}")
    positions = text.get("max_position_embeddings")
    if isinstance(positions, int) and max_len > positions:
        raise ConfigError(f"max_len={max_len} exceeds {file}'s max_position_embeddings={positions}")
    try:
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{file}: lacks or garbles {exc} (needed to size the KV cache)") from None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ConfigError(f"{file}: head_dim={head_dim} is not one vLLM's CPU attention supports ({sizes})")
    width = _DTYPE_BYTES.get(dtype, 4)
    per_token = 2 * layers * kv_heads * head_dim * width
    if per_token * max_len > kv_cache_bytes:
        raise ConfigError(
            f"kv_cache_bytes={kv_cache_bytes} cannot hold one sequence of max_len={max_len} for {file} "
            f"({per_token} bytes a token): give at least kv_cache_bytes={per_token * max_len}"
        )


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the directory's safetensors files, read from their headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(entry["shape"])
    return shapes


# -- starting vLLM --------------------------------------------------------------------


@contextlib.contextmanager
def _spawn_without_main() -> Iterator[None]:
    """Spawned children started by this thread do not re-run the ``__main__`` script.

    vLLM's CPU build spawns EngineCore, and a spawned child normally re-imports the
    parent's main script, which would start another engine unless the script
    guards itself with ``if __name__ == "__main__":``. EngineCore's target lives in
    vllm, so the child never needs the script. Only this thread's spawns are changed.
    """
    original = multiprocessing.spawn.get_preparation_data
    me = threading.current_thread()

    def preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if threading.current_thread() is me:
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = original


class _Guard:
    """The orphan-killing watchdog: a subprocess told which pids to kill if we die."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, _vllm_guard.__file__, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to our process group must not reach it
        )
        self._lock = threading.Lock()

    def send(self, line: str) -> None:
        with self._lock:
            stdin = self.proc.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line.encode() + b"\n")
                stdin.flush()
            except OSError:  # it died: nothing to tell
                pass

    def watch(self, pids: Sequence[int]) -> list[psutil.Process]:
        procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                self.send(f"watch {pid} {proc.create_time()!r}")
                procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        return procs

    def close(self, *, kill: bool, timeout: float = 5.0) -> None:
        """Let it go (``kill``: after it kills what it watches)."""
        if not kill:
            self.send("bye")
        with self._lock:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _in_thread(fn: Callable[[], Any], on_abandon: Callable[[Any], None], name: str) -> Any:
    """Run blocking ``fn`` on a thread of its own; if the caller is cancelled first,
    ``on_abandon`` gets what ``fn`` returns when it does."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    abandoned = threading.Event()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:
            value, error = None, exc
        if abandoned.is_set():
            if error is None:
                on_abandon(value)
            return
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed under us
            if error is None:
                on_abandon(value)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        value = await future
    except asyncio.CancelledError:
        abandoned.set()
        if future.done() and not future.cancelled() and future.exception() is None:
            on_abandon(future.result())  # it finished, but nobody will use it
        raise
    finally:
        if not abandoned.is_set():
            thread.join()  # it has handed its result over: this returns at once
    return value


def _stat_logger(stats: dict[str, int]) -> Callable[..., Any]:
    """A vLLM stat-logger factory that keeps the scheduler's counts in ``stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Counts(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                stats["running"] = scheduler_stats.num_running_reqs
                stats["waiting"] = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                stats["kv_cache_usage_pct"] = round(100 * scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:
                stats["tokens"] += iteration_stats.num_generation_tokens
                stats["steps"] += 1

        def log_engine_initialized(self) -> None:
            pass

    return Counts


def _versions(output: Any, count: int, fallback: int) -> tuple[int, ...]:
    """The weight version of each of ``count`` tokens, from vLLM's version spans."""
    spans = output.weight_versions
    if not spans:
        return (fallback,) * count
    out = [fallback] * count
    for span in spans:
        version = int(span.version) if str(span.version).isdigit() else fallback
        out[span.start : span.end] = [version] * (span.end - span.start)
    return tuple(out)


_Pending = tuple[asyncio.AbstractEventLoop, "asyncio.Future[GenerateResult]", "asyncio.Task[None]"]


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], outcome: Any) -> None:
    """Resolve ``future`` from any thread (a no-op once it is done or its loop is gone)."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed: nobody is waiting any more
        pass


def _cancel(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(task.cancel)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A done callback: a background task's error is expected and already handled."""
    if not task.cancelled():
        task.exception()


def _destroy(ctx: Any) -> None:
    """Close a zmq context's sockets and terminate it. vLLM's asyncio context shadows
    a plain one, which shares the terminated libzmq context but would still warn,
    when collected, that it was never closed: it is marked closed too."""
    ctx.destroy(linger=0)
    underlying = getattr(ctx, "_shadow_obj", None)
    if underlying is not None and not isinstance(underlying, int):
        with contextlib.suppress(AttributeError):
            underlying.closed = True


def _to_safetensors(state: Mapping[str, Any]) -> bytes:
    from safetensors.torch import save

    # Copies: safetensors refuses tensors that share storage (tied embeddings).
    return save({name: value.detach().to("cpu", copy=True).contiguous() for name, value in state.items()})


class _Closed:
    """Stands in for the AsyncLLM once the engine closed."""

    errored = False


class VLLMEngine:
    """Serves a local Hugging Face model directory with vLLM; make one with
    ``await VLLMEngine.start(...)`` on the event loop that will drive it.

    Semantics are :class:`~rlnb.rollout.TinyEngine`'s: ``prefix_ids`` continue a
    partial rollout (only new tokens come back), each request samples with its
    own seed, log-probs are those of the distribution sampled from (after
    temperature, top-k and top-p), and every token carries the weight version that
    sampled it. ``close()`` stops vLLM's processes and waits for them to exit.
    """

    def __init__(
        self,
        llm: Any,
        guard: _Guard,
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
        model_dir: str | os.PathLike[str],
        *,
        eos_id: int,
        max_len: int,
        max_batch: int,
        seed: int = 0,
        kv_cache_bytes: int = 64 << 20,
        dtype: str | None = None,
        enforce_eager: bool = True,
        name: str = "rlnb-engine",
    ) -> VLLMEngine:
        """Start vLLM on ``model_dir``; returns once it can generate (about 15 s on a CPU).

        ``dtype`` None serves the checkpoint's own dtype (vLLM's "auto" would halve
        a float32 one). Raises :class:`~rlnb.ConfigError` naming the path and field before any
        process starts when the directory, its ``config.json`` or the sizes do not
        fit, and :class:`~rlnb.EngineError` if vLLM fails to start (nothing is
        left running). Blocks only a thread of its own, not the loop.
        """
        path = Path(model_dir).expanduser().resolve()
        config = _read_config(path)
        if dtype is None:  # vLLM's "auto" would serve a float32 checkpoint in 16 bits
            text = config.get("text_config", config)
            dtype = str(text.get("dtype") or text.get("torch_dtype") or "auto")
        vllm = import_vllm()
        _check_model(
            path,
            config,
            vllm,
            eos_id=eos_id,
            max_len=max_len,
            max_batch=max_batch,
            kv_cache_bytes=kv_cache_bytes,
            dtype=dtype,
        )
        # vllm's import keeps the frames it ran under alive (an exception it stores):
        # this frame is one of them, so vLLM is launched from another.
        return await cls._launch(path, dtype, seed, max_len, max_batch, kv_cache_bytes, enforce_eager, eos_id, name)

    @classmethod
    async def _launch(
        cls,
        path: Path,
        dtype: str,
        seed: int,
        max_len: int,
        max_batch: int,
        kv_cache_bytes: int,
        enforce_eager: bool,
        eos_id: int,
        name: str,
    ) -> VLLMEngine:
        vllm = import_vllm()
        from vllm.v1.engine.async_llm import AsyncLLM

        args = vllm.AsyncEngineArgs(
            model=str(path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_len,
            max_num_seqs=max_batch,
            kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,  # salted by weight version: see _run
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=True,
        )
        stats = {"running": 0, "waiting": 0, "tokens": 0, "steps": 0, "kv_cache_usage_pct": 0}
        before = set(threading.enumerate())

        def build() -> Any:
            with _spawn_without_main():
                return AsyncLLM.from_vllm_config(
                    args.create_engine_config(), stat_loggers=[_stat_logger(stats)], disable_log_stats=True
                )

        guard = _Guard()
        guard.send("arm")

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
            await llm.update_weight_version("0")
        except BaseException:
            with contextlib.suppress(Exception):
                llm.shutdown()
            guard.close(kill=True)
            raise
        engine = cls(llm, guard, procs, threads, stats, eos_id=eos_id, max_len=max_len, name=name)
        engine._shapes = _checkpoint_shapes(path)
        engine._mp_procs = list(getattr(manager, "processes", []))
        return engine

    # -- the Engine protocol ----------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check_open()
        ids = [*request.prompt_ids, *request.prefix_ids]
        if len(ids) + 1 > self._max_len:
            raise ValueError(
                f"request {request.request_id}: prompt and prefix take {len(ids)} tokens, "
                f"leaving no room in the model's context of {self._max_len}"
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
        data = _to_safetensors(state)
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
            _settle(loop, waiter, ClosedError("the engine closed"))
            _cancel(loop, task)
        for task in background:
            _cancel(task.get_loop(), task)
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
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
                raise ValueError(f"update_weights: {name!r} is not a tensor of the served checkpoint")
            if tuple(value.shape) != want:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(value.shape)}, the checkpoint's is {want}")

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
            _settle(loop, waiter, self._translate(exc))
            return
        _settle(loop, waiter, result)

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


async def compare_logprobs(engine: VLLMEngine, model: Any, requests: Sequence[GenerateRequest]) -> float:
    """Generate ``requests`` on ``engine`` and score the tokens with ``model`` (a
    Hugging Face causal LM holding the same weights); the largest absolute
    difference between the engine's behaviour log-probs and the model's.

    Requests must not truncate (top_k 0, top_p 1); temperature 0 compares against
    the untempered model. Runs the model on the calling loop's thread (a check, not
    a hot path).
    """
    import torch

    for r in requests:
        if r.sampling.top_k or r.sampling.top_p < 1:
            raise ValueError(f"request {r.request_id}: compare_logprobs needs top_k=0 and top_p=1")
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    worst = 0.0
    for request, result in zip(requests, results, strict=True):
        if not result.token_ids:
            continue
        context = [*request.prompt_ids, *request.prefix_ids]
        ids = torch.tensor([[*context, *result.token_ids]])
        with torch.no_grad():
            out = model(ids)
        logits = getattr(out, "logits", out)[0, len(context) - 1 : -1].float()
        temperature = request.sampling.temperature or 1.0
        reference = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        worst = max(worst, float((reference - torch.tensor(result.logprobs)).abs().max()))
    return worst
