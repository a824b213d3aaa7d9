"""``rlnb bench learner``: the learner on 1 and on N ranks (``LearnConfig(ranks=N)``), in one run.

Every variant is a sync-mode session of the built-in policy, larger than the demo's so
that the update is measurable (by default ``d_model=128``, 4 layers of 4 heads: 0.8M
parameters), the ``reverse`` task, 8 prompts x 8 completions a step, prompts made
in-process, no tracker, one seed. Every process that runs an update runs it on one
torch thread (``LearnConfig(threads=1)``), so N ranks use N times the cores of one:
the scaling measured is the processes'. Each N of ``--ranks`` runs with each strategy
of ``--strategy`` (both by default): "fsdp" (the model sharded with FSDP2), whose
figures are named ``ranks{N}_*``, and "ddp" (a whole copy on every rank),
``ranks{N}_ddp_*``. For reference, one in-process learner on torch's own thread count
C (what ``ranks=1`` runs by default) is measured beside them
(``inprocess_threads{C}_*``) where C > 1.

The 1-rank session (the baseline) and the reference stay open for the whole run;
each N-rank session is opened in turn and, after one unmeasured step per session,
their steps are interleaved one by one (the order turned each round) so that the
machine's noise hits all alike. Per variant, medians over the measured steps:

- ``update_s``: the learner's step as the session's process sees it, timed around
  ``learner.step`` in the trainer (for N ranks: the batch sent to every rank, their
  update and collectives, rank 0's weights returned through Ray's object store and
  loaded into the session's copy); ``tokens_per_s``: the step's trained tokens (the
  completion tokens of its samples) / ``update_s``; ``step_s``: a whole
  ``sess.step()`` (rollouts, the update, the engine's weights);
- ``scaling_efficiency`` (N ranks): the speed-up over 1 rank divided by N,
  ``update_s(1) / (N * update_s(N))``: 1.0 is linear scaling, 1/N means that N
  ranks took as long as one, less than 1/N that they took longer;
- where the N-rank update's time goes: ``rank_s``, the slowest rank's own time for
  its ``learner.step`` (``RankStatistics.step_seconds``); ``ray_call_s``, the Ray
  call less that (sending the batch to every rank, gathering the weights where
  sharded, returning the metrics and rank 0's weights); ``mirror_s``, loading those
  weights into the session's copy. Inside ``rank_s``: ``rank_cpu_s``, the CPU seconds
  of the thread that runs the rank's step (its compute: its share of the forward and
  backward passes, and what every rank does whole: collating the batch, clipping,
  the optimiser step over its weights), against ``ranks1_update_cpu_s``, the same for
  the single process; ``rank_repeated_cpu_s``, an estimate of the part every rank
  repeats, taking a rank's CPU time as R + W/N and one process's as R + W;
  ``rank_waiting_s``, ``rank_s`` less ``rank_cpu_s`` (waiting for a core, for the
  other ranks at a collective, and the collectives); ``rank_beyond_share_s``,
  ``rank_s`` less 1/N of ``ranks1_update_s``;
- the collectives alone, timed on the ranks' own group between steps: with "ddp",
  ``all_reduce_s``, one all-reduce of the gradients' size (one a step at the default
  one epoch of one minibatch); with "fsdp", ``gather_scatter_s``, what one forward
  and backward pass exchanges, unit by unit (each transformer block, then the rest of
  the policy): an all-gather of every unit's weights for the forward, of every
  block's again for the backward (the root's are kept), and a reduce-scatter of every
  unit's gradients, ``gather_scatter_messages`` collectives in all;
- memory per rank: the bytes of its parameters, gradients and optimiser state (from
  ``statistics().learner``; for 1 rank, the same sums over the in-process learner;
  with "fsdp" a rank's own shards), the largest over the ranks;
  ``per_rank_over_one_process``, their sum over one process's: about 1/N with
  "fsdp", 1.0 with "ddp"; and each rank's process's resident memory;
- ``start_s`` and ``close_s``: making and closing each N-rank session (a local Ray
  cluster and the ranks).

The targets hold on any machine, two cores included: they check that N ranks take
the step one process takes and hold what their strategy says, not that they are
faster. ``max_loss_difference`` (at most 1e-3), over every variant: the largest
difference between an N-rank and the 1-rank session's loss at the same step on the
same seed (float32 sums taken in another order: about 1e-7);
``fsdp_per_rank_over_share`` (at most 1.1x): the most any "fsdp" rank holds of
parameter, gradient and optimiser bytes over its 1/N share of one process's (FSDP2
cuts each tensor's first dimension into N, the last shard smaller where it does not
divide); ``ddp_per_rank_over_one_process`` (at most 1.0x): no "ddp" rank holds more
than the single process. Scaling is reported, not judged: N ranks on fewer than N
free cores cannot approach N.

It starts a local Ray cluster (its files in a temporary directory of its own); on a
shared machine run it inside a loopback-only network namespace.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlnb._errors import ConfigError
from rlnb.bench._common import BenchResult, Target
from rlnb.config import Config

__all__ = ["STRATEGIES", "parse_ranks", "parse_strategies", "run", "summarize", "time_ranks"]

# LearnConfig.strategy's values, in the order the variants run
STRATEGIES = ("fsdp", "ddp")


def parse_ranks(ranks: str | Sequence[int]) -> tuple[int, ...]:
    """``"1,2"`` (or a sequence of ints) as sorted distinct ints >= 1, with 1 (every
    figure's baseline) always among them. Raises ``ConfigError`` naming the value."""
    words = ranks.split(",") if isinstance(ranks, str) else list(ranks)
    try:
        values = {int(w) for w in words if str(w).strip()}
    except ValueError:
        values = set()
    if not values or min(values) < 1:
        raise ConfigError(f"--ranks {ranks!r} is invalid: give rank counts >= 1 separated by commas, e.g. --ranks 1,2")
    return tuple(sorted(values | {1}))


def parse_strategies(strategies: str | Sequence[str]) -> tuple[str, ...]:
    """``"fsdp,ddp"`` (or a sequence of names) as the distinct strategies among
    :data:`STRATEGIES`, in that order. Raises ``ConfigError`` naming the value."""
    words = strategies.split(",") if isinstance(strategies, str) else list(strategies)
    names = {str(w).strip() for w in words if str(w).strip()}
    if not names or not names <= set(STRATEGIES):
        raise ConfigError(
            f"--strategy {strategies!r} is invalid: give fsdp, ddp or both separated by a comma, "
            "e.g. --strategy fsdp,ddp"
        )
    return tuple(s for s in STRATEGIES if s in names)


def _variant(n: int, strategy: str) -> str:
    """A variant's figures' prefix: ``ranks{n}`` with "fsdp" (the default strategy), ``ranks{n}_ddp`` otherwise."""
    return f"ranks{n}" if n == 1 or strategy == "fsdp" else f"ranks{n}_{strategy}"


def _config(
    ranks: int,
    threads: int | None,
    strategy: str,
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    group_size: int,
    groups: int,
    ray_dir: str,
) -> Config:
    from rlnb.config import DataConfig, LearnConfig, ModelConfig, RayConfig, RolloutConfig, TrackConfig

    return Config(
        task="reverse",
        mode="sync",
        model=ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads),
        rollout=RolloutConfig(group_size=group_size, groups_per_step=groups),
        learn=LearnConfig(ranks=ranks, threads=threads, strategy=strategy),
        data=DataConfig(num_workers=0),
        track=TrackConfig(backends=()),
        # Ray's files in a directory of the bench's own: Ray looks there, not in the
        # shared /tmp/ray, for a cluster to join (a `ray start` there would be joined)
        ray=RayConfig(log_dir=ray_dir),
    )


