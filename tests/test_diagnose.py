"""``Session.diagnose()``: why nothing is learning, from what the session has already.

Each finding has a session built to trigger it (a constant reward, a completion
limit of one token, rollouts left paused, a reward that raises or is slow, a stall),
or, for what only a long run shows (entropy collapse, an empty gradient, a clipped
update, trends), a made-up history fed to the pure function :func:`diagnose`. A run
that learns gets no critical finding; the dashboard shows the most severe finding
in a banner, computed at most every few seconds, never per tick.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

import rlnb
import rlnb.notebook
from rlnb._samples import Group, Sample
from rlnb.config import Change
from rlnb.data import get_task, register_task
from rlnb.rewards import Rewards
from rlnb.session._diagnose import (
    CLIP_FRACTION_HIGH,
    ENTROPY_FLOOR,
    LAG_QUIET,
    LEARNED_RISE,
    MIN_TREND_STEPS,
    RECENT_STEPS,
    TREND_STEPS,
    Finding,
    Findings,
    diagnose,
)
from tests.helpers import small_config, wait_until

CONFIG = small_config()
ADDITION = get_task("addition")


def codes(findings: Findings) -> dict[str, str]:
    """``{code: severity}`` of each finding."""
    return {f.code: f.severity for f in findings}


def step(**metrics: float) -> dict[str, float]:
    """A step's metrics as the learner records them, healthy unless overridden."""
    base = {
        "reward_mean": 0.5,
        "reward_std": 0.4,
        "accuracy": 0.5,
        "entropy": 0.8,
        "grad_norm": 0.5,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "staleness": 0.0,
        "lr": 1e-4,
    }
    return {**base, **metrics}


def rising(n: int = TREND_STEPS) -> list[dict[str, float]]:
    return [step(reward_mean=0.2 + 0.02 * i, accuracy=0.2 + 0.02 * i) for i in range(n)]


def by_code(findings: Findings, code: str) -> Finding:
    (found,) = [f for f in findings if f.code == code]
    return found


# -- the pure function, on made-up histories ------------------------------------------------------


def test_a_healthy_history_gives_no_finding() -> None:
    assert diagnose(rising(), [], None, CONFIG) == []
    assert repr(diagnose(rising(), [], None, CONFIG)) == "Findings: nothing looks wrong"


def test_no_step_yet_is_said_and_nothing_else_is_judged() -> None:
    found = diagnose([], [], None, CONFIG)
    assert codes(found) == {"no-steps": "info"}


def test_entropy_collapse_is_a_warning_unless_the_policy_is_right() -> None:
    history = rising()[:-5] + [step(entropy=ENTROPY_FLOOR / 5, accuracy=0.3) for _ in range(5)]
    finding = by_code(diagnose(history, [], None, CONFIG), "entropy-collapsed")
    assert finding.severity == "warning"
    assert "0.01 nats a token" in finding.what and "accuracy is 0.30" in finding.what
    assert "temperature=1.5" in finding.fix and "(now 1)" in finding.fix
    sure_and_right = rising()[:-5] + [step(entropy=0.01, accuracy=0.95, reward_mean=0.95) for _ in range(5)]
    assert "entropy-collapsed" not in codes(diagnose(sure_and_right, [], None, CONFIG))


def test_a_gradient_norm_near_zero_is_critical() -> None:
    history = rising()[:-5] + [step(grad_norm=0.0) for _ in range(5)]
    finding = by_code(diagnose(history, [], None, CONFIG), "grad-norm-zero")
    assert finding.severity == "critical" and "the gradient norm is 0" in finding.what


def test_a_high_clip_fraction_names_the_settings_to_lower() -> None:
    config = small_config(learn=rlnb.LearnConfig(epochs=4, lr=1e-3))
    history = rising()[:-5] + [step(clip_fraction=CLIP_FRACTION_HIGH + 0.1) for _ in range(5)]
    finding = by_code(diagnose(history, [], None, config), "clip-high")
    assert finding.severity == "warning" and "30% of tokens" in finding.what
    assert "now 0.001" in finding.fix and "now 4 and 1" in finding.fix


