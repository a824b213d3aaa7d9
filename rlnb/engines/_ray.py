"""``RayEngine``: engine replicas as Ray actors, behind the ``Engine`` protocol.

Each replica is an async Ray actor that serves a copy of the policy on a
``TinyEngine`` (the built-in policy or a Hugging Face model), or the model's
directory on a ``VLLMEngine`` (whose EngineCore and Worker run under the actor, and
whose guard kills them if the actor dies). The session's bridge loop drives them all:

* ``generate`` goes to the live replica with the fewest requests in flight; the
  requests that arrive in one turn of the loop (a rollout's dispatch) go to a
  replica in one actor call, whose results stream back as each finishes, so the
  hop is paid per batch, not per request; if that replica dies, its requests go
  again to another one, from the prefix each was given (tokens the dead replica
  had made are lost with it);
* ``pause``, ``resume`` and ``abort`` go to every replica, so every mode and the
  partial rollouts of ``"abort"`` work as on one engine;
* ``update_weights`` puts the weights in Ray's object store once; every replica
  loads them and answers with its version, which must be the one sent;
* a replica that dies is remade (with the latest weights) up to
  ``RayConfig.max_restarts`` times in all, counted in ``statistics()``; the engine
  says so in one line, with the dead worker's log file, in place of the raylet's
  report (which goes to ``statistics()``).

Ownership (contracts 1 and 8): with ``RayConfig.address=None`` the engine starts
a local cluster and owns it: ``close()`` kills its actors, removes its placement
group, shuts Ray down and waits for Ray's processes to exit. Ray's raylet and GCS
die with their parent if this process is killed, but two of Ray's agents do not,
so a guard process (``_guard``) watches every process Ray started and kills
what is left when this process dies. Attached to a running cluster
(``address="auto"`` or an address), ``close()`` removes only its own actors and
placement group.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import glob
import os
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rlnb._errors import ClosedError, ConfigError, EngineError
from rlnb.config import EngineConfig, RayConfig
from rlnb.engines._protocol import EngineStatistics, GenerateRequest, GenerateResult, PauseMode
from rlnb.engines._ray_cluster import RayCluster, report_deaths
from rlnb.engines._shared import DEFAULT_ENGINE, check_engine_config
from rlnb.engines._shared import running as count_running

__all__ = ["RayEngine"]


def _on_cpu(policy: Any) -> Any:
    """``policy``, or a copy of it on the CPU: a replica without a GPU cannot unpickle CUDA tensors."""
    return policy if policy.device.type == "cpu" else copy.deepcopy(policy).cpu()


class _Replica:
    """What runs inside each Ray actor: a ``TinyEngine`` over a copy of the policy, or
    a ``VLLMEngine`` on the model's directory."""

    def __init__(
        self, policy: Any, eos_id: int, engine: EngineConfig, vllm: Mapping[str, Any] | None, device: str
    ) -> None:
        import torch

        from rlnb.engines._tiny import TinyEngine

        torch.set_num_threads(engine.threads)
        self._tasks: dict[str, asyncio.Task[GenerateResult]] = {}  # generate_many's, by request id
        self._vllm = vllm  # VLLMEngine.start's arguments: it starts in ready(), on this actor's loop
        self.engine: Any = None
        if vllm is None:  # the policy comes on the CPU; "cuda" is the GPU Ray gave this actor
            policy = policy.to(device)
            self.engine = TinyEngine(policy, engine, eos_id=eos_id, name="rlnb-replica")

    async def ready(self) -> dict[str, Any]:
        """Start a vLLM engine if asked; then say where this replica runs: its pid,
        Ray worker id, node and Ray's log files of this worker."""
        if self.engine is None and self._vllm is not None:
            from rlnb.engines._vllm import VLLMEngine

            self.engine = await VLLMEngine.start(**self._vllm)
        import ray

        worker_id = ray.get_runtime_context().get_worker_id()
        logs: list[str] = []
        with contextlib.suppress(Exception):  # another Ray version: no log files to point at
            folder = ray._private.worker.global_worker.node.get_logs_dir_path()
            logs = sorted(os.path.realpath(p) for p in glob.glob(os.path.join(folder, f"*{worker_id}*")))
        return {"pid": os.getpid(), "worker_id": worker_id, "node": ray.util.get_node_ip_address(), "logs": logs}

    async def close(self) -> None:
        """vLLM's EngineCore and Worker are this actor's children: shut them down
        before the actor is killed (its guard would kill them, but not gracefully)."""
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    async def generate_many(
        self, requests: list[GenerateRequest]
    ) -> AsyncIterator[list[tuple[int, GenerateResult | BaseException]]]:
        """Generate ``requests`` together (a streaming call: one actor call for a whole
        dispatch); yield ``(position, result or its error)`` of those that ended, each
        time some did: the requests that end in one decode step come back in one item,
        as each streamed item costs the driver an object of its own. A request
        cancelled with :meth:`cancel` yields nothing."""
        tasks = {asyncio.ensure_future(self.engine.generate(r)): i for i, r in enumerate(requests)}
        for task, i in tasks.items():
            self._tasks[requests[i].request_id] = task
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                ended = [(tasks[t], t.exception() or t.result()) for t in done if not t.cancelled()]
                if ended:
                    yield ended
        finally:
            for task, i in tasks.items():
                task.cancel()
                if self._tasks.get(requests[i].request_id) is task:
                    del self._tasks[requests[i].request_id]

    async def cancel(self, request_ids: list[str]) -> None:
        """Stop generating these requests (the driver stopped waiting for them)."""
        for request_id in request_ids:
            task = self._tasks.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, state: Mapping[str, Any], version: int) -> int:
        await self.engine.update_weights(state, version)
        return self.engine.statistics().version

    async def statistics(self) -> EngineStatistics:
        return self.engine.statistics()