class _Timed:
    """One session and the times of its measured steps; the learner's step (and, on
    ranks, the Ray call of it) is timed by wrapping it on the instance."""

    def __init__(self, sess: Any, group_size: int) -> None:
        self.sess, self.group_size = sess, group_size
        self.times: dict[str, list[float]] = {
            "step": [],
            "update": [],
            "update_cpu": [],
            "tokens": [],
            "call": [],
            "rank": [],
        }
        self.losses: list[float] = []
        self._last: dict[str, float] = {}
        learner = sess._trainer.learner
        learner.step = self._wrap(learner.step, "update")
        group = getattr(learner, "group", None)
        if group is not None:
            call = group.call

            def timed_call(method: str, *args: Any) -> list[Any]:
                if method != "step":
                    return call(method, *args)
                return self._wrap(call, "call")(method, *args)

            group.call = timed_call

    def _wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._last[key] = time.perf_counter() - start
                self._last[f"{key}_cpu"] = time.thread_time() - cpu

        return timed

    def step(self, measured: bool) -> None:
        self._last.clear()
        start = time.perf_counter()
        metrics = self.sess.step()
        took = time.perf_counter() - start
        self.losses.append(float(metrics["loss"]))
        if not measured:
            return
        self.times["step"].append(took)
        self.times["update"].append(self._last["update"])
        self.times["update_cpu"].append(self._last["update_cpu"])
        self.times["tokens"].append(metrics["response_length"] * metrics["groups"] * self.group_size)
        learner = self.sess.statistics().learner
        if learner is not None:
            self.times["call"].append(self._last["call"])
            self.times["rank"].append(max(r.step_seconds or 0.0 for r in learner.each))