def test_a_clip_that_cannot_act_is_never_high_nor_widened() -> None:
    # clip_active 0: one update per batch, the ratio is 1; a clip fraction there is no measure
    history = rising()[:-5] + [step(clip_active=0.0, clip_fraction=0.5) for _ in range(5)]
    assert "clip-high" not in codes(diagnose(history, [], None, CONFIG))
    # steps that could clip count, those that could not are left out of the mean
    mixed = rising()[:-5] + [step(clip_active=1.0, clip_fraction=0.3)] + [step(clip_active=0.0) for _ in range(4)]
    finding = by_code(diagnose(mixed, [], None, small_config(learn=rlnb.LearnConfig(epochs=2))), "clip-high")
    assert "30% of tokens (mean of the last 5 steps)" in finding.what


def test_clip_settings_changed_while_the_clip_is_inactive_are_said_to_change_nothing() -> None:
    history = [*rising()[:-1], step(clip_active=0.0)]
    changes = [Change(3, "clip_eps", 0.2, 0.1)]
    finding = by_code(diagnose(history, [], None, CONFIG, changes=changes), "clip-inactive")
    assert finding.severity == "info"
    assert finding.what.startswith("the clip settings changed (clip_eps 0.2 -> 0.1 at step 3), but no clip acts")
    assert "with epochs=1 and minibatches=1 each batch gets one update" in finding.what
    assert "the ratio is 1 and the clip never cuts" in finding.what
    assert "LearnConfig(epochs=2) or minibatches > 1, which need a new session" in finding.fix
    # no clip change, or a clip that acts: nothing to say
    assert "clip-inactive" not in codes(diagnose(history, [], None, CONFIG))
    assert "clip-inactive" not in codes(diagnose(history, [], None, CONFIG, changes=[Change(3, "lr", 1e-4, 1e-3)]))
    acting = [*rising()[:-1], step(clip_active=1.0)]
    assert "clip-inactive" not in codes(diagnose(acting, [], None, CONFIG, changes=changes))
    # several updates, a loss without a clip: the loss is named instead
    sapo = small_config(learn=rlnb.LearnConfig(epochs=2, algorithm="sapo"))
    changes = [Change(3, "clip_high", 0.2, 0.28)]
    finding = by_code(diagnose(history, [], None, sapo, changes=changes), "clip-inactive")
    assert "but the loss 'sapo' has no clip" in finding.what and 'sess.set(algorithm="grpo")' in finding.fix


def test_a_flat_reward_needs_enough_steps_and_a_falling_one_is_its_own_finding() -> None:
    flat = [step(reward_mean=0.3 + 0.001 * (i % 2)) for i in range(MIN_TREND_STEPS)]
    finding = by_code(diagnose(flat, [], None, CONFIG), "reward-flat")
    assert finding.severity == "warning" and f"over the last {MIN_TREND_STEPS} steps" in finding.what
    assert "reward-flat" not in codes(diagnose(flat[:-1], [], None, CONFIG))  # too few steps to judge
    falling = [step(reward_mean=0.8 - 0.02 * i) for i in range(TREND_STEPS)]
    found = codes(diagnose(falling, [], None, CONFIG))
    assert found["reward-falling"] == "warning" and "reward-flat" not in found
    solved = [step(reward_mean=1.0, accuracy=1.0) for _ in range(TREND_STEPS)]
    assert codes(diagnose(solved, [], None, CONFIG))["reward-flat"] == "info"


def test_only_the_last_steps_count_for_a_trend() -> None:
    history = [step(reward_mean=0.0) for _ in range(50)] + rising()
    assert "reward-flat" not in codes(diagnose(history, [], None, CONFIG))


