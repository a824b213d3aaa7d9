"""The learner on several processes: ``LearnConfig(ranks=N)``.

:class:`RankGroup` is N Ray actors, one per rank, placed with a placement group on
the session's Ray cluster (a local one it starts, or ``RayConfig(address=...)``'s),
each a process with torch.distributed's default group (gloo) and a
:class:`~rlnb.learn.Learner` that takes its share of each step
(:mod:`rlnb.learn._ranks`): its model sharded with FSDP2 ("fsdp",
:mod:`rlnb.learn._sharding`), or replicated with the gradients summed ("ddp").
The actors start at once and join the group together; a step is one call on each,
and rank 0 returns the step's metrics and the new weights (gathered whole by every
rank together where they are sharded).

:class:`RankedLearner` is what the session holds: a :class:`Learner` in the
session's process whose policy mirrors rank 0's weights after each step (the
engines, ``logp``, ``what_if``, exports and checkpoints read it as they read a
single process's learner), and whose :meth:`~RankedLearner.step` runs on the ranks.
Its optimiser is fetched from rank 0 when something reads it; anything that may
have changed the mirror (a checkpoint loaded, a warm-up step, the optimiser read)
is sent to every rank before the next step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlnb import _reprs
from rlnb._errors import ConfigError, TrainingError
from rlnb._samples import Group
from rlnb.learn import _sharding
from rlnb.learn._critic import Critic
from rlnb.learn._learner import Learner
from rlnb.learn._ranks import RankFailed, Ranks

__all__ = ["LearnerStatistics", "RankGroup", "RankStatistics", "RankedLearner", "RanksDied"]


@dataclasses.dataclass(frozen=True)
class RankStatistics:
    """One learner rank as its last step left it: its process, node (address, and
    Ray's node id: simulated nodes share an address) and state ("running", "dead"
    or "closed"), the step's seconds on it (its share of the update; None before
    any step), the bytes of its parameters, gradients and optimiser state, and its
    process's resident memory."""

    rank: int
    pid: int
    node: str
    state: str
    node_id: str = ""
    step_seconds: float | None = None
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_bytes: int = 0
    rss_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class LearnerStatistics:
    """The learner's ranks (``LearnConfig.ranks`` > 1): how they split the work
    (``parallelism``, ``LearnConfig.strategy``'s: "fsdp", each weight, gradient and
    optimiser moment sharded across the ranks, or "ddp", the weights on every rank
    and the gradients summed), ``each`` rank's :class:`RankStatistics`, and which
    rank died or hung, if one did."""

    parallelism: str
    each: tuple[RankStatistics, ...]
    dead: str | None = None

    def lines(self) -> list[str]:
        """The ranks as text: a line for the group, two for each rank."""
        lines = [f"{len(self.each)} ranks ({self.parallelism})" + (f"; {self.dead}" if self.dead else "")]
        for r in self.each:
            step = "no step yet" if r.step_seconds is None else f"step {r.step_seconds:.3g} s"
            lines.append(f"rank {r.rank}: {r.state}, pid {r.pid} on {r.node}, {step}")
            lines.append(
                f"  parameters {_reprs.mebibytes(r.parameter_bytes)}, gradients {_reprs.mebibytes(r.gradient_bytes)}, "
                f"optimiser {_reprs.mebibytes(r.optimizer_bytes)}; process {_reprs.mebibytes(r.rss_bytes)}"
            )
        return lines

    def __repr__(self) -> str:
        return _reprs.text_block("LearnerStatistics", [("learner", self.lines())])

    def _repr_html_(self) -> str:
        return _reprs.html_table("LearnerStatistics", [("learner", self.lines())])


class RanksDied(TrainingError):
    """A learner rank's process died: the group is gone (its survivors were stopped)."""