def _memory(sess: Any) -> dict[str, Any]:
    """Each rank's parameter, gradient, optimiser and process bytes; for 1 rank the
    in-process learner's (its process's RSS is the session's, engine and all)."""
    import psutil
    import torch

    learner = sess.statistics().learner
    if learner is not None:
        return {
            "strategy": learner.parallelism,
            "each": [
                {
                    "parameters": r.parameter_bytes,
                    "gradients": r.gradient_bytes,
                    "optimizer": r.optimizer_bytes,
                    "rss": r.rss_bytes,
                }
                for r in learner.each
            ],
        }
    inprocess = sess._trainer.learner
    params = list(inprocess.policy.parameters())
    state = inprocess.optimizer.state.values()
    return {
        "strategy": "one process",
        "each": [
            {
                "parameters": sum(p.numel() * p.element_size() for p in params),
                "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                "optimizer": sum(
                    t.numel() * t.element_size()
                    for entry in state
                    for t in entry.values()
                    if isinstance(t, torch.Tensor)
                ),
                "rss": psutil.Process().memory_info().rss,
            }
        ],
    }


def _time_all_reduce(_rank: Any, numel: int, repeats: int) -> float:
    """Run inside each rank's actor (``__ray_call__``), on its process group: the
    median seconds of an all-reduce of ``numel`` float32s (a step's gradients)."""
    import torch
    import torch.distributed as dist

    flat = torch.zeros(numel)
    took = []
    for _ in range(repeats):
        dist.barrier()  # every rank starts together: the time is the collective's own
        start = time.perf_counter()
        dist.all_reduce(flat)
        took.append(time.perf_counter() - start)
    return statistics.median(took)