def test_a_growing_kl_suggests_a_larger_kl_coef() -> None:
    config = small_config(learn=rlnb.LearnConfig(kl_coef=0.01))
    history = [step(kl=0.01 * i, reward_mean=0.2 + 0.02 * i) for i in range(TREND_STEPS)]
    finding = by_code(diagnose(history, [], None, config), "kl-growing")
    assert "0 to 0.19" in finding.what and "sess.set(kl_coef=0.02)" in finding.fix


def test_staleness_near_the_policy_lag_is_reported_in_async_mode_only() -> None:
    history = rising()[:-5] + [step(staleness=3.5) for _ in range(5)]
    async_config = small_config(mode="async", rollout=rlnb.RolloutConfig(group_size=4, max_policy_lag=4))
    finding = by_code(diagnose(history, [], None, async_config), "policy-lag")
    assert "3.5 policy versions old" in finding.what and "max_policy_lag 4" in finding.what
    assert "policy-lag" not in codes(diagnose(history, [], None, CONFIG))


def test_samples_a_version_old_under_the_default_policy_lag_are_not_a_finding() -> None:
    # max_policy_lag=1, the default the README recommends: one version old is what async mode is
    history = rising()[:-5] + [step(staleness=1.0) for _ in range(5)]
    default = small_config(mode="async", rollout=rlnb.RolloutConfig(group_size=4))
    assert default.rollout.max_policy_lag == LAG_QUIET == 1
    assert diagnose(history, [], None, default) == []


def test_a_run_that_learned_and_levelled_off_is_a_plateau_not_flat() -> None:
    # as notebook 01's RL: 0.63 to 0.89 in 130 steps, then 20 steps level
    climb = [step(reward_mean=0.63 + 0.002 * i, accuracy=0.5) for i in range(130)]
    run = climb + [step(reward_mean=0.89 + 0.001 * (i % 2), accuracy=0.5) for i in range(TREND_STEPS)]
    found = diagnose(run, [], None, CONFIG)
    assert codes(found) == {"reward-plateau": "info"}, found
    plateau = by_code(found, "reward-plateau")
    assert f"over the run's 150 steps (means of its first and last {TREND_STEPS})" in plateau.what
    assert "warm-up" not in plateau.fix
    # a rise smaller than LEARNED_RISE, or a run too short to tell, is still flat
    small = [step(reward_mean=0.3 + LEARNED_RISE / 2 * (i >= TREND_STEPS)) for i in range(2 * TREND_STEPS)]
    assert codes(diagnose(small, [], None, CONFIG)) == {"reward-flat": "warning"}
    assert codes(diagnose(run[-2 * TREND_STEPS + 1 :], [], None, CONFIG)) == {"reward-flat": "warning"}


def test_the_session_judges_a_plateau_from_its_whole_run() -> None:
    with rlnb.Session(CONFIG, name="diagnose-plateau") as sess:
        climb = [step(reward_mean=0.2 + 0.01 * i) for i in range(60)]
        sess._trainer.history[:] = climb + [step(reward_mean=0.8) for _ in range(TREND_STEPS)]
        assert "reward-plateau" in codes(sess.diagnose(track=False))


def test_a_slow_reward_is_measured_against_the_step() -> None:
    timings = {"judge": (64, 0.05, 0.08), "exact": (64, 1e-6, 2e-6)}
    found = diagnose(rising(), [], None, CONFIG, timings, step_seconds=1.0)  # 16 calls a step
    finding = by_code(found, "reward-slow")
    assert "'judge' takes 50 ms a call" in finding.what and "p99 80 ms" in finding.what
    assert "800 ms of each 1 s step" in finding.what
    batched = diagnose(rising(), [], None, CONFIG, timings, batched=["judge"], step_seconds=1.0)  # 4 calls
    assert "reward-slow" not in codes(batched)
    without_steps = diagnose(rising(), [], None, CONFIG, {"judge": (10, 0.5, 0.6)})  # 8 s a step
    assert "about 8 s per step" in by_code(without_steps, "reward-slow").what
    near = small_config(rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4, reward_timeout=1.0))
    close = by_code(diagnose(rising(), [], None, near, {"f": (10, 0.001, 0.7)}, step_seconds=1.0), "reward-slow")
    assert "close to reward_timeout (1.0 s)" in close.what


