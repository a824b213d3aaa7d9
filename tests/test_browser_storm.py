"""A click storm on the dashboard in a real JupyterLab, driven through a real Chromium:
40 clicks at random but seeded moments on pause (with a random mode), resume, stop,
start and Apply, while training runs in the background and again while a cell trains
in the foreground, on a single-turn task and on notebook 10's tool task, whose
conversations span several turns. Whatever the clicks left, the dashboard settles
(no action stays busy), its pause and resume answer, the session answers from code
(a wait-pause settles, counts add up, nothing failed) and close leaves nothing."""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from playwright.sync_api import Page

from tests.helpers.browser import (
    cell_outputs,
    error_outputs,
    open_notebook,
    run_cell,
    wait_for_idle,
    write_notebook,
)

pytestmark = [pytest.mark.slow]

OpenLab = Callable[..., AbstractContextManager[str]]  # the open_lab fixture
OpenBrowser = Callable[..., AbstractContextManager[Page]]  # the open_browser fixture

CLICKS = 40
SCREENSHOTS = Path(__file__).resolve().parents[1] / "runs" / "browser"  # ignored by git
SAID = ("state", "notice", "message", "settings-message")
TRAINING_WORD = ".rlnb-dashboard .rlnb-training-word"
# Steps of the foreground cell: a little longer than a storm lasts (a reverse step is quicker)
FOREGROUND_STEPS = {"reverse": 400, "calculator": 300}
SETUPS = {
    "reverse": """rlnb.Config(
    task="reverse",
    seed=0,
    mode="async",
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4, max_new_tokens=12),
)""",
    # notebook 10's task; a short warm-up so that the policy calls its tool on some prompts
    "calculator": """rlnb.Config(
    task="calculator",
    seed=0,
    mode="async",
    model=rlnb.ModelConfig(max_len=48),
    rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
    warmup=rlnb.WarmupConfig(steps=20, batch_size=128, lr=3e-3, task="calculator_teacher"),
)""",
}
# Whatever the storm left: a wait-pause settles, the counts add up, nothing failed, and
# training and generation stop. The result is printed for the test to read.
CHECK = """import json

def answers():
    sess.rollouts.resume()
    sess.training.stop()
    sess.rollouts.stop()
    sess.rollouts.pause("wait")
    sess.rollouts.wait_paused(timeout=60)
    s = sess.statistics()
    r, t = s.rollout, s.training
    assert r.dispatched == r.finished + r.kept_partial + r.failed + r.cancelled + r.in_flight, r
    assert min(r.finished, r.kept_partial, r.failed, r.cancelled, r.in_flight) >= 0, r
    assert r.state == "paused" and r.failed == 0 and not t.running and t.error is None, s
    assert all(size >= 0 for size in s.buffer.sizes.values()), s.buffer
    sess.rollouts.resume()
    return {"version": sess.version, "finished": r.finished, "kept_partial": r.kept_partial}

print("ANSWERS", json.dumps(answers()))"""


def cells(task: str) -> list[str]:
    return [
        f"""import rlnb

before = rlnb.probe.snapshot()
sess = rlnb.Session({SETUPS[task]}, name="storm")
if sess.config.warmup.steps:
    sess.warmup(progress=False)
dash = sess.dashboard()
dash""",
        "sess.training.start()",  # 1: in the background
        CHECK,  # 2
        f"sess.train({FOREGROUND_STEPS[task]}, progress=False)",  # 3: in the foreground, longer than the storm
        CHECK,  # 4
        """sess.close()
after = rlnb.probe.snapshot()
print("LEFT", after.num_children - before.num_children, "live sessions:", rlnb.sessions())""",  # 5
    ]


BUTTONS = ("pause", "resume", "stop", "start", "apply")


def button(page: Page, method: str) -> str:
    """The selector text of the dashboard's button for ``method``."""
    return rf"^\W*{method}\W*$"


def enabled(page: Page) -> list[str]:
    """The storm's buttons that are on now."""
    on = page.eval_on_selector_all(
        ".rlnb-dashboard button", "bs => bs.filter(b => !b.disabled).map(b => b.innerText.trim())"
    )
    return [m for m in BUTTONS if m in on]


def busy(page: Page) -> list[str]:
    """The labels of buttons whose action is still running ("pause…")."""
    labels = page.eval_on_selector_all(".rlnb-dashboard button", "bs => bs.map(b => b.innerText.trim())")
    return [label for label in labels if label.endswith("…")]


def storm(page: Page, rng: random.Random, clicks: int) -> list[str]:
    """``clicks`` clicks on buttons that are on, each after a random pause; a pause
    first picks a random mode, an Apply first types a random lr. Returns what was clicked."""
    lr = page.locator(".rlnb-dashboard .rlnb-setting-lr input").first
    if not lr.is_visible():  # the settings section is collapsed: open it
        page.locator(".rlnb-dashboard .rlnb-settings .jupyter-widget-Collapse-header").first.click()
    lr.wait_for(state="visible")
    done = []
    for _ in range(clicks):
        page.wait_for_timeout(rng.uniform(50, 400))
        choices = enabled(page)
        if not choices:
            done.append("-")
            continue
        method = rng.choice(choices)
        if method == "pause":
            page.locator(".rlnb-dashboard select").first.select_option(rng.choice(["abort", "keep", "wait"]))
        if method == "apply":
            lr.fill(rng.choice(["0.0001", "0.0002", "5e-05"]))
            lr.press("Tab")
        target = page.locator(".rlnb-dashboard button", has_text=re.compile(button(page, method))).first
        try:
            target.click(timeout=2_000)
        except Exception:  # the button went off between the look and the click: a click a person misses
            done.append(f"({method})")
            continue
        done.append(method)
    return done