def _time_gather_scatter(rank: Any, repeats: int) -> tuple[float, int]:
    """Run inside each rank's actor (``__ray_call__``), on its process group: the
    median seconds of what one FSDP2 forward and backward pass exchanges (see the
    module docstring), with the rank's own units' sizes, and how many collectives."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    policy = rank.learner.policy
    world = dist.get_world_size()
    units: list[nn.Module] = list(filter(lambda m: isinstance(m, FSDPModule), policy.modules()))  # root, blocks
    blocks = [sum(p.numel() for p in m.parameters()) for m in units[1:]]
    sizes = [sum(p.numel() for p in policy.parameters()) - sum(blocks), *blocks]
    # FSDP2 pads each unit to a multiple of the ranks; each rank's shard is a 1/N of it
    shards = [torch.zeros(-(-n // world)) for n in sizes]
    wholes = [torch.zeros(world * s.numel()) for s in shards]
    gathers = [*range(len(sizes)), *range(1, len(sizes))]  # the forward's, then the backward's (blocks only)
    took = []
    for _ in range(repeats):
        dist.barrier()  # every rank starts together: the time is the collectives' own
        start = time.perf_counter()
        for i in gathers:
            dist.all_gather_into_tensor(wholes[i], shards[i])
        for i in reversed(range(len(sizes))):
            dist.reduce_scatter_tensor(shards[i], wholes[i])
        took.append(time.perf_counter() - start)
    return statistics.median(took), len(gathers) + len(sizes)


def _actors(sess: Any) -> list[Any]:
    """The Ray actors of an N-rank session's learner."""
    from rlnb.learn import RankedLearner

    learner = sess._trainer.learner
    assert isinstance(learner, RankedLearner)  # LearnConfig.ranks > 1
    return learner.group.actors