def _group(*rewards: float, finish: str = "stop") -> Group:
    samples = tuple(Sample(prompt="1+1=", completion="2", reward=r, finish_reason=finish) for r in rewards)
    return Group("1+1=", samples)


def test_zero_variance_and_length_cuts_are_read_from_the_kept_groups() -> None:
    flat = [_group(0.0, 0.0, 0.0, 0.0) for _ in range(9)] + [_group(0.0, 1.0, 0.0, 0.0)]
    finding = by_code(diagnose(rising(), [flat], None, CONFIG), "zero-variance")
    assert finding.severity == "critical" and "9 of the last 10 groups (90%)" in finding.what
    assert "all at 0" in finding.what and "sess.set(group_size=8)" in finding.fix
    assert "WarmupConfig(steps=200)" in finding.fix and "partial credit" in finding.fix
    half = [_group(0.0, 0.0) for _ in range(5)] + [_group(0.0, 1.0) for _ in range(5)]
    assert codes(diagnose(rising(), [half], None, CONFIG))["zero-variance"] == "warning"
    cut = [_group(0.0, 0.0, finish="length"), _group(0.0, 1.0, finish="length")]
    finding = by_code(diagnose(rising(), [cut], None, CONFIG), "length-cut")
    assert finding.severity == "critical" and "max_new_tokens = 4" in finding.what  # addition's own
    assert "sess.set(max_new_tokens=8)" in finding.fix


def test_findings_are_sorted_by_severity_and_read_well() -> None:
    found = Findings(
        [Finding("info", "c", "x", "y"), Finding("critical", "a", "what", "fix"), Finding("warning", "b", "x", "y")]
    )
    assert [f.code for f in found] == ["a", "b", "c"]
    assert found.counts() == {"critical": 1, "warning": 1, "info": 1}
    assert repr(found).splitlines()[:3] == [
        "Findings (1 critical, 1 warning, 1 info):",
        "  critical a: what",
        "           fix: fix",
    ]
    assert str(found[0]) == "critical [a] what; fix: fix"
    page = found._repr_html_()
    assert page.count('class="rlnb-finding"') == 3 and 'data-severity="critical"' in page
    with pytest.raises(ValueError, match="severity"):
        Finding("bad", "a", "b", "c")


# -- reward timings --------------------------------------------------------------------------------


def test_timings_and_failures_survive_new_weights() -> None:
    def fine(completion: str, answer: Any) -> float:
        return 1.0

    def raises(completion: str, answer: Any) -> float:
        raise ValueError("boom")

    rewards = Rewards.of([fine, raises], None)
    weighted = rewards.with_weights([2.0, 0.5])  # what the rollouter calls after set(reward_weights=...)
    for _ in range(3):
        weighted.functions[0]("1", "1")
    with pytest.raises(ValueError):
        weighted.functions[1]("1", "1")
    calls, p50, p99 = rewards.timings()["fine"]
    assert calls == 3 and 0 <= p50 <= p99 < 0.1
    assert rewards.failures() == {"raises": (1, "ValueError: boom")}
    assert weighted.timings() == rewards.timings()


# -- sessions built to trigger each finding --------------------------------------------------------


def test_a_session_whose_clip_settings_changed_with_one_update_per_batch_says_the_clip_is_inactive() -> None:
    with rlnb.Session(CONFIG, name="diagnose-clip") as sess:
        sess.set(clip_eps=0.1)
        sess.step()
        assert sess.history[-1]["clip_active"] == 0.0
        finding = by_code(sess.diagnose(track=False), "clip-inactive")
        assert "clip_eps 0.2 -> 0.1 at step 0" in finding.what and "the ratio is 1" in finding.what