def settle(page: Page, what: str) -> None:
    """Every action the clicks started has ended (a wedged one never does)."""
    try:
        page.wait_for_function(
            "() => ![...document.querySelectorAll('.rlnb-dashboard button')]"
            ".some(b => b.innerText.trim().endsWith('…'))",
            timeout=90_000,
        )
    except Exception:
        raise AssertionError(f"after {what} the dashboard is still busy: {busy(page)}") from None


def pause_and_resume_answer(page: Page) -> None:
    """The dashboard's pause and resume still work, as a person clicks them: a pause
    the storm left settles (a wait-pause too) and is resumed, then a pause and a
    resume again. The buttons' states are read, not the state word: they come from
    the same tick, and a person clicks what is on."""
    word = ".rlnb-dashboard .rlnb-state-word"

    def on(method: str) -> str:
        """JavaScript: whether ``method``'s button is on."""
        buttons = "[...document.querySelectorAll('.rlnb-dashboard button')]"
        return f"{buttons}.some(b => !b.disabled && /{button(page, method)}/.test(b.innerText.trim()))"

    def until(condition: str, what: str) -> None:
        try:
            page.wait_for_function(f"() => {condition}", timeout=90_000)
        except Exception:
            page.screenshot(path=str(SCREENSHOTS / "storm-wedged.png"), full_page=True)
            said = {name: page.locator(f".rlnb-dashboard .rlnb-{name}").first.inner_text() for name in SAID}
            raise AssertionError(f"{what}: the dashboard says {said}") from None

    def act(method: str, goal: str, what: str) -> None:
        """Click ``method`` while it is on until ``goal`` holds (the buttons follow the
        state a tick late: a click on one just turned off is made again once it is on)."""
        deadline = time.monotonic() + 90
        while not page.evaluate(f"() => {goal}"):
            if time.monotonic() > deadline:
                until(goal, what)  # one last look, and the dashboard's words if not
                return
            if page.evaluate(f"() => {on(method)}"):
                with contextlib.suppress(Exception):  # turned off meanwhile: look again
                    page.locator(".rlnb-dashboard button", has_text=re.compile(button(page, method))).first.click(
                        timeout=2_000
                    )
            with contextlib.suppress(Exception):
                page.wait_for_function(f"() => {goal}", timeout=5_000)
        settle(page, method)

    running = f"{on('pause')} && !{on('resume')}"
    paused = f"{on('resume')} && !{on('pause')}"
    pausing = f"document.querySelector('{word}')?.dataset.state === 'pausing'"
    until(f"!({pausing})", "a pause the storm left never settled")
    act("resume", running, "a pause the storm left was not resumed")
    page.locator(".rlnb-dashboard select").first.select_option("abort")
    act("pause", paused, "a pause after the storm")
    act("resume", running, "a resume after the storm")


def answers(page: Page, index: int) -> dict[str, int]:
    text = cell_outputs(page)[index]
    assert "ANSWERS" in text, text
    return dict(json.loads(text.split("ANSWERS", 1)[1].strip().splitlines()[0]))


@pytest.mark.parametrize("task", ["reverse", "calculator"])
def test_a_click_storm_in_the_background_and_the_foreground_never_wedges(
    task: str, tmp_path: Path, open_lab: OpenLab, open_browser: OpenBrowser
) -> None:
    notebooks = tmp_path / "notebooks"
    write_notebook(notebooks / "storm.ipynb", cells(task))
    rng = random.Random(f"storm-{task}")
    with open_lab(notebooks) as url, open_browser(height=1400) as page:
        open_notebook(page, url, "storm.ipynb")
        run_cell(page, 0)
        wait_for_idle(page, timeout=180)
        assert error_outputs(page) == []
        page.locator(".rlnb-dashboard .rlnb-state-word").first.wait_for()

        run_cell(page, 1)  # background training
        wait_for_idle(page)
        clicked = storm(page, rng, CLICKS)
        print(f"\n{task}, background: {' '.join(clicked)}")
        settle(page, "the background storm")
        pause_and_resume_answer(page)
        run_cell(page, 2)
        wait_for_idle(page, timeout=120)
        assert error_outputs(page) == [], error_outputs(page)
        print(f"{task}, background, then: {answers(page, 2)}")

        run_cell(page, 3)  # foreground training: the storm beside the running cell
        page.wait_for_function(
            "s => document.querySelector(s)?.dataset.state === 'foreground'", arg=TRAINING_WORD, timeout=60_000
        )
        clicked = storm(page, rng, CLICKS)
        print(f"{task}, foreground: {' '.join(clicked)}")
        # whether every click was made beside the running cell (it usually trains longer than
        # the storm lasts; once it ended, a click on start begins background training)
        training = page.evaluate(f"() => document.querySelector('{TRAINING_WORD}')?.dataset.state")
        print(f"{task}, training after the storm: {training}")
        settle(page, "the foreground storm")
        pause_and_resume_answer(page)  # a pause left by the storm must not hold the cell for good
        wait_for_idle(page, timeout=180)  # the train() cell ends
        assert error_outputs(page) == [], error_outputs(page)
        run_cell(page, 4)
        wait_for_idle(page, timeout=120)
        assert error_outputs(page) == [], error_outputs(page)
        print(f"{task}, foreground, then: {answers(page, 4)}")

        run_cell(page, 5)
        wait_for_idle(page, timeout=60)
        assert error_outputs(page) == []
        last = cell_outputs(page)[5]
        assert "LEFT 0 live sessions: []" in last, last