def _clock_cpu(rank: Any) -> None:
    """Run inside each rank's actor (``__ray_call__``): from now on, keep the CPU
    seconds of the thread that runs each step (one torch thread: the update's
    compute; gloo's own threads and Ray's not counted)."""
    learner = rank.learner
    step = learner.step
    rank.bench_cpu_s = []

    def clocked(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return step(*args, **kwargs)
        finally:
            rank.bench_cpu_s.append(time.thread_time() - start)

    learner.step = clocked


def _cpu_s(rank: Any) -> list[float]:
    """Run inside each rank's actor: the CPU seconds :func:`_clock_cpu` kept."""
    return list(rank.bench_cpu_s)


def _slowest(each: list[list[float]]) -> list[float]:
    """Per step, the largest of the ranks' figures (``each``: a list per rank)."""
    return [max(step) for step in zip(*each, strict=True)]


def _all_reduce_s(sess: Any, gradient_bytes: int, repeats: int = 10) -> float:
    """The ranks' all-reduce of their gradients, timed on their own group between steps."""
    import ray

    actors = _actors(sess)
    numel = gradient_bytes // 4
    return max(ray.get([a.__ray_call__.remote(_time_all_reduce, numel, repeats) for a in actors]))


def _gather_scatter_s(sess: Any, repeats: int = 10) -> tuple[float, int]:
    """The ranks' gathers and reduce-scatters of one FSDP2 pass, timed on their own
    group between steps; and how many collectives that is."""
    import ray

    each = ray.get([a.__ray_call__.remote(_time_gather_scatter, repeats) for a in _actors(sess)])
    return max(s for s, _ in each), each[0][1]


def time_ranks(
    ranks: Sequence[int],
    *,
    strategies: Sequence[str] = STRATEGIES,
    steps: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    group_size: int,
    groups_per_step: int,
    reference: bool = True,
) -> dict[str, Any]:
    """Measure (see the module docstring): the 1-rank session (and, with
    ``reference`` and more than one torch thread here, the in-process one on torch's
    threads) open throughout, each N-rank session (one per strategy of ``strategies``)
    in turn, ``steps`` measured steps each after one unmeasured, interleaved. Blocks for all of it; every session is
    closed when it returns or raises. Returns the raw figures for :func:`summarize`."""
    import ray
    import torch

    from rlnb.session import Session

    shape = {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "group_size": group_size}

    ray_dir = tempfile.mkdtemp(prefix="rlnb-bench-learner-")

    def config(n: int, threads: int | None, strategy: str = STRATEGIES[0]) -> Config:
        return _config(n, threads, strategy, groups=groups_per_step, ray_dir=ray_dir, **shape)

    threads = torch.get_num_threads()
    out: dict[str, Any] = {"threads": threads, "variants": {}}
    sessions: list[Any] = []
    try:
        base = Session(config(1, 1), name="bench-learner-1")
        sessions.append(base)
        timed = {"ranks1": _Timed(base, group_size)}
        if reference and threads > 1:
            sessions.append(Session(config(1, None), name="bench-learner-inprocess"))
            timed[f"inprocess_threads{threads}"] = _Timed(sessions[-1], group_size)
        fixed = list(timed.values())  # open throughout, stepped beside each N-rank session
        for t in fixed:
            t.step(measured=False)
        for n, strategy in [(n, strategy) for n in ranks if n > 1 for strategy in strategies]:
            key = _variant(n, strategy)
            started = time.perf_counter()
            sess = Session(config(n, 1, strategy), name=f"bench-learner-{n}-{strategy}")
            start_s = time.perf_counter() - started
            try:
                timed[key] = ranked = _Timed(sess, group_size)
                ranked.step(measured=False)
                actors = _actors(sess)
                ray.get([a.__ray_call__.remote(_clock_cpu) for a in actors])
                order = [ranked, *fixed]
                for i in range(steps):
                    for t in order if i % 2 == 0 else order[::-1]:
                        t.step(measured=True)
                memory = _memory(sess)
                entry: dict[str, Any] = {"ranks": n, "memory": memory, "start_s": start_s}
                if strategy == "ddp":
                    entry["all_reduce_s"] = _all_reduce_s(sess, max(r["gradients"] for r in memory["each"]))
                else:
                    entry["gather_scatter_s"], entry["gather_scatter_messages"] = _gather_scatter_s(sess)
                entry["rank_cpu"] = _slowest(ray.get([a.__ray_call__.remote(_cpu_s) for a in actors]))
                out["variants"][key] = entry
            finally:
                started = time.perf_counter()
                sess.close()
                out["variants"].setdefault(key, {})["close_s"] = time.perf_counter() - started
        if len(ranks) == 1:  # only the baseline asked for: measure it alone
            for i in range(steps):
                for t in fixed if i % 2 == 0 else fixed[::-1]:
                    t.step(measured=True)
        for key, t in timed.items():
            entry = out["variants"].setdefault(key, {})
            if "memory" not in entry:
                entry["memory"] = _memory(t.sess)
            entry["times"], entry["losses"] = t.times, t.losses
    finally:
        for sess in sessions:
            sess.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
    return out


def summarize(raw: dict[str, Any], *, model: str) -> BenchResult:
    """The result from :func:`time_ranks`'s figures: medians, the breakdown, memory
    per rank and the targets (see the module docstring)."""
    variants = raw["variants"]
    figures: dict[str, Any] = {
        "model": model,
        "threads": f"1 torch thread per process that updates (this machine: {raw['threads']} by default)",
        "timing": "sessions open side by side, steps interleaved one by one, medians after one unmeasured step",
    }

    def med(key: str, name: str) -> float:
        return round(statistics.median(variants[key]["times"][name]), 4)

    base_update = med("ranks1", "update")
    base_loss = variants["ranks1"]["losses"]
    one = variants["ranks1"]["memory"]["each"][0]
    one_held = one["parameters"] + one["gradients"] + one["optimizer"]
    max_difference = 0.0
    worst: dict[str, float] = {}  # per strategy: the most a rank holds, over what it may (see the targets)
    ranked = [k for k, v in variants.items() if "ranks" in v]  # the N-rank sessions, in the order they ran
    for key in ["ranks1", *ranked, *[k for k in variants if k.startswith("inprocess")]]:
        v = variants[key]
        times = v["times"]
        figures[f"{key}_steps_timed"] = len(times["update"])
        figures[f"{key}_update_s"] = med(key, "update")
        figures[f"{key}_tokens_per_s"] = round(statistics.median(times["tokens"]) / figures[f"{key}_update_s"], 1)
        figures[f"{key}_step_s"] = med(key, "step")
        if key == "ranks1":  # one torch thread: the update's CPU time is its thread's
            figures["ranks1_update_cpu_s"] = med(key, "update_cpu")
        each = v["memory"]["each"]
        held = max(r["parameters"] + r["gradients"] + r["optimizer"] for r in each)
        for part in ("parameters", "gradients", "optimizer"):
            figures[f"{key}_per_rank_{part}_bytes"] = max(r[part] for r in each)
        figures[f"{key}_per_rank_over_one_process"] = round(held / one_held, 4)
        if "ranks" in v:  # an N-rank session
            n, strategy = v["ranks"], v["memory"]["strategy"]
            share = n if strategy == "fsdp" else 1  # "fsdp": against its 1/N share; "ddp": against one process
            worst[strategy] = max(worst.get(strategy, 0.0), held * share / one_held)
            figures[f"{key}_strategy"] = strategy
            figures[f"{key}_rss_mib_each"] = [round(r["rss"] / 2**20, 1) for r in each]
            figures[f"{key}_rank_s"] = med(key, "rank")
            figures[f"{key}_ray_call_s"] = round(med(key, "call") - figures[f"{key}_rank_s"], 4)
            if "all_reduce_s" in v:
                figures[f"{key}_all_reduce_s"] = round(v["all_reduce_s"], 4)
            if "gather_scatter_s" in v:
                figures[f"{key}_gather_scatter_s"] = round(v["gather_scatter_s"], 4)
                figures[f"{key}_gather_scatter_messages"] = v["gather_scatter_messages"]
            figures[f"{key}_rank_cpu_s"] = round(statistics.median(v["rank_cpu"]), 4)
            figures[f"{key}_rank_waiting_s"] = round(figures[f"{key}_rank_s"] - figures[f"{key}_rank_cpu_s"], 4)
            cpu1 = figures["ranks1_update_cpu_s"]
            figures[f"{key}_rank_repeated_cpu_s"] = round((n * figures[f"{key}_rank_cpu_s"] - cpu1) / (n - 1), 4)
            figures[f"{key}_mirror_s"] = round(figures[f"{key}_update_s"] - med(key, "call"), 4)
            figures[f"{key}_rank_beyond_share_s"] = round(figures[f"{key}_rank_s"] - base_update / n, 4)
            figures[f"{key}_scaling_efficiency"] = round(base_update / (n * figures[f"{key}_update_s"]), 4)
            figures[f"{key}_start_s"] = round(v["start_s"], 2)
            figures[f"{key}_close_s"] = round(v["close_s"], 2)
            losses = v["losses"]
            difference = max(abs(a - b) for a, b in zip(losses, base_loss, strict=False))
            figures[f"{key}_max_loss_difference"] = difference
            max_difference = max(max_difference, difference)
        elif key.startswith("inprocess"):
            figures[f"{key}_speedup_over_ranks1"] = round(base_update / figures[f"{key}_update_s"], 4)
    targets = [Target("max_loss_difference", max_difference, "<=", 1e-3)]
    if "fsdp" in worst:
        targets.append(Target("fsdp_per_rank_over_share", round(worst["fsdp"], 4), "<=", 1.1, "x"))
    if "ddp" in worst:
        targets.append(Target("ddp_per_rank_over_one_process", round(worst["ddp"], 4), "<=", 1.0, "x"))
    return BenchResult("learner", figures, tuple(targets))


def run(
    *,
    ranks: str | Sequence[int] = "1,2",
    strategy: str | Sequence[str] = "fsdp,ddp",
    steps: int = 10,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    group_size: int = 8,
    groups_per_step: int = 8,
) -> BenchResult:
    """Measure; blocks for about 40 s at the defaults on two cores (Ray's start
    included). ``strategy``: the N-rank variants' ``LearnConfig.strategy``, one or
    both. Raises ``ConfigError`` for a ``ranks`` that is not rank counts or a
    ``strategy`` that is not strategies."""
    counts = parse_ranks(ranks)
    strategies = parse_strategies(strategy)
    raw = time_ranks(
        counts,
        strategies=strategies,
        steps=steps,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        group_size=group_size,
        groups_per_step=groups_per_step,
    )
    return summarize(raw, model=f"built-in policy: d_model {d_model}, {n_layers} layers of {n_heads} heads")