def test_a_constant_reward_is_zero_variance_and_a_flat_reward_and_is_logged(tmp_path: Path) -> None:
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path))
    with rlnb.Session(small_config(track=track), name="diagnose") as sess:
        sess.rollouts.set_reward(lambda completion, answer: 0.0)
        sess.train(MIN_TREND_STEPS, progress=False)
        found = sess.diagnose()
        assert found[0].severity == "critical"
        assert codes(found)["zero-variance"] == "critical" and codes(found)["grad-norm-zero"] == "critical"
        assert codes(found)["reward-flat"] == "warning"
        assert "16 of the last 16 groups (100%)" in by_code(found, "zero-variance").what  # 4 batches of 4 groups
        sess.rollouts.set_reward(lambda completion, answer: 1.0)  # everyone right: solved, or a reward that says so
        sess.train(RECENT_STEPS, progress=False)  # batches and accuracy: all at 1
        assert codes(sess.diagnose(track=False))["zero-variance"] == "info"
        version = sess.version
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "diagnose/critical" in r]
    assert len(logged) == 1 and logged[0]["step"] == version - RECENT_STEPS
    assert logged[0]["diagnose/critical"] >= 2 and "diagnose/warning" in logged[0] and "diagnose/info" in logged[0]


def test_a_too_short_completion_limit_names_its_value() -> None:
    config = small_config(rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4, max_new_tokens=1))
    with rlnb.Session(config, name="diagnose") as sess:
        sess.step()
        finding = by_code(sess.diagnose(), "length-cut")
    assert finding.severity == "critical" and "max_new_tokens = 1" in finding.what
    assert "sess.set(max_new_tokens=2)" in finding.fix


def test_rollouts_left_paused_say_resume() -> None:
    with rlnb.Session(CONFIG, name="diagnose") as sess:
        sess.rollouts.pause()
        finding = by_code(sess.diagnose(), "paused")
        assert finding.severity == "warning" and "rollouts are paused: sess.rollouts.resume()" in finding.fix
        sess.rollouts.resume()
        assert "paused" not in codes(sess.diagnose())


def test_a_stall_comes_first() -> None:
    with rlnb.Session(small_config(mode="async", stall_after=1.0), name="diagnose") as sess:
        sess.rollouts.pause()
        sess.training.start(steps=1)
        wait_until(lambda: sess.statistics().stall is not None, "a stall", timeout=15)
        found = sess.diagnose()
        assert found[0].code == "stall" and found[0].severity == "critical"
        assert "(it waits on: paused)" in found[0].what and found[0].fix == "call sess.rollouts.resume()"
        assert "paused" not in codes(found)  # the stall said it
        sess.rollouts.resume()
        sess.training.wait(timeout=30)


def test_a_failing_reward_is_critical_and_names_its_last_error() -> None:
    def explodes(completion: str, answer: Any) -> float:
        raise ZeroDivisionError("the reward divided by zero")

    task = register_task(dataclasses.replace(ADDITION, name="diagnose-explodes", reward=explodes), replace=True)
    with rlnb.Session(small_config(task=task.name), name="diagnose") as sess:
        with pytest.raises(rlnb.RolloutError):
            sess.step()
        finding = by_code(sess.diagnose(), "reward-failing")
    assert finding.severity == "critical" and "samples failed after their retries" in finding.what
    assert "reward function 'explodes' failed" in finding.what
    assert "ZeroDivisionError: the reward divided by zero" in finding.what


def test_a_slow_reward_shows_its_p99() -> None:
    exact = ADDITION.rewards.functions[0].fn

    def slow(completion: str, answer: Any) -> float:
        time.sleep(0.05)
        return float(exact(completion, answer))

    task = register_task(dataclasses.replace(ADDITION, name="diagnose-slow", reward=slow), replace=True)
    with rlnb.Session(small_config(task=task.name), name="diagnose") as sess:
        sess.step()
        finding = by_code(sess.diagnose(), "reward-slow")
    assert finding.severity == "warning", finding
    # each call sleeps 50 ms, and takes longer on a busy machine
    shown = re.search(
        r"'slow' takes ([\d.]+) ms a call \(p50 of its last calls; p99 ([\d.]+) ms; \d+ calls in all", finding.what
    )
    assert shown and 50 <= float(shown[1]) <= float(shown[2]), finding.what


