"""What :class:`~rlnb.engines._vllm.VLLMEngine` needs around vLLM itself: importing it
quietly, checking a model directory before any process starts, starting vLLM
without the caller's ``__main__``, a thread whose result an event loop awaits, and the per-token weight versions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlnb._errors import ConfigError
from rlnb.engines._protocol import GenerateResult

_WORKER_EXTENSION = "rlnb.engines._vllm_worker.RlnbWorkerExtension"
_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def import_vllm() -> Any:
    """Import vllm (its import trips torch's deprecation of ``torch.jit.script_method``).

    vLLM logs every start, pause and weight load at INFO to stdout, from each of
    its processes: unless the user set them, its warnings and errors go to stderr
    and the rest is dropped, so a CLI's stdout (``--json``) stays rlnb's."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*torch.jit.script_method", DeprecationWarning)
        import vllm
        import vllm.v1.engine.async_llm
    return vllm


# -- checks made before any process starts ------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    """The model directory's ``config.json``, read as a model's path is
    (``rlnb.models.read_model_config``: imported here, since it brings torch)."""
    from rlnb.models import read_model_config

    return read_model_config(path, "ModelConfig.path")


def _check_model(
    path: Path,
    config: Mapping[str, Any],
    vllm: Any,
    *,
    eos_id: int,
    max_len: int,
    max_batch: int,
    kv_cache_bytes: int | None,
    dtype: str,
) -> int | None:
    """Raise ConfigError naming the file and field that vLLM would fail on later.
    Returns the KV cache's size in bytes: ``kv_cache_bytes``, or for None 64 MiB on
    a CPU and None on a GPU (where vLLM sizes it from ``gpu_memory_utilization``)."""
    file = path / "config.json"
    from vllm.platforms import current_platform

    if kv_cache_bytes is None and current_platform.is_cpu():
        kv_cache_bytes = 64 << 20  # vLLM would take a share of the machine's memory
    sizes = {"max_len": max_len, "max_batch": max_batch}
    for field, value in {**sizes, **({} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes})}.items():
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
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ConfigError(f"{file}: head_dim={head_dim} is not one vLLM's CPU attention supports ({sizes})")
    width = _DTYPE_BYTES.get(dtype, 4)
    per_token = 2 * layers * kv_heads * head_dim * width
    if kv_cache_bytes is not None and per_token * max_len > kv_cache_bytes:
        raise ConfigError(
            f"kv_cache_bytes={kv_cache_bytes} cannot hold one sequence of max_len={max_len} for {file} "
            f"({per_token} bytes a token): give at least kv_cache_bytes={per_token * max_len}"
        )
    return kv_cache_bytes


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