@dataclasses.dataclass
class _Slot:
    """One replica as the driver sees it."""

    index: int
    actor: Any
    pid: int = 0
    worker_id: str = ""
    node: str = ""
    logs: tuple[str, ...] = ()  # Ray's log files of its worker
    in_flight: int = 0
    served: int = 0
    pending: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]] = dataclasses.field(default_factory=list)
    version: int = 0
    restarts: int = 0
    state: str = "starting"  # "running", "restarting", "dead"
    died: str | None = None  # how its last worker ended, in a line
    found_by: str | None = None  # what found it dead: "a request", "the weight sync", "pause()", ...

    def found(self, where: Mapping[str, Any]) -> None:
        """Take what the replica's ``ready()`` said."""
        self.pid, self.worker_id, self.node = int(where["pid"]), str(where["worker_id"]), str(where["node"])
        self.logs = tuple(where["logs"])

    def log(self) -> str | None:
        """Where its worker's errors go (the worker's stderr file), if Ray said."""
        return next((p for p in self.logs if p.endswith(".err")), self.logs[0] if self.logs else None)


class RayEngine:
    """Engine replicas as Ray actors; see the module docstring.
    Made by :meth:`start`; every async method runs on the session's bridge loop."""

    def __init__(self, ray: Any, cluster: RayCluster, factory: Any, config: RayConfig) -> None:
        self._ray, self._cluster, self._factory, self._config = ray, cluster, factory, config
        self._slots: list[_Slot] = []
        self._weights: tuple[Any, int] | None = None  # the latest (object ref, version) sent
        self._version = 0
        self._paused: PauseMode | None = None
        self._closed = False
        self._restarts = 0
        self._counts = {"finished": 0, "aborted": 0, "tokens": 0, "requeued": 0}
        # Requests in flight by arrival number: while paused, those that arrived after
        # the pause (all of them after an "abort" one) are waiting, not running.
        self._arrivals, self._cutoff = 0, 0
        self._in_flight: set[int] = set()
        self._reports: dict[str, str] = {}  # worker id -> the raylet's report of its death
        self._workers: set[str] = set()  # every replica worker's id, the dead ones' too
        self._node = ""  # this driver's node address
        self._streams: set[asyncio.Task[None]] = set()  # each batch's reader of its results

    @classmethod
    def start(
        cls,
        policy: Any,
        config: RayConfig,
        *,
        engine: EngineConfig = DEFAULT_ENGINE,
        eos_id: int,
        name: str,
        log_dir: str | None = None,
        vllm: Mapping[str, Any] | None = None,
    ) -> RayEngine:
        """Start (or attach to) Ray as ``config`` (a :class:`~rlnb.RayConfig`) says, and
        ``config.engine_replicas`` replicas of ``policy`` on the built-in engine made with
        ``engine`` (an :class:`~rlnb.EngineConfig`: its ``max_batch`` and ``threads``),
        or, with ``vllm`` (:meth:`VLLMEngine.start`'s keyword arguments), of a vLLM
        engine each (with ``engine.threads`` torch threads in the replica). A local
        cluster keeps its logs in ``log_dir`` (None: Ray's default). Blocks until every
        replica answers; ConfigError for configs of the wrong kind or if the cluster
        cannot hold the replicas, EngineError if Ray does not start. Nothing is left
        running if it fails."""
        if not isinstance(config, RayConfig):
            raise ConfigError(
                f"RayEngine.start(config={config!r}) takes a rlnb.RayConfig, got {type(config).__name__}: "
                "e.g. RayEngine.start(policy, rlnb.RayConfig(engine_replicas=2), eos_id=..., name=...)"
            )
        check_engine_config(engine, "RayEngine.start")
        import ray
        from ray.util.placement_group import placement_group

        cluster = RayCluster.connect(ray, config, name, log_dir)
        made: RayEngine | None = None
        try:
            bundle = {"CPU": float(config.num_cpus), **({"GPU": float(config.num_gpus)} if config.num_gpus else {})}
            placement = placement_group([bundle] * config.engine_replicas, strategy=config.strategy)
            cluster.placement = placement
            try:
                ray.get(placement.ready(), timeout=config.start_timeout)
            except ray.exceptions.GetTimeoutError:
                total = ray.cluster_resources()
                raise ConfigError(
                    f"RayConfig.engine_replicas={config.engine_replicas} is invalid: the cluster cannot place "
                    f"{config.engine_replicas} replicas of {bundle} (it has {total}) within "
                    f"{config.start_timeout} s; use fewer replicas or smaller num_cpus/num_gpus"
                ) from None
            remote, policy_ref = ray.remote(_Replica), (ray.put(_on_cpu(policy)) if vllm is None else None)
            device = "cuda" if config.num_gpus > 0 else "cpu"

            def factory(index: int) -> Any:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)
                return remote.options(
                    name=None,
                    num_cpus=config.num_cpus,
                    num_gpus=config.num_gpus,
                    scheduling_strategy=strategy,
                    max_concurrency=4096,
                ).remote(policy_ref, eos_id, engine, None if vllm is None else dict(vllm), device)

            made = cls(ray, cluster, factory, config)
            with contextlib.suppress(Exception):
                made._node = ray.util.get_node_ip_address()
            made._slots = [_Slot(i, factory(i)) for i in range(config.engine_replicas)]
            found = ray.get([s.actor.ready.remote() for s in made._slots], timeout=config.start_timeout)
            for slot, where in zip(made._slots, found, strict=True):
                slot.found(where)
                slot.state = "running"
            made._hear_deaths()
            cluster.watch_new()
            return made
        except BaseException:
            if made is not None:
                made.close()
            else:
                cluster.close()
            raise

    # -- the Engine protocol ------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._arrivals += 1
        arrival = self._arrivals
        self._in_flight.add(arrival)
        try:
            return await self._generate(request)
        finally:
            self._in_flight.discard(arrival)

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        while True:
            slot = self._pick()
            slot.in_flight += 1
            future = self._submit(slot, request)
            try:
                result: GenerateResult = await future
            except asyncio.CancelledError:
                self._cancel(slot, request.request_id)
                raise
            except self._ray.exceptions.RayActorError as exc:
                if self._closed:
                    raise ClosedError("the engine closed") from None
                await self._replace(slot, exc, found_by="a request")
                self._counts["requeued"] += 1
                continue
            except self._ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            finally:
                slot.in_flight -= 1
            slot.served += 1
            self._counts["aborted" if result.finish_reason == "aborted" else "finished"] += 1
            self._counts["tokens"] += len(result.token_ids)
            return result

    async def abort(self, request_ids: list[str]) -> None:
        await self._each("abort", request_ids)

    # -- batched calls --------------------------------------------------------------------

    def _submit(self, slot: _Slot, request: GenerateRequest) -> asyncio.Future[GenerateResult]:
        """Queue ``request`` for ``slot``; the loop's next turn sends what is queued."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        slot.pending.append((request, future))
        if len(slot.pending) == 1:  # the requests of this turn of the loop go together
            loop.call_soon(self._send, slot)
        return future

    def _send(self, slot: _Slot) -> None:
        """One streaming actor call for ``slot``'s queued requests."""
        batch, slot.pending = [(r, f) for r, f in slot.pending if not f.done()], []
        if not batch:
            return
        futures = [f for _, f in batch]
        try:
            stream = slot.actor.generate_many.options(num_returns="streaming").remote([r for r, _ in batch])
        except Exception as exc:  # the actor handle is unusable: as if it had died
            for future in futures:
                future.set_exception(exc)
            return
        reader = asyncio.ensure_future(self._read(stream, futures))
        self._streams.add(reader)
        reader.add_done_callback(self._streams.discard)

    async def _read(self, stream: Any, futures: list[asyncio.Future[GenerateResult]]) -> None:
        """Hand each streamed result to its request; an error of the call (the replica
        died) goes to every request still waiting."""
        try:
            async for ref in stream:
                for position, outcome in await ref:
                    future = futures[position]
                    if future.done():  # its caller stopped waiting
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        except Exception as exc:
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future in futures:
            if not future.done():
                future.set_exception(EngineError("a Ray replica ended a batch without an answer for every request"))

    def _cancel(self, slot: _Slot, request_id: str) -> None:
        """The caller stopped waiting for ``request_id``: stop it on its replica too."""
        with contextlib.suppress(Exception):  # a dead replica generates nothing anyway
            slot.actor.cancel.remote([request_id])

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        mode = PauseMode(mode)
        self._check_open()
        self._paused, self._cutoff = mode, self._arrivals
        await self._each("pause", mode.value)

    async def resume(self) -> None:
        self._check_open()
        self._paused = None
        await self._each("resume")

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        self._check_open()
        ref = self._ray.put({k: v.detach().cpu() for k, v in state.items()})  # once, for every replica
        self._weights = (ref, version)
        running = [s for s in self._slots if s.state == "running"]
        answers = await asyncio.gather(
            *(s.actor.update_weights.remote(ref, version) for s in running), return_exceptions=True
        )
        for slot, answer in zip(running, answers, strict=True):
            if isinstance(answer, self._ray.exceptions.RayActorError):
                await self._replace(slot, answer, found_by="the weight sync")  # the new replica starts from these
            elif isinstance(answer, BaseException):
                raise EngineError(f"replica {slot.index} failed to load weights version {version}") from answer
            elif answer != version:
                raise EngineError(f"replica {slot.index} is at weights version {answer} after loading {version}")
            else:
                slot.version = answer
        self._version = version

    def statistics(self) -> EngineStatistics:
        # the counters change on the bridge loop only: a copy is a consistent enough view
        in_flight = list(self._in_flight)
        running = count_running(in_flight, self._paused, self._cutoff)
        return EngineStatistics(
            version=self._version,
            paused=None if self._paused is None else self._paused.value,
            waiting=len(in_flight) - running,
            running=running,
            finished=self._counts["finished"],
            aborted=self._counts["aborted"],
            generated_tokens=self._counts["tokens"],
            decode_steps=0,
            extra={
                "replicas": [
                    {
                        "index": s.index,
                        "state": s.state,
                        "in_flight": s.in_flight,
                        "served": s.served,
                        "version": s.version,
                        "restarts": s.restarts,
                        "pid": s.pid,
                        "logs": list(s.logs),
                        "died": s.died,
                        "found_by": s.found_by,
                    }
                    for s in self._slots
                ],
                "restarts": self._restarts,
                "requeued": self._counts["requeued"],
                "ray_owned": self._cluster.owned,
                "log_dir": self._cluster.logs,
                "reports": dict(self._reports),
                "died": None,
            },
        )

    def close(self, timeout: float | None = 10.0) -> None:
        """Kill the replicas, remove the placement group and, when this engine started
        Ray, shut it down and wait for its processes. Idempotent; blocks."""
        if self._closed:
            return
        self._closed = True
        live = [s.actor for s in self._slots if s.state == "running"]
        if live and self._ray.is_initialized():  # a vLLM replica shuts its engine down first
            with contextlib.suppress(Exception):
                self._ray.wait([a.close.remote() for a in live], num_returns=len(live), timeout=timeout or 10.0)
        for slot in self._slots:
            slot.state = "dead" if slot.state == "dead" else "closed"  # closed on purpose: not a death
            try:
                self._ray.kill(slot.actor)
            except Exception:  # already gone
                pass
        self._cluster.close(timeout=timeout)
        # A report that comes after close is about a replica closed on purpose: dropped.
        report_deaths(self._ray, dict.fromkeys(self._workers, None))

    # -- replicas -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")

    def _pick(self) -> _Slot:
        self._check_open()
        running = [s for s in self._slots if s.state == "running"]
        if not running:
            raise EngineError(
                f"every Ray replica is dead and the {self._config.max_restarts} restarts "
                "(RayConfig.max_restarts) are spent; make a new session"
            )
        return min(running, key=lambda s: (s.in_flight, s.index))

    async def _each(self, method: str, *args: Any) -> None:
        running = [s for s in self._slots if s.state == "running"]
        answers = await asyncio.gather(
            *(getattr(s.actor, method).remote(*args) for s in running), return_exceptions=True
        )
        for slot, answer in zip(running, answers, strict=True):
            if isinstance(answer, self._ray.exceptions.RayActorError):
                await self._replace(slot, answer, found_by=f"{method}()")
            elif isinstance(answer, BaseException):
                raise EngineError(f"replica {slot.index}: {method} failed") from answer

    async def _replace(self, slot: _Slot, cause: BaseException, *, found_by: str) -> None:
        """``slot``'s actor died: remake it with the latest weights and the current
        pause, if the restart budget allows; otherwise mark it dead. Either way, say
        so in one line, with where the dead worker's logs are."""
        if slot.state != "running":  # another caller is on it
            while slot.state == "restarting":
                await asyncio.sleep(0.05)
            return
        slot.died, slot.found_by = f"pid {slot.pid}, {_exit_of(cause)}", found_by
        where = slot.log() or self._cluster.logs or "where Ray keeps them (it did not say)"
        where += "" if slot.node in ("", self._node) else f" on node {slot.node}"
        if self._restarts >= self._config.max_restarts:
            slot.state = "dead"
            self._say(
                slot,
                f"and is not remade: the {self._config.max_restarts} restarts (RayConfig.max_restarts) are spent",
                where,
            )
            return
        slot.state, self._restarts, slot.restarts = "restarting", self._restarts + 1, slot.restarts + 1
        try:
            actor = self._factory(slot.index)
            slot.found(await actor.ready.remote())
            self._hear_deaths()
            # The latest weights and pause, again until none changed meanwhile: a resume,
            # a pause or a sync while it was made skips it (it is not running yet), and a
            # replica left paused, or on older weights, would hold or skew its requests.
            paused: PauseMode | None = None
            loaded: tuple[Any, int] | None = None  # the new actor starts from the policy it was made with
            while True:
                weights, want = self._weights, self._paused
                if weights is not None and weights is not loaded:
                    slot.version = await actor.update_weights.remote(*weights)
                    loaded = weights
                if want is not paused:
                    await (actor.resume.remote() if want is None else actor.pause.remote(want.value))
                    paused = want
                if (self._weights, self._paused) == (weights, want):
                    break
        except Exception as exc:
            slot.state = "dead"
            with contextlib.suppress(Exception):  # half made: it would hold its bundle until close
                self._ray.kill(actor)
            self._say(slot, f"and could not be remade ({_first_line(exc)})", where)
            return
        slot.actor, slot.state = actor, "running"
        self._cluster.watch_new()
        self._say(
            slot,
            f"and was remade with weights v{slot.version} (restart {self._restarts} of {self._config.max_restarts})",
            where,
        )

    def _say(self, slot: _Slot, what: str, where: str) -> None:
        """One line for a replica that died: the raylet's report of it goes to
        ``statistics()`` instead of the cell."""
        print(f"rlnb: Ray replica {slot.index} died ({slot.died}) {what}; its logs: {where}", flush=True)

    def _hear_deaths(self) -> None:
        """Have the raylet's reports of these replicas' deaths come here (Ray's
        printing thread calls it), not to the cell."""
        workers = {s.worker_id for s in self._slots if s.worker_id} - self._workers
        self._workers |= workers
        report_deaths(self._ray, dict.fromkeys(workers, self._heard))

    def _heard(self, worker_id: str, report: str) -> None:
        self._reports[worker_id] = report


def _exit_of(cause: BaseException) -> str:
    """How a replica's worker ended, as Ray says it: its exit type (SYSTEM_ERROR for a
    process that was killed or crashed), else the error's type."""
    found = re.search(r"Worker exit type: (\w+)", str(cause))
    return f"Ray: {found[1]}" if found else type(cause).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