def test_a_run_that_learns_gets_no_critical_finding() -> None:
    config = small_config(warmup=rlnb.WarmupConfig(steps=60, batch_size=64, lr=3e-3))
    with rlnb.Session(config, name="diagnose") as sess:
        sess.warmup(progress=False)
        sess.train(MIN_TREND_STEPS, progress=False)
        found = sess.diagnose()
    assert [f for f in found if f.severity == "critical"] == [], repr(found)


def test_a_closed_session_is_diagnosed_only_without_raising() -> None:
    sess = rlnb.Session(CONFIG, name="diagnose")
    sess.close()
    with pytest.raises(rlnb.ClosedError):
        sess.diagnose()
    assert codes(sess.diagnose(raise_errors=False, track=False)) == {"no-steps": "info"}


# -- the dashboard's banner ------------------------------------------------------------------------


def test_the_dashboard_shows_the_worst_finding_in_a_banner_not_on_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    with rlnb.Session(CONFIG, name="diagnose") as sess:
        dash = rlnb.notebook.dashboard(sess, interval=60.0)  # its ticker ticks once, then waits
        wait_until(lambda: dash.ticks == 1, "the ticker's one tick")
        assert 'data-code="no-steps"' in dash.diagnosis.value
        sess.rollouts.pause()
        calls: list[dict[str, Any]] = []
        diagnose_now = type(sess).diagnose

        def counted(self: rlnb.Session, **kwargs: Any) -> Findings:
            calls.append(kwargs)
            return diagnose_now(self, **kwargs)

        monkeypatch.setattr(type(sess), "diagnose", counted)
        dash._next_diagnosis = 0.0  # due now
        dash.tick()
        for _ in range(5):
            dash.tick()  # not due again for DIAGNOSE_INTERVAL s
        assert calls == [{"track": False, "raise_errors": False}]
        banner = dash.diagnosis.value
        assert 'data-severity="warning"' in banner and 'data-code="paused"' in banner and "resume()" in banner
        assert dash.diagnosis_toggle.description == "all 2 findings"  # paused, and no steps yet
        assert dash.diagnosis_all.layout.display == "none"
        dash.diagnosis_toggle.value = True
        assert dash.diagnosis_all.layout.display is None and dash.diagnosis_all.value.count("rlnb-finding") == 2
        assert 'data-code="paused"' in dash.static_html() and "all 2 findings" in dash.static_html()
        dash.close()


def test_the_thresholds_docs_experiment_md_names_are_the_modules_constants() -> None:
    import rlnb.session._diagnose as module

    text = (Path(__file__).resolve().parents[1] / "docs" / "experiment.md").read_text()
    table = text[text.index("| code | severity |") :].split("\n\n", 1)[0]
    named = re.findall(r"`([A-Z][A-Z0-9_]+)` = ([0-9.e+-]+)( s| %)?", table)
    assert len({name for name, _, _ in named}) >= 20, named
    for name, value, unit in named:
        expected = getattr(module, name)
        assert float(value) / (100 if unit == " %" else 1) == pytest.approx(expected), (name, value, expected)
    # and every finding the module can give has its row
    codes_in_code = set(re.findall(r'"(?:critical|warning|info)",\s*"([a-z-]+)"', Path(module.__file__).read_text()))
    codes_in_code |= {"reward-flat", "reward-failing", "zero-variance", "length-cut", "stall", "paused"}
    codes_in_code -= {"critical", "warning", "info"}
    rows = set(re.findall(r"^\| `([a-z-]+)` \|", table, re.M))
    assert codes_in_code <= rows, codes_in_code - rows