# How long a collective may wait for the other ranks (torch.distributed's timeout;
# LearnConfig.rank_timeout): a rank that died or hangs makes the others' step fail
# after it, never hang. A rank still busy this long plus HANG_GRACE_S after another
# finished the same call is taken for hung.
COLLECTIVE_TIMEOUT_S = 300.0
HANG_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Rank:
    """What runs inside each rank's Ray actor: a whole learner on its share of each step."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.learner: Learner | None = None

    def where(self) -> dict[str, Any]:
        """This rank's process, node and a free port on it (rank 0's is the group's rendezvous)."""
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "worker_id": context.get_worker_id(),
            "port": _free_port(),
        }

    def join(
        self,
        rank: int,
        world: int,
        address: str,
        make: Callable[[Ranks], Learner],
        timeout: float,
        local: bool,
        strategy: str,
    ) -> int:
        """Join the process group at ``address`` as ``rank`` of ``world`` and make the
        learner, its model held as ``strategy`` says."""
        import torch.distributed as dist

        if local:  # every rank on this machine: gloo over loopback, whatever the hostname resolves to
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        gpu = torch.cuda.is_available()  # Ray gave this actor a GPU of its own (the group asked for them)
        if gpu:
            torch.cuda.set_device(0)  # the one Ray makes visible
        dist.init_process_group(
            "nccl" if gpu else "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        self.learner = make(Ranks(rank, world, sharded=strategy == "fsdp"))
        return os.getpid()

    def step(self, groups: Sequence[Group], config: Any, max_length: int | None) -> dict[str, Any]:
        learner = self._learner()
        learner.config = config
        started = time.perf_counter()
        metrics = learner.step(groups, max_length=max_length)
        seen = {"seconds": time.perf_counter() - started, **_memory(learner)}
        weights = _sharding.gathered(learner.model_state())  # sharded: every rank takes part
        if self._rank() != 0:
            return {"metrics": metrics, "seen": seen}
        return {
            "metrics": metrics,
            "seen": seen,
            "advantages": learner.last_advantages,
            "weights": {k: v.detach().cpu().clone() for k, v in weights.items()},  # through Ray: on the CPU
        }

    def optimizer_state(self) -> dict[str, Any]:
        """The optimiser's state as one process's optimiser holds it (its moments
        whole, on the CPU)."""
        return _on_cpu(_sharding.gathered(self._learner().optimizer.state_dict()))

    def critic_state(self) -> dict[str, Any] | None:
        """The critic's kind and state (its weights and moments whole, on the CPU); None without one."""
        critic = self._learner().critic
        if critic is None:
            return None
        return {"kind": critic.kind, "state": _on_cpu(_sharding.gathered(critic.state()))}

    def load(self, state: Mapping[str, Any]) -> None:
        """Take the session's mirror's state: ``model``, ``optimizer``, ``reference``,
        ``critic``, ``version`` (whole tensors: each rank keeps its shards of them)."""
        learner = self._learner()
        if "model" in state:
            learner.load_model_state(_sharding.sharded_state(state["model"], learner.model_state()))
        if "optimizer" in state:
            params = learner.trainable_parameters()
            learner.optimizer.load_state_dict(_sharding.sharded_optimizer_state(state["optimizer"], params))
        if "reference" in state and learner.reference is not None:
            reference = learner.reference
            reference.load_state_dict(_sharding.sharded_state(state["reference"], reference.state_dict()))
        if state.get("critic") is not None:
            whole = state["critic"]["state"]
            critic = learner.ensure_critic(state["critic"]["kind"])
            mine = critic.state()
            critic.load_state(
                {
                    "model": _sharding.sharded_state(whole["model"], mine["model"]),
                    "head": _sharding.sharded_state(whole["head"], mine["head"]),
                    "optimizer": _sharding.sharded_optimizer_state(whole["optimizer"], critic.parameters()),
                }
            )
        learner.version = int(state["version"])

    def _rank(self) -> int:
        share = self._learner().share
        return 0 if share is None else share.rank

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _learner(self) -> Learner:
        if self.learner is None:
            raise TrainingError("this learner rank has not joined its group")
        return self.learner


def _on_cpu(state: Any) -> Any:
    """``state`` (nested dicts and lists) with its tensors on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, Mapping):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_on_cpu(v) for v in state]
    return state


def _memory(learner: Learner) -> dict[str, int]:
    """The bytes of this rank's parameters, gradients and optimiser state, and its process's resident memory."""
    import psutil

    params = list(learner.policy.parameters())
    state = learner.optimizer.state.values()
    size = _sharding.local_bytes  # of this rank's shard, where sharded
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(t) for entry in state for t in entry.values() if isinstance(t, torch.Tensor)),
        "rss": psutil.Process().memory_info().rss,
    }


class RankGroup:
    """``world`` learner ranks as Ray actors; see the module docstring. Made by :meth:`start`."""

    def __init__(self, ray: Any, cluster: Any, actors: list[Any], placement: Any) -> None:
        self._ray, self._cluster, self.actors, self._placement = ray, cluster, actors, placement
        self.strategy = "ddp"  # how the ranks hold the model: "fsdp" or "ddp" (start() sets it)
        self.timeout = COLLECTIVE_TIMEOUT_S  # a collective's deadline on the ranks (start() sets it)
        self.pids: list[int] = []
        self.nodes: list[str] = []
        self.node_ids: list[str] = []
        self.workers: list[str] = []  # each rank's Ray worker id
        self.reports: dict[str, str] = {}  # the raylet's report of a rank's death, by worker id
        self.dead: str | None = None  # which rank died, and when: the group is gone
        self.dead_rank: int | None = None
        self.seen: list[dict[str, Any]] = []  # each rank's figures from the last step
        self._closed = False

    @property
    def world(self) -> int:
        return len(self.actors)

    @classmethod
    def start(
        cls,
        make: Callable[[Ranks], Learner],
        world: int,
        ray_config: Any,
        *,
        name: str,
        log_dir: str | None = None,
        threads: int = 1,
        timeout: float = COLLECTIVE_TIMEOUT_S,
        strategy: str = "fsdp",
        gpus: bool = False,
    ) -> RankGroup:
        """Start (or attach to) Ray as ``ray_config`` says and ``world`` ranks, a bundle
        of one CPU each, packed as ``ray_config.strategy`` says ("SPREAD": one a node
        where it can); each joins the process group and makes its learner with
        ``make``, the model held as ``strategy`` says ("fsdp" or "ddp"). ``gpus``: a GPU
        a rank too (NCCL between them). Blocks until every rank has; nothing is left
        running if one fails."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlnb.engines import RayCluster

        cluster = RayCluster.connect(ray, ray_config, f"{name}-learner", log_dir, cpus=world)
        placement = None
        actors: list[Any] = []
        try:
            bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
            placement = placement_group([bundle] * world, strategy=ray_config.strategy)
            try:
                ray.get(placement.ready(), timeout=ray_config.start_timeout)
            except ray.exceptions.GetTimeoutError:
                free = ray.available_resources().get("CPU", 0.0)
                each = "one CPU and one GPU" if gpus else "one CPU"
                raise ConfigError(
                    f"LearnConfig.ranks={world} is invalid: the Ray cluster cannot place {world} ranks of {each} "
                    f"each ({free:g} of its {ray.cluster_resources().get('CPU', 0.0):g} CPUs free, "
                    f"{ray.cluster_resources().get('GPU', 0.0):g} GPUs) within "
                    f"{ray_config.start_timeout} s; use fewer ranks, close another session of this process that "
                    "holds them, or attach to a larger cluster (RayConfig(address=...))"
                ) from None
            remote = ray.remote(_Rank)
            for index in range(world):
                placed = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)
                options = {"num_cpus": 1, "num_gpus": 1 if gpus else 0, "scheduling_strategy": placed}
                actors.append(remote.options(**options).remote(threads))
            group = cls(ray, cluster, actors, placement)
            group.strategy, group.timeout = strategy, timeout
            where = ray.get([a.where.remote() for a in actors], timeout=ray_config.start_timeout)
            group.nodes = [w["node"] for w in where]
            group.node_ids = [w["node_id"] for w in where]
            group.workers = [w["worker_id"] for w in where]
            # A rank's death is said by the step that finds it (RanksDied), not by the raylet's block in the cell.
            cluster.hear_deaths(dict.fromkeys(group.workers, group._heard))
            address = f"{where[0]['node']}:{where[0]['port']}"
            local = all(node == "127.0.0.1" for node in group.nodes)
            joined = [a.join.remote(r, world, address, make, timeout, local, strategy) for r, a in enumerate(actors)]
            group.pids = ray.get(joined, timeout=ray_config.start_timeout)
            cluster.watch_new()
            return group
        except BaseException:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if placement is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(placement)
            cluster.close()
            raise

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank at once; each rank's result, in rank order.
        A rank's error is raised as the rank's own (the others fail with
        :class:`~rlnb.learn._ranks.RankFailed`). A rank that dies or hangs takes the
        group with it (the survivors would wait in a collective until its deadline):
        the others are killed at once and :class:`RanksDied` names it. Hung: a rank
        still busy when another's collective timed out waiting, or ``timeout`` +
        :data:`HANG_GRACE_S` after another finished."""
        self.check_alive()
        ray = self._ray
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = list(refs)
        first: tuple[int, float] | None = None  # the first rank to finish, and when
        while pending:
            left = None if first is None else first[1] + self.timeout + HANG_GRACE_S - time.monotonic()
            done, pending = ray.wait(pending, num_returns=1, timeout=None if left is None else max(0.0, left))
            if not done and first is not None:
                waited = f"{time.monotonic() - first[1]:.0f} s after rank {first[0]} finished"
                self._hung(sorted(rank_of[ref] for ref in pending), method, waited)
            if first is None:
                first = (rank_of[done[0]], time.monotonic())
            for ref in done:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._died(rank, method, exc)
                except Exception as exc:
                    errors[rank] = _cause(exc)
                    if _timed_out(errors[rank]) and pending:  # it waited for the ones still busy
                        self._hung(
                            sorted(rank_of[r] for r in pending), method, f"rank {rank} waited for it in a collective"
                        )
        if errors:
            timed_out = [rank for rank, e in sorted(errors.items()) if _timed_out(e)]
            if timed_out:  # a collective's deadline passed: the group is unusable
                self._stop(
                    f"rank {timed_out[0]} waited {self.timeout:g} s for the others in a collective during {method} "
                    f"(LearnConfig.rank_timeout)",
                    timed_out[0],
                    "timed out",
                )
            own = [e for _, e in sorted(errors.items()) if not isinstance(e, RankFailed)]
            raise (own or [errors[min(errors)]])[0]
        return [results[rank] for rank in range(self.world)]

    def statistics(self) -> LearnerStatistics:
        """The ranks as the last step left them; does not block (nothing is asked of them)."""
        state = "closed" if self._closed else "running"
        dead = self.dead_rank
        ranks = []
        for rank in range(self.world):
            seen = self.seen[rank] if rank < len(self.seen) else {}
            ranks.append(
                RankStatistics(
                    rank=rank,
                    pid=self.pids[rank] if rank < len(self.pids) else 0,
                    node=self.nodes[rank] if rank < len(self.nodes) else "",
                    state="dead" if rank == dead else state,
                    node_id=self.node_ids[rank] if rank < len(self.node_ids) else "",
                    step_seconds=seen.get("seconds"),
                    parameter_bytes=int(seen.get("parameters", 0)),
                    gradient_bytes=int(seen.get("gradients", 0)),
                    optimizer_bytes=int(seen.get("optimizer", 0)),
                    rss_bytes=int(seen.get("rss", 0)),
                )
            )
        return LearnerStatistics(self.strategy, tuple(ranks), self.dead)

    def _heard(self, worker_id: str, report: str) -> None:
        self.reports[worker_id] = report

    def check_alive(self) -> None:
        if self.dead is not None:
            raise RanksDied(
                f"the learner's ranks are gone: {self.dead}; sess.restart_learner() starts new ones from the "
                "last step's weights"
            )

    def _where(self, rank: int) -> str:
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        return f"rank {rank} (pid {pid}, on {self.nodes[rank] if rank < len(self.nodes) else '?'})"

    def _died(self, rank: int, method: str, exc: BaseException) -> None:
        self._stop(f"{self._where(rank)} died during {method}", rank, type(exc).__name__)

    def _hung(self, ranks: list[int], method: str, seen: str) -> None:
        self._stop(
            f"{self._where(ranks[0])} hung during {method}: {seen} (LearnConfig.rank_timeout={self.timeout:g})",
            ranks[0],
            "no answer",
        )

    def _stop(self, what: str, rank: int, why: str) -> None:
        """The group is gone (``what`` happened to ``rank``): stop every rank (the
        others would wait on it in a collective) and raise :class:`RanksDied`."""
        self.dead_rank, self.dead = rank, what
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor)
        raise RanksDied(
            f"learner {what} ({why}); the other ranks were stopped and the step was not taken (the session "
            "keeps the weights of the last step); sess.restart_learner() starts new ranks from them"
        ) from None

    def close(self, timeout: float | None = 10.0) -> None:
        """Leave the process group, kill the ranks, remove the placement group and,
        when this group started Ray, shut it down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.wait([a.leave.remote() for a in self.actors], num_returns=self.world, timeout=timeout or 10.0)
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if self._placement is not None:
                from ray.util.placement_group import remove_placement_group

                with contextlib.suppress(Exception):
                    remove_placement_group(self._placement)
        self._cluster.close(timeout=timeout)
        self._cluster.hear_deaths(dict.fromkeys(self.workers, None))  # a report after close: the ranks were closed


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective past its deadline: gloo's "Timed out waiting ...
    for recv", or "Application timeout caused pair closure" where the wait was in a
    send or an autograd hook; NCCL's watchdog's "collective operation timeout". (Not
    any backend error: a peer that died closes its connections too, and that rank is
    said dead, not hung, when Ray reports it.)"""
    text = str(exc).lower()
    timeouts = ("timed out waiting", "application timeout", "collective operation timeout")
    return isinstance(exc, RuntimeError) and any(words in text for words in timeouts)


def _cause(exc: BaseException) -> BaseException:
    """The error a Ray task raised, as itself where Ray kept it (``RayTaskError.cause``)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RankedLearner(Learner):
    """The session's learner when ``LearnConfig.ranks`` > 1; see the module docstring."""

    group: RankGroup
    _stale: set[str]  # what of the mirror the ranks must get before the next step
    _optimizer_version: int | None  # the mirror optimiser's state is rank 0's of this version (None: unknown)
    _critic_version: int | None  # likewise the mirror critic's
    _start: Callable[[], RankGroup]  # how the group was started (restart() starts another)

    @classmethod
    def start(
        cls,
        policy: Any,
        *,
        ranks: int,
        ray: Any,
        name: str,
        log_dir: str | None = None,
        threads: int = 1,
        **kwargs: Any,
    ) -> RankedLearner:
        """``Learner(policy, **kwargs)`` in this process and on ``ranks`` Ray actors
        started as ``ray`` (a :class:`~rlnb.RayConfig`) says, each rank with
        ``threads`` torch threads; :meth:`close` ends them."""
        learner = cls(policy, **kwargs)
        gpus = policy.device.type == "cuda"  # a GPU a rank, each given the policy on the CPU to move to its own
        sent = copy.deepcopy(policy).cpu() if gpus else policy
        # how to start the group (again: restart()); the factory holds the policy as it was made
        learner._start = functools.partial(
            RankGroup.start,
            rank_factory(sent, device="cuda" if gpus else None, **kwargs),
            ranks,
            ray,
            name=name,
            log_dir=log_dir,
            threads=threads,
            strategy=learner.config.strategy,
            timeout=learner.config.rank_timeout,
            gpus=gpus,
        )
        learner.attach(learner._start())
        return learner

    def restart(self) -> None:
        """Close the ranks and start new ones from this process's copy: the weights of
        the last step taken (and the KL reference), the optimiser's moments as rank 0
        last gave them if that was after the last step, else anew (a rank that died
        took them with it). The version goes on."""
        group = self.__dict__.get("group")
        start = self.__dict__.get("_start")
        if group is None or start is None:
            raise TrainingError("this learner was not started on ranks (RankedLearner.start): nothing to restart")
        group.close()
        current = self._optimizer_version == self.version
        critic = self._critic_version == self.version and self.__dict__.get("critic") is not None
        self.attach(start())
        self._stale = {"model", "reference", *(("optimizer",) if current else ()), *(("critic",) if critic else ())}
        self._optimizer_version = self.version if current else None
        self._critic_version = self.version if critic else None
        self._send_stale()

    def attach(self, group: RankGroup) -> None:
        """Drive ``group`` (started from this learner's policy and config)."""
        self.group = group
        self._stale = set()
        self._optimizer_version = 0
        self._critic_version = 0  # the ranks made their critic from the same policy as this one

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimiser, with rank 0's state (fetched when the mirror's is older)."""
        mirror: torch.optim.Optimizer = self.__dict__["optimizer"]
        group = self.__dict__.get("group")
        if group is not None:
            if self._optimizer_version != self.version:
                mirror.load_state_dict(group.call("optimizer_state")[0])
                self._optimizer_version = self.version
            self._stale.add("optimizer")  # the caller may load a state into it
        return mirror

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self.__dict__["optimizer"] = value

    @property
    def critic(self) -> Critic | None:
        """The critic (``advantage="gae"``), with rank 0's state (fetched when the
        mirror's is older; made here if only the ranks have one: a live switch)."""
        mirror: Critic | None = self.__dict__.get("critic")
        group = self.__dict__.get("group")
        if group is None:
            return mirror
        if self._critic_version != self.version:
            theirs = group.call("critic_state")[0]
            if theirs is not None:
                if mirror is None or mirror.kind != theirs["kind"]:
                    mirror = self.__dict__["critic"] = Critic(self.policy, self.config, kind=theirs["kind"])
                mirror.load_state(theirs["state"])
            self._critic_version = self.version
        if mirror is not None:
            self._stale.add("critic")  # the caller may load a state into it
        return mirror

    @critic.setter
    def critic(self, value: Critic | None) -> None:
        self.__dict__["critic"] = value
        if "group" in self.__dict__ and value is not None:  # a new one (a checkpoint's): the ranks take it
            self._stale.add("critic")
            self._critic_version = self.version

    def load_model_state(self, state: dict[str, Any]) -> None:
        super().load_model_state(state)
        self._stale.update({"model", "reference"})

    def supervised_step(self, pairs: Sequence[tuple[Any, Any]], optimizer: torch.optim.Optimizer) -> dict[str, float]:
        metrics = super().supervised_step(pairs, optimizer)  # on the mirror: the ranks get its weights after
        self._stale.add("model")
        return metrics

    def step(self, groups: Sequence[Group], *, max_length: int | None = None) -> dict[str, float]:
        """One step on the ranks; the mirror then holds rank 0's weights (its critic
        and optimiser are fetched when read)."""
        self._send_stale()
        results = self.group.call("step", list(groups), self.config, max_length)
        self.group.seen = [r["seen"] for r in results]
        first = results[0]
        with torch.no_grad():
            super().load_model_state(first["weights"])
        self.last_advantages = first["advantages"]
        self.version += 1
        return dict(first["metrics"])

    def _send_stale(self) -> None:
        if not self._stale:
            return
        state: dict[str, Any] = {"version": self.version}
        if "model" in self._stale:
            state["model"] = self.model_state()
        if "reference" in self._stale and self.reference is not None:
            state["reference"] = self.reference.state_dict()
        if "optimizer" in self._stale:
            state["optimizer"] = self.__dict__["optimizer"].state_dict()
        critic = self.__dict__.get("critic")
        if "critic" in self._stale and critic is not None:
            state["critic"] = {"kind": critic.kind, "state": critic.state()}
        self.group.call("load", _on_cpu(state))  # through Ray: on the CPU, each rank moves its shards to its device
        self._stale.clear()

    def statistics(self) -> LearnerStatistics:
        """The ranks (:class:`LearnerStatistics`); does not block."""
        return self.group.statistics()

    def twin(self, config: Any = None) -> Learner:
        """A single-process learner on copies of the mirror's policy and rank 0's
        optimiser state (what ``what_if`` trains): nothing it does reaches the ranks."""
        twin = super().twin(config)
        twin.__class__ = Learner  # a copy of this object: made plain, it drives no rank
        for name in ("group", "_stale", "_optimizer_version", "_critic_version", "_start"):
            twin.__dict__.pop(name, None)
        return twin

    def close(self, timeout: float | None = 10.0) -> None:
        """Close the ranks (idempotent)."""
        group = self.__dict__.get("group")
        if group is not None:
            group.close(timeout)


def make_rank_learner(kwargs: Mapping[str, Any], policy: Any, device: str | None, ranks: Ranks) -> Learner:
    """A rank's learner: ``Learner(policy, share=ranks, **kwargs)``, the policy moved
    to ``device`` first (None: where it is); the factory the ranks unpickle."""
    return Learner(policy if device is None else policy.to(device), share=ranks, **kwargs)


def rank_factory(policy: Any, *, device: str | None = None, **kwargs: Any) -> Callable[[Ranks], Learner]:
    """What :meth:`RankGroup.start` gives each rank to make its learner with."""
    return functools.partial(make_rank_learner, kwargs, policy, device)
