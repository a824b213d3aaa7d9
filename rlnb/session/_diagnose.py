"""The session's diagnostics: ``Session.diagnose`` says why nothing is learning.

Each :class:`Finding` comes from what the session has already (no rollout, no
training): the last steps' metrics (``history``), the last batches trained on
(``batches``), a ``statistics()`` snapshot, the config in force and the reward
functions' timings. :func:`diagnose` is the pure function behind it, so that a test
can feed it a history it made up; the thresholds are the module's constants, and
docs/experiment.md has them as a table.
"""

from __future__ import annotations

import dataclasses
import html
import math
import statistics as stats_
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlnb import _reprs
from rlnb._errors import ConfigError, InvalidValueError
from rlnb.algorithms import describe
from rlnb.config import ONE_UPDATE, Config

if TYPE_CHECKING:
    from rlnb.config import Change
    from rlnb.data import Task
    from rlnb.learn import Trainer
    from rlnb.session._statistics import SessionStatistics
    from rlnb.track import Tracker

__all__ = ["Finding", "Findings", "diagnose", "diagnose_session"]

SEVERITIES = ("critical", "warning", "info")  # most severe first

# -- thresholds (docs/experiment.md, "Why is nothing learning?") ------------------------------
RECENT_BATCHES = 4  # kept batches read for zero variance and length cuts
RECENT_STEPS = 5  # steps averaged for entropy, gradient norm, clip fraction, staleness, accuracy
TREND_STEPS = 20  # steps a trend (reward, KL) is fitted over, by least squares
MIN_TREND_STEPS = 10  # with fewer steps no trend is judged
ZERO_VARIANCE_WARNING = 0.5  # share of recent groups whose samples all got the same reward
ZERO_VARIANCE_CRITICAL = 0.9
FLAT_RISE = 0.02  # reward units the fit rises by over its window, at most, for "flat"
LEARNED_RISE = 0.05  # the last TREND_STEPS' mean reward above the run's first TREND_STEPS' by this: it learned,
# and a flat trend since is a plateau (info), not a reward that never moved
FALL_DROP = 0.05  # and falls by, at least, for "falling" (its slope 2 standard errors below 0)
HIGH_ACCURACY = 0.9  # recent accuracy at which a flat reward or a sure policy is success, not a problem
ENTROPY_FLOOR = 0.05  # nats per token: below it (and accuracy below HIGH_ACCURACY) entropy collapsed
GRAD_NORM_FLOOR = 1e-4  # median gradient norm (before clipping) at or below it: the updates are empty
CLIP_FRACTION_HIGH = 0.2  # mean share of tokens whose ratio the PPO clip cut
CRITIC_EXPLAINED_FLOOR = 0.0  # a critic's mean explained variance at or below it: no better than a constant
LENGTH_CUT_WARNING = 0.5  # share of recent completions that stopped at max_new_tokens
LENGTH_CUT_CRITICAL = 0.9
LAG_NEAR = 0.8  # mean staleness at or above this share of max_policy_lag (async mode)
LAG_QUIET = 1  # max_policy_lag at or below it: samples a version old are what async mode is, not a finding
KL_RISE = 0.05  # nats the KL's fit rises by over its window (its slope 2 standard errors above 0)
FAILED_SHARE = 0.05  # failed samples of all ended ones at which failures are critical
SLOW_REWARD_SHARE = 0.5  # a reward's estimated seconds per step, as a share of the median step time
SLOW_REWARD_STEP_S = 1.0  # or, when no step time is known, in seconds
TIMEOUT_NEAR = 0.5  # a reward's p99 at this share of RolloutConfig.reward_timeout
QUEUED_CALLS = 8  # reward or environment calls waiting for a free thread, now
SLOW_RANK = 2.0  # a learner rank whose last step took this many times the fastest rank's


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing :meth:`~rlnb.Session.diagnose` found: ``severity`` ("critical": nothing
    can learn until it is fixed; "warning": learning is hampered; "info": worth
    knowing), ``code`` (a short stable id, e.g. ``"zero-variance"``), ``what`` was seen,
    with its numbers, and ``fix``: what to try."""

    severity: str
    code: str
    what: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise InvalidValueError(f"Finding(severity={self.severity!r}): use one of {SEVERITIES}")

    def __str__(self) -> str:
        return f"{self.severity} [{self.code}] {self.what}; fix: {self.fix}"


class Findings(list[Finding]):
    """What :meth:`~rlnb.Session.diagnose` found, most severe first (a list of
    :class:`Finding`); empty when nothing looks wrong."""

    def __init__(self, findings: Iterable[Finding] = ()) -> None:
        super().__init__(sorted(findings, key=lambda f: SEVERITIES.index(f.severity)))

    def counts(self) -> dict[str, int]:
        """How many findings of each severity, every severity named."""
        return {s: sum(f.severity == s for f in self) for s in SEVERITIES}

    def __repr__(self) -> str:
        if not self:
            return "Findings: nothing looks wrong"
        shown = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        lines = [f"Findings ({shown}):"]
        for f in self:
            lines += [f"  {f.severity:<8} {f.code}: {f.what}", f"  {'':<8} fix: {f.fix}"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self:
            return "<b>Findings</b>: nothing looks wrong"
        cell = 'style="text-align:left;vertical-align:top;padding:1px 1em 1px 0"'
        head = "".join(f"<th {cell}>{h}</th>" for h in ("severity", "code", "what", "fix"))
        body = "".join(
            f'<tr class="rlnb-finding" data-severity="{f.severity}">'
            f'<td {cell}><span style="color:{COLOURS[f.severity]};font-weight:bold">{f.severity}</span></td>'
            f"<td {cell}><code>{html.escape(f.code)}</code></td>"
            f"<td {cell}>{html.escape(f.what)}</td><td {cell}>{html.escape(f.fix)}</td></tr>"
            for f in self
        )
        return f'<b>Findings</b><table style="border-collapse:collapse"><tr>{head}</tr>{body}</table>'


COLOURS = {"critical": "#b00020", "warning": "#b26a00", "info": "#666666"}


def diagnose_session(
    trainer: Trainer,
    snapshot: SessionStatistics,
    config: Config,
    task: Task,
    *,
    custom_reward: bool,
    tracker: Tracker | None,
) -> Findings:
    """``Session.diagnose``: :func:`diagnose` of what the session's parts have now
    (the trainer's history and kept batches, a ``statistics()`` snapshot, the config,
    the task's reward timings unless a custom reward is in force, which is not timed);
    with ``tracker``, the counts of each severity logged at the current step."""
    rewards = None if custom_reward else task.rewards
    found = diagnose(
        trainer.history,
        list(trainer.batches)[-RECENT_BATCHES:],
        snapshot,
        config,
        {} if rewards is None else rewards.timings(),
        failures={} if rewards is None else rewards.failures(),
        batched=() if rewards is None else [f.name for f in rewards.functions if f.is_batched],
        step_seconds=_step_seconds(trainer, snapshot),
        changes=getattr(trainer, "changes", ()),
    )
    if tracker is not None:
        counts = {f"diagnose/{severity}": float(n) for severity, n in found.counts().items()}
        tracker.log(counts, step=trainer.version)
    return found


def _step_seconds(trainer: Any, snapshot: SessionStatistics) -> float | None:
    """The median step time: the trainer's own record of it where it keeps one, else
    from the steps/s of the last run; None before any."""
    seconds = list(getattr(trainer, "step_seconds", ()) or ())
    if seconds:
        return float(stats_.median(seconds))
    rate = snapshot.training.steps_per_s
    return 1.0 / rate if rate else None


# -- the pure function ---------------------------------------------------------------------------


def diagnose(
    history: Sequence[Mapping[str, float]],
    batches: Sequence[Any],
    statistics: SessionStatistics | None,
    config: Config,
    timings: Mapping[str, tuple[int, float, float]] | None = None,
    *,
    failures: Mapping[str, tuple[int, str]] | None = None,
    batched: Collection[str] = (),
    step_seconds: float | None = None,
    changes: Sequence[Change] = (),
) -> Findings:
    """The findings for a run, from ``history`` (each step's metrics, oldest first),
    ``batches`` (kept batches, or anything with ``.groups``), a ``statistics()``
    snapshot (None: the findings about rollouts, the engine and stalls are skipped),
    the ``config`` in force and the reward functions' ``timings`` and ``failures``
    (``Rewards.timings()``/``failures()``; ``batched``: the names of those called once
    per group). ``step_seconds``: the median step time, if known; ``changes``: the
    live settings changed (``Session.changes``). Pure: changes nothing."""
    found: list[Finding] = []
    if statistics is not None:
        found += _state(statistics, config)
        found += _failures(statistics, failures or {})
        found += _queued_calls(statistics, config)
    found += _slow_rewards(timings or {}, config, batched, step_seconds)
    if not history:
        found.append(
            Finding(
                "info",
                "no-steps",
                "no RL step has been trained yet, so nothing can be said about learning",
                "train a few steps (sess.train(20)) and ask again",
            )
        )
        return Findings(found)
    groups = [g for b in batches[-RECENT_BATCHES:] for g in getattr(b, "groups", b)]
    accuracy = _mean(history[-RECENT_STEPS:], "accuracy")
    found += _zero_variance(groups, config, accuracy)
    found += _length_cut(groups, config)
    found += _trends(history, config, accuracy)
    found += _recent(history, config, accuracy, statistics)
    found += _clip_inactive(history, config, changes)
    found += _critic(history, config)
    return Findings(found)


def _state(s: SessionStatistics, config: Config) -> list[Finding]:
    """What the session's state says: a stall, a dead engine, paused or stopped rollouts."""
    found = []
    stall = getattr(s, "stall", None)
    where = None if stall is None else getattr(stall, "where", None)
    if stall is not None:
        seconds = getattr(stall, "seconds", None)
        head = "a step has stalled" if seconds is None else f"no step has completed for {seconds:.0f} s"
        what = f"{head} (it waits on: {where or 'unknown'}): {getattr(stall, 'what', None) or stall}"
        fix = str(getattr(stall, "fix", None) or "sess.stacks() says where each thread is")
        found.append(Finding("critical", "stall", what, fix))
    died = s.engine.extra.get("died") if s.engine.extra else None
    if died:
        found.append(
            Finding(
                "critical",
                "engine-dead",
                f"the engine died: {_reprs.clip(str(died), 300)}",
                "make a new session (rlnb.Session(config, name=...) replaces this one); save() still works "
                "first, and Session.load() goes on from it",
            )
        )
    t, r = s.training, s.rollout
    if t.error:
        found.append(
            Finding(
                "critical",
                "training-failed",
                f"background training failed: {_reprs.clip(t.error, 300)}",
                "the session's next call raises it with its traceback; fix the cause and start() again",
            )
        )
    stepping = t.running or t.waiting is not None or (t.foreground is not None and t.foreground.call != "save()")
    if r.state in ("paused", "pausing") and where != "paused":  # a stall said so already
        kept = f"{r.kept_partial} samples kept as partial rollouts" if r.kept_partial else "nothing kept partial"
        waits = "; a step waits for them" if stepping else "; a step would wait for them"
        found.append(
            Finding(
                "critical" if stepping else "warning",
                "paused",
                f"rollouts are {r.state} ({kept}){waits}",
                "rollouts are paused: sess.rollouts.resume() (or the dashboard's resume)",
            )
        )
    elif (
        r.state == "running"
        and not r.dispatching
        and config.mode == "async"
        and t.waiting == "waiting for a batch"
        and where != "rollouts"
    ):
        found.append(
            Finding(
                "critical",
                "rollouts-stopped",
                f"background rollouts are stopped while a step waits for a batch ({sum(s.buffer.sizes.values())} "
                f"groups in the buffer, {config.rollout.groups_per_step} needed)",
                "sess.rollouts.start() starts them again",
            )
        )
    found += _policy_lag(s, config)
    found += _ranks(s)
    return found


def _ranks(s: SessionStatistics) -> list[Finding]:
    """The learner's ranks (``LearnConfig.ranks`` > 1): one that died, or one much slower than the others."""
    learner = getattr(s, "learner", None)
    if learner is None:
        return []
    if learner.dead is not None:
        return [
            Finding(
                "critical",
                "learner-rank-dead",
                f"learner {learner.dead}; the other ranks were stopped and no step can be taken",
                "restart_learner() starts new ranks from the weights of the last step (where it hung: see "
                "LearnConfig.rank_timeout)",
            )
        ]
    times = [(r.step_seconds, r.rank) for r in learner.each if r.step_seconds is not None]
    if len(times) < 2:
        return []
    (fastest, _), (slowest, rank) = min(times), max(times)
    if fastest <= 0 or slowest < SLOW_RANK * fastest:
        return []
    node = learner.each[rank].node
    return [
        Finding(
            "warning",
            "learner-rank-slow",
            f"learner rank {rank} (on {node}) took {slowest:.3g} s for its share of the last step, "
            f"{slowest / fastest:.1f}x the fastest rank's {fastest:.3g} s: every rank waits for it",
            "a busy or slower node: give the ranks nodes of their own (RayConfig.strategy='SPREAD'), or fewer ranks",
        )
    ]


def _policy_lag(s: SessionStatistics, config: Config) -> list[Finding]:
    r = s.rollout
    if config.mode != "async" or r.groups_allowed is None or r.groups_live < r.groups_allowed or not r.dispatching:
        return []
    return [
        Finding(
            "info",
            "policy-lag-budget",
            f"dispatch is held by the policy-lag budget ({r.groups_live} of {r.groups_allowed} groups live, "
            f"max_policy_lag {config.rollout.max_policy_lag}): generation outpaces the learner",
            "nothing to fix if steps go on; a larger max_policy_lag lets rollouts run further ahead (staler "
            "samples), and a faster learner (micro_batch_size, a GPU) uses them sooner",
        )
    ]


def _failures(s: SessionStatistics, failures: Mapping[str, tuple[int, str]]) -> list[Finding]:
    found = []
    r = s.rollout
    if r.failed:
        ended = r.finished + r.failed
        share = r.failed / ended if ended else 1.0
        what = f"{r.failed} samples failed after their retries ({r.groups_failed} groups, {share:.0%} of ended samples)"
        for name, (n, last) in failures.items():
            what += f"; reward function {name!r} failed {n} times, the last: {last}"
        fix = (
            "fix the reward function: the step that met it raised its error, chained with the traceback "
            "(RolloutConfig.max_retries retries a failing call)"
            if failures
            else "the step or call that met it raised the error, with the traceback: a reward function that "
            "raises, times out (RolloutConfig.reward_timeout) or returns something not a number, or the engine"
        )
        found.append(Finding("critical" if share >= FAILED_SHARE else "warning", "reward-failing", what, fix))
    if r.bad_prompts:
        found.append(
            Finding(
                "warning",
                "bad-prompts",
                f"{r.bad_prompts} prompts could not be made; the last: {_reprs.clip(r.last_bad_prompt or '?', 200)}",
                "fix the task's make_prompt (DataConfig.on_bad_prompt='skip' skips them meanwhile)",
            )
        )
    return found


def _queued_calls(s: SessionStatistics, config: Config) -> list[Finding]:
    """Reward or environment calls that wait for a thread: rollouts go at the pace of
    a few threads working through them (a slow tool one sample at a time)."""
    r, found = s.rollout, []
    for kind, queued, field in (
        ("environment", r.env_calls_queued, "env_workers"),
        ("reward", r.reward_calls_queued, "reward_workers"),
    ):
        if queued < QUEUED_CALLS:
            continue
        workers = getattr(config.rollout, field)
        found.append(
            Finding(
                "warning",
                f"{kind}-calls-queued",
                f"{queued} {kind} calls wait for a thread: RolloutConfig.{field}={workers} run at once, "
                f"so rollouts go at the pace of the {kind} calls",
                f"make the {kind} calls faster, or run more at once (RolloutConfig({field}=...), a new session) "
                "when they wait on something else (a sandbox, an API); sess.stacks() shows where the running ones are",
            )
        )
    return found


def _slow_rewards(
    timings: Mapping[str, tuple[int, float, float]], config: Config, batched: Collection[str], step_s: float | None
) -> list[Finding]:
    found = []
    r = config.rollout
    for name, (calls, p50, p99) in timings.items():
        per_step = r.groups_per_step * (1 if name in batched else r.group_size) / max(1, r.reward_workers)
        cost = p50 * per_step  # seconds of reward in each step, if the calls overlap nothing else
        slow = cost >= SLOW_REWARD_SHARE * step_s if step_s else cost >= SLOW_REWARD_STEP_S
        near_timeout = r.reward_timeout is not None and p99 >= TIMEOUT_NEAR * r.reward_timeout
        if not (slow or near_timeout):
            continue
        step = f" of each {_seconds(step_s)} step" if step_s else " per step"
        what = (
            f"reward function {name!r} takes {_seconds(p50)} a call (p50 of its last calls; p99 "
            f"{_seconds(p99)}; {calls} calls in all): about {_seconds(cost)}{step}"
        )
        if near_timeout:
            what += f"; its p99 is close to reward_timeout ({r.reward_timeout} s), past which a call fails"
        found.append(
            Finding(
                "warning",
                "reward-slow",
                what,
                "make it faster; score a group in one call (rlnb.rewards.batched); run more at once "
                f"(RolloutConfig(reward_workers=...), now {r.reward_workers}, a new session)",
            )
        )
    return found


def _zero_variance(groups: Sequence[Any], config: Config, accuracy: float | None) -> list[Finding]:
    if not groups:
        return []
    constant: list[float] = []
    for group in groups:
        values = [float(s.reward or 0.0) for s in group.samples]
        if values and max(values) - min(values) <= 1e-9:
            constant.append(values[0])
    share = len(constant) / len(groups)
    if share < ZERO_VARIANCE_WARNING:
        return []
    levels = sorted(set(constant))
    at = (
        f"all at {levels[0]:.3g}"
        if len(levels) == 1
        else f"at {len(levels)} values, {levels[0]:.3g} to {levels[-1]:.3g}"
    )
    size = config.rollout.group_size
    what = (
        f"{len(constant)} of the last {len(groups)} groups ({share:.0%}) gave every sample the same reward "
        f"({at}): their advantages are 0, so they teach nothing"
    )
    if min(levels) >= 1.0 and accuracy is not None and accuracy >= HIGH_ACCURACY:
        fix = (
            "if the task is solved, stop (sess.evaluate() on held-out prompts tells); if not, the reward gives "
            "full marks to anything: check it"
        )
        return [Finding("info", "zero-variance", what, fix)]
    fix = (
        "warm up first so some samples succeed (sess.warmup(), or Config(warmup=WarmupConfig(steps=200))); "
        f"a larger group_size (now {size}: sess.set(group_size={2 * size})) so a group more often holds a "
        "success and a failure; or a denser reward that gives partial credit"
    )
    return [Finding("critical" if share >= ZERO_VARIANCE_CRITICAL else "warning", "zero-variance", what, fix)]


def _length_cut(groups: Sequence[Any], config: Config) -> list[Finding]:
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return []
    cut = sum(s.finish_reason == "length" for s in samples)
    share = cut / len(samples)
    if share < LENGTH_CUT_WARNING:
        return []
    limit = config.rollout.max_new_tokens
    if limit is None:
        try:
            from rlnb.data import get_task

            limit = get_task(config.task).max_new_tokens
        except ConfigError:
            limit = None
    now = "the task's" if limit is None else str(limit)
    bigger = 8 if limit is None else 2 * limit
    return [
        Finding(
            "critical" if share >= LENGTH_CUT_CRITICAL else "warning",
            "length-cut",
            f"{cut} of the last {len(samples)} completions ({share:.0%}) stopped at the length limit, "
            f"max_new_tokens = {now}, before the end of their answer",
            f"if answers need more room, a larger max_new_tokens (now {now}: sess.set(max_new_tokens={bigger})); "
            "if they fit, the model has not learnt to stop: warm up first (sess.warmup())",
        )
    ]


def _trends(history: Sequence[Mapping[str, float]], config: Config, accuracy: float | None) -> list[Finding]:
    found = []
    learn = config.learn
    kl_coef = learn.resolved_algorithm.kl_coef
    fit = _fit(history, "reward_mean")
    if fit is not None:
        n, slope, se, first, last = fit
        rise = slope * (n - 1)
        numbers = f"{first:.3g} to {last:.3g} by a least-squares fit over the last {n} steps ({slope:+.2g} a step)"
        if rise <= -FALL_DROP and slope + 2 * se < 0:
            found.append(
                Finding(
                    "warning",
                    "reward-falling",
                    f"the reward is falling: {numbers}",
                    f"a lower lr (now {learn.lr:g}: sess.set(lr={learn.lr / 3:.2g})), a KL penalty to the "
                    "initial policy (kl_coef), or go back to a checkpoint (sess.changes lists what changed)",
                )
            )
        elif rise < FLAT_RISE and (learned := _learned(history)) is not None:
            before, since, steps = learned
            found.append(
                Finding(
                    "info",
                    "reward-plateau",
                    f"the reward rose from {before:.3g} to {since:.3g} over the run's {steps} steps (means of its "
                    f"first and last {TREND_STEPS}) and has levelled off: {numbers}",
                    "if that is good enough, stop (sess.evaluate() on held-out prompts tells); to go further: a larger "
                    f"group_size (now {config.rollout.group_size}) so harder prompts still hold a success and a "
                    "failure, or more steps",
                )
            )
        elif rise < FLAT_RISE:
            high = accuracy is not None and accuracy >= HIGH_ACCURACY
            fix = (
                "the task may be solved: sess.evaluate() on held-out prompts tells"
                if high
                else "see the other findings; if none applies: a larger lr (now "
                f"{learn.lr:g}), a larger group_size (now {config.rollout.group_size}) or a warm-up first"
            )
            found.append(Finding("info" if high else "warning", "reward-flat", f"the reward is flat: {numbers}", fix))
    fit = _fit(history, "kl")
    if fit is not None:
        n, slope, se, first, last = fit
        if slope * (n - 1) >= KL_RISE and last >= KL_RISE and slope - 2 * se > 0:
            found.append(
                Finding(
                    "warning",
                    "kl-growing",
                    f"the KL to the initial policy is growing: {first:.3g} to {last:.3g} over the last {n} steps "
                    f"({slope:+.2g} a step)",
                    f"a larger kl_coef (now {kl_coef:g}: sess.set(kl_coef={max(2 * kl_coef, 0.01):g})) "
                    f"or a lower lr (now {learn.lr:g})",
                )
            )
    return found


def _recent(
    history: Sequence[Mapping[str, float]], config: Config, accuracy: float | None, s: SessionStatistics | None
) -> list[Finding]:
    found = []
    recent, learn, rollout = history[-RECENT_STEPS:], config.learn, config.rollout
    k = len(recent)
    steps = f"the last {k} steps" if k > 1 else "the last step"
    entropy = _mean(recent, "entropy")
    if entropy is not None and entropy < ENTROPY_FLOOR and (accuracy is None or accuracy < HIGH_ACCURACY):
        acc = "" if accuracy is None else f" while accuracy is {accuracy:.2f}"
        found.append(
            Finding(
                "warning",
                "entropy-collapsed",
                f"the policy's entropy is {entropy:.3g} nats a token (mean of {steps}, under {ENTROPY_FLOOR}){acc}: "
                "the samples of a prompt are nearly all the same",
                f"more exploration: sess.set(temperature={rollout.temperature * 1.5:.2g}) (now "
                f"{rollout.temperature:g}); a lower lr (now {learn.lr:g}); a KL penalty to the initial policy "
                "(kl_coef)",
            )
        )
    norms = [float(m["grad_norm"]) for m in recent if _finite(m.get("grad_norm"))]
    if norms and stats_.median(norms) <= GRAD_NORM_FLOOR:
        found.append(
            Finding(
                "critical",
                "grad-norm-zero",
                f"the gradient norm is {stats_.median(norms):.2g} (median of {steps}): the updates change nothing",
                "the advantages are all zero: every sample of a group got the same reward (see zero-variance); "
                "check the reward on a few rollouts (sess.rollout())",
            )
        )
    # A step whose record says clip_active 0 had no clip that could act (its ratio was 1):
    # its clip_fraction of 0 is no measure, and a wider clip would change nothing.
    clip = _mean([m for m in recent if m.get("clip_active") != 0.0], "clip_fraction")
    if clip is not None and clip >= CLIP_FRACTION_HIGH:
        found.append(
            Finding(
                "warning",
                "clip-high",
                f"the PPO clip cut {clip:.0%} of tokens (mean of {steps}): each update moves the policy too far",
                f"a lower lr (now {learn.lr:g}), fewer epochs or minibatches (now {learn.epochs} and "
                f"{learn.minibatches}), or a wider clip range (now clip_low={learn.resolved_algorithm.clip_low:g}, "
                f"clip_high={learn.resolved_algorithm.clip_high:g})",
            )
        )
    staleness, lag = _mean(recent, "staleness"), rollout.max_policy_lag
    if config.mode == "async" and staleness is not None and lag and lag > LAG_QUIET and staleness >= LAG_NEAR * lag:
        live = "" if s is None else f"; {s.rollout.groups_live} of {s.rollout.groups_allowed} groups live"
        found.append(
            Finding(
                "warning",
                "policy-lag",
                f"samples are {staleness:.2g} policy versions old on average (mean of {steps}; max_policy_lag "
                f"{lag}){live}: rollouts run at the edge of the budget, on older weights",
                f"fresher samples with a smaller max_policy_lag (sess.set(max_policy_lag={max(0, lag - 1)})); if "
                "is_truncated_fraction is high, the off-policy correction is cutting their weight",
            )
        )
    return found


_CLIP_FIELDS = ("clip_eps", "clip_low", "clip_high")


def _clip_inactive(history: Sequence[Mapping[str, float]], config: Config, changes: Sequence[Change]) -> list[Finding]:
    """Clip settings changed while the last step's record says no clip could act."""
    changed = [c for c in changes if c.field in _CLIP_FIELDS]
    if not changed or not history or history[-1].get("clip_active") != 0.0:
        return []
    learn = config.learn
    said = ", ".join(f"{c.field} {_reprs.setting(c.old)} -> {_reprs.setting(c.new)} at step {c.step}" for c in changed)
    if learn.why_no_clip == ONE_UPDATE:
        return [
            Finding(
                "info",
                "clip-inactive",
                f"the clip settings changed ({said}), but no clip acts: with epochs=1 and minibatches=1 each batch "
                "gets one update, which starts from the proximal policy itself, so the ratio is 1 and the clip "
                "never cuts (clip_active 0 in the step's record)",
                "for the clip to act, more than one update per batch: LearnConfig(epochs=2) or minibatches > 1, "
                "which need a new session (rlnb.Session(config, ...), or Session.load from a checkpoint)",
            )
        ]
    if callable(learn.resolved_algorithm.loss):  # a loss function may read the clip settings itself
        return []
    loss = describe(learn.resolved_algorithm.loss)
    return [
        Finding(
            "info",
            "clip-inactive",
            f"the clip settings changed ({said}), but the loss {loss!r} has no clip (clip_active 0 in the step's "
            "record)",
            'a loss with a clip for them to act on: sess.set(algorithm="grpo") (ppo_clip), "gspo" or "cispo"',
        )
    ]


def _critic(history: Sequence[Mapping[str, float]], config: Config) -> list[Finding]:
    """A critic (``advantage="gae"``) whose values, over the last steps that had one
    (at least MIN_TREND_STEPS: it needs a few to learn), explain none of the returns."""
    with_critic = [m for m in history[-TREND_STEPS:] if _finite(m.get("explained_variance"))]
    if len(with_critic) < MIN_TREND_STEPS:
        return []
    explained = stats_.fmean(float(m["explained_variance"]) for m in with_critic)
    if explained > CRITIC_EXPLAINED_FLOOR:
        return []
    algorithm = config.learn.resolved_algorithm
    rate = "the policy's lr" if algorithm.critic_lr is None else f"{algorithm.critic_lr:g}"
    return [
        Finding(
            "warning",
            "critic-not-learning",
            f"the critic's values explain {explained:.2f} of the returns' variance (mean of the last "
            f"{len(with_critic)} steps with a critic): GAE's advantages are no better than with a constant baseline",
            f"a critic that learns faster: sess.set(algorithm=sess.config.learn.resolved_algorithm.replace("
            f'critic_lr=...)) (now {rate}); or an algorithm without a critic, e.g. sess.set(algorithm="grpo")',
        )
    ]


# -- helpers --------------------------------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mean(history: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [float(m[key]) for m in history if _finite(m.get(key))]
    return stats_.fmean(values) if values else None


def _fit(history: Sequence[Mapping[str, float]], key: str) -> tuple[int, float, float, float, float] | None:
    """A least-squares line through ``key`` over the last :data:`TREND_STEPS` steps:
    ``(n, slope a step, its standard error, fitted first, fitted last)``; None with
    fewer than :data:`MIN_TREND_STEPS` values."""
    values = [float(m[key]) for m in history[-TREND_STEPS:] if _finite(m.get(key))]
    n = len(values)
    if n < MIN_TREND_STEPS:
        return None
    xs = range(n)
    mx, my = (n - 1) / 2, stats_.fmean(values)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, values, strict=True))
    se = math.sqrt(residual / (n - 2) / sxx)
    return n, slope, se, intercept, intercept + slope * (n - 1)


def _learned(history: Sequence[Mapping[str, float]]) -> tuple[float, float, int] | None:
    """``(mean reward of the run's first TREND_STEPS steps, of its last, steps)`` where
    the last are above the first by :data:`LEARNED_RISE` at least, without overlap; else None."""
    values = [float(m["reward_mean"]) for m in history if _finite(m.get("reward_mean"))]
    if len(values) < 2 * TREND_STEPS:
        return None
    before, since = stats_.fmean(values[:TREND_STEPS]), stats_.fmean(values[-TREND_STEPS:])
    return (before, since, len(values)) if since - before >= LEARNED_RISE else None


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