class _SlowTool:
    """An environment whose every step takes a while: a tool behind a slow service."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, completion: str) -> Any:
        time.sleep(0.2)
        return rlnb.envs.Turn("=1;", done=True)


def test_environment_calls_waiting_for_a_thread_are_named_with_the_setting() -> None:
    # A slow tool on one thread made rollouts crawl, and nothing said why.
    addition = get_task("addition")
    register_task(
        rlnb.data.Task(
            "diagnose_slow_tool",
            alphabet=addition.alphabet + ";",
            make_prompt=addition.make_prompt,
            reward=lambda completion, answer: 0.0,
            max_new_tokens=addition.max_new_tokens,
            env=_SlowTool,
            max_turns=2,
        ),
        replace=True,
    )
    rollout = rlnb.RolloutConfig(group_size=4, groups_per_step=4, env_workers=1, max_policy_lag=None)
    config = small_config(mode="async", task="diagnose_slow_tool", rollout=rollout)
    with rlnb.Session(config, name="diagnose") as sess:
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().rollout.env_calls_queued >= 8, "tool calls to queue up", timeout=30)
        finding = by_code(sess.diagnose(), "environment-calls-queued")
        assert finding.severity == "warning" and "RolloutConfig.env_workers=1 run at once" in finding.what
        assert "RolloutConfig(env_workers=...)" in finding.fix
        sess.rollouts.stop()


def test_a_critic_whose_values_explain_nothing_is_said_with_its_learning_rate() -> None:
    ppo = small_config(learn=rlnb.LearnConfig(algorithm=rlnb.algorithms.preset("ppo").replace(critic_lr=1e-5)))
    flat = [*rising()[:-MIN_TREND_STEPS], *(step(explained_variance=-0.05) for _ in range(MIN_TREND_STEPS))]
    finding = by_code(diagnose(flat, [], None, ppo), "critic-not-learning")
    assert finding.severity == "warning"
    assert f"explain -0.05 of the returns' variance (mean of the last {MIN_TREND_STEPS} steps" in finding.what
    assert "(now 1e-05)" in finding.fix and 'sess.set(algorithm="grpo")' in finding.fix
    # a critic that explains some of it, or too few steps with one to judge: nothing to say
    learning = [*rising()[:-MIN_TREND_STEPS], *(step(explained_variance=0.3) for _ in range(MIN_TREND_STEPS))]
    assert "critic-not-learning" not in codes(diagnose(learning, [], None, ppo))
    young = [*rising()[:-3], *(step(explained_variance=-0.5) for _ in range(3))]
    assert "critic-not-learning" not in codes(diagnose(young, [], None, ppo))


def test_a_dead_learner_rank_is_critical_and_a_slow_one_is_named() -> None:
    from rlnb.learn import LearnerStatistics, RankStatistics

    with rlnb.Session(CONFIG, name="diagnose-ranks") as sess:
        base = sess.statistics()

    def with_ranks(*seconds: float, dead: int | None = None) -> rlnb.SessionStatistics:
        each = tuple(
            RankStatistics(i, 100 + i, f"10.0.0.{i}", "dead" if i == dead else "running", step_seconds=s)
            for i, s in enumerate(seconds)
        )
        said = None if dead is None else f"rank {dead} (pid {100 + dead}, on 10.0.0.{dead}) died during step"
        return dataclasses.replace(base, learner=LearnerStatistics("ddp", each, said))

    found = diagnose([], [], with_ranks(0.1, 0.1, dead=1), CONFIG)
    assert codes(found)["learner-rank-dead"] == "critical"
    assert "rank 1 (pid 101, on 10.0.0.1) died" in next(f.what for f in found if f.code == "learner-rank-dead")
    slow = next(f for f in diagnose([], [], with_ranks(0.1, 0.25, 0.1), CONFIG) if f.code == "learner-rank-slow")
    assert slow.severity == "warning" and "rank 1 (on 10.0.0.1) took 0.25 s" in slow.what and "2.5x" in slow.what
    even = codes(diagnose([], [], with_ranks(0.1, 0.15), CONFIG))  # within SLOW_RANK: nothing said
    assert "learner-rank-slow" not in even and "learner-rank-dead" not in even
    assert not {"learner-rank-slow", "learner-rank-dead"} & set(codes(diagnose([], [], base, CONFIG)))
