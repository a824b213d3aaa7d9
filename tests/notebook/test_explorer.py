"""``sess.explore()``, in-process: real tiny sessions, ipywidgets without a frontend,
controls set and buttons pressed from code as a click would."""

from __future__ import annotations

import dataclasses
import gc
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

import rlnb
from rlnb._samples import Group, Sample
from rlnb.data import Task, register_task
from rlnb.engines import FakeEngine
from rlnb.envs import Turn
from rlnb.learn import advantages_of
from rlnb.notebook import Explorer
from rlnb.notebook._explorer import COLORS
from tests.helpers import small_config, wait_until

CONFIG = small_config()


@pytest.fixture
def trained() -> Iterator[rlnb.Session]:
    """A session that has trained three steps (three kept batches)."""
    with rlnb.Session(CONFIG, name="explore") as sess:
        for _ in range(3):
            sess.step()
        yield sess


def samples(text: str) -> list[dict[str, str]]:
    """Each sample row's data attributes, in the order shown."""
    found = re.findall(r'<div class="rlnb-sample" ([^>]*)>', text)
    return [dict(re.findall(r'data-([a-z]+)="([^"]*)"', attrs)) for attrs in found]


def groups(text: str) -> list[int]:
    return [int(g) for g in re.findall(r'class="rlnb-group" data-group="(\d+)"', text)]


def backgrounds(text: str, sample: int = 0) -> list[str]:
    """The token backgrounds of the ``sample``-th sample row shown."""
    rows = re.findall(r'<div class="rlnb-tokens"[^>]*>(.*?)</div>', text, flags=re.S)
    return re.findall(r'<span style="[^"]*background:(#[0-9a-f]{6});margin-right:1px"', rows[sample])


def by_hand(sess: rlnb.Session) -> list[Group]:
    """Two groups made by hand: one with a sample a pause cut after 3 tokens (versions
    0 then 1) and a truncated one; one whose samples all got reward 1 (zero variance)."""
    ids = tuple(sess.tokenizer.encode("12345"))
    resumed = Sample("1+2=", "12345", ids, (-0.1, -0.5, -2.0, -0.3, -4.5), (0, 0, 0, 1, 1), 1.0, "stop", 1, {}, (3,))
    cut = Sample("1+2=", "12", ids[:2], (-0.2, -0.9), (1, 1), 0.0, "length")
    same = [Sample("3+4=", "7", ids[:1], (-0.3,), (1,), 1.0) for _ in range(2)]
    return [Group("1+2=", (resumed, cut), prompt_id=0), Group("3+4=", tuple(same), prompt_id=1)]


# -- what it shows -------------------------------------------------------------------------


def test_explore_shows_the_last_trained_batch_group_by_group(trained: rlnb.Session) -> None:
    import ipywidgets

    ex = trained.explore()
    assert isinstance(ex, Explorer) and isinstance(ex.widget, ipywidgets.VBox)
    assert ex.state["step"] == 3 and ex.session is trained
    text = ex.html()
    assert "the batch of step 3" in text and ex.body.value == text
    assert groups(text) == [0, 1, 2, 3] and len(samples(text)) == 16
    kept = trained.batches[-1]
    shown = [float(s["advantage"]) for s in samples(text)[:4]]
    assert [s["sample"] for s in samples(text)[:4]] == ["0", "1", "2", "3"]
    assert shown == pytest.approx(list(kept.advantages[0]), abs=1e-5)
    assert "step 3 · batch 3 of 3 kept" in ex.page_label.value
    # every token has a tooltip with its numbers
    first = kept.groups[0].samples[0]
    assert text.count("learner log-prob ") >= sum(len(s.token_ids) for g in kept.groups for s in g.samples)
    assert f"behaviour log-prob {first.logprobs[0]:.3f}" in text
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/html"] == text
    assert trained.explore(0).state["step"] == 1 and trained.explore(kept).state["step"] == 3


def test_explore_of_a_rollout_not_trained_on(trained: rlnb.Session) -> None:
    batch = trained.rollout(2)
    ex = trained.explore(batch)
    text = ex.html()
    assert "2 groups not trained on" in text and ex.state["step"] is None
    assert len(samples(text)) == 8 and "not in sess.batches" in ex.page_label.value
    rewards = [[float(s.reward or 0.0) for s in g.samples] for g in batch]
    want = advantages_of(rewards, scale=trained.config.learn.scale_advantages)
    assert [float(s["advantage"]) for s in samples(text)] == pytest.approx([a for g in want for a in g], abs=1e-5)
    assert {s["lag"] for s in samples(text)} == {"0"}  # rolled out by the policy now
    assert trained.explore(batch[0]).html().count('class="rlnb-group"') == 1  # one group alone


def test_explore_with_nothing_to_show_says_what_to_do() -> None:
    with rlnb.Session(CONFIG, name="explore-none") as sess:
        with pytest.raises(RuntimeError, match=r"no step has been trained yet.*sess\.step\(\).*sess\.rollout\(4\)"):
            sess.explore()
        sess.step()
        with pytest.raises(IndexError, match=r"sess\.batches\[5\] is out of range: 1 batches are kept.*\[-1, 1\)"):
            sess.explore(5)
        with pytest.raises(TypeError, match=r"sess\.rollout\(4\)"):
            sess.explore("the last")
        with pytest.raises(ValueError, match="no groups"):
            sess.explore([])
    with pytest.raises(rlnb.ClosedError):
        sess.explore()


def test_a_continued_partial_rollout_shows_where_it_resumed_and_its_two_versions() -> None:
    with rlnb.Session(CONFIG, name="explore-hand") as sess:
        ex = sess.explore(by_hand(sess))
        ex.show(color="version")
        text = ex.html()
        assert text.count('class="rlnb-resumed"') == 1 and 'data-at="3"' in text
        assert "version 0 before, 1 after" in text
        colours = backgrounds(text, 0)
        assert len(colours) == 5 and colours[:3] == [colours[0]] * 3 and colours[3:] == [colours[3]] * 2
        assert colours[0] != colours[3]
        # the marker stands between the third and the fourth token
        row = re.findall(r'<div class="rlnb-tokens"[^>]*>(.*?)</div>', text, flags=re.S)[0]
        assert re.fullmatch(r"(<span style[^>]*>[^<]*</span>){3}<span class=\"rlnb-resumed\".*", row, flags=re.S)
        assert "v0-1 lag 0" in text and "resumed x1" in text


TOKEN_DELAY = 0.05


def test_a_real_paused_and_resumed_rollout_spans_two_policy_versions() -> None:
    """Async rollouts cut by pause("abort"), a step trained meanwhile, then resumed:
    the continued samples' tokens come from two versions, and the explorer shows both."""
    config = small_config(mode="async")
    with rlnb.Session(config, name="explore-pause", engine=FakeEngine(lengths=8, token_delay=TOKEN_DELAY)) as sess:
        sess.rollouts.start()
        wait_until(lambda: sum(sess.statistics().buffer.sizes.values()) >= 8, "8 groups in the buffer", 30)
        sess.step()  # room in the budget: new groups go in flight
        wait_until(lambda: sess.statistics().engine.running > 0, "the engine to decode new groups", 30)
        # The fake engine's tokens come with its clock, one every token_delay, and show only
        # when a request ends: two tokens' time leaves most of the eight still to come.
        time.sleep(2 * TOKEN_DELAY)
        sess.rollouts.pause("abort")
        assert sess.statistics().rollout.kept_partial > 0
        sess.step()  # a new version while they wait
        sess.rollouts.resume()
        sess.step()
        sess.rollouts.stop()
        index = next(i for i, b in enumerate(sess.batches) if any(s.continued_at for g in b.groups for s in g.samples))
        ex = sess.explore(index)
        ex.show(color="version")
        text = ex.html()
        assert 'class="rlnb-resumed"' in text
        row = next(i for i, s in enumerate(samples(text)) if s["lag"] != "")
        versions = {s.versions for g in sess.batches[index].groups for s in g.samples if s.continued_at}
        assert all(len(set(v)) == 2 for v in versions)
        assert any(len(set(backgrounds(text, i))) == 2 for i in range(row, len(samples(text))))


def test_each_colour_quantity_colours_the_tokens_differently(trained: rlnb.Session) -> None:
    ex = trained.explore(by_hand(trained))
    shown = {}
    for quantity in COLORS:
        ex.show(color=quantity)
        assert ex.controls["color"].value == quantity and COLORS[quantity] in ex.html()
        shown[quantity] = backgrounds(ex.html(), 0)
    assert len({tuple(c) for c in shown.values()}) == len(COLORS)
    assert len(set(shown["advantage"])) == 1  # one value per sample
    # a trained batch too: the learner has moved on since, so its log-probs differ from the engine's
    ex = trained.explore(0)
    ex.show(color="behaviour")
    behaviour = ex.html()
    ex.show(color="learner")
    assert ex.html() != behaviour and "the current policy's (version 3)" in ex.html()


def test_a_control_set_from_code_or_a_click_renders_as_show_does(trained: rlnb.Session) -> None:
    ex = trained.explore()
    ex.controls["color"].value = "ratio"
    assert ex.state["color"] == "ratio" and "importance ratio" in ex.body.value
    ex.controls["finish"].value = "length"
    assert {s["finish"] for s in samples(ex.body.value)} == {"length"}
    ex.buttons["previous"].click()
    assert ex.state["step"] == 2 and ex.state["finish"] == "length"  # paging keeps the settings
    ex.buttons["latest"].click()
    assert ex.state["step"] == 3
    ex.controls["sort"].value = "reward"
    assert ex.state["sort"] == "reward"


def test_sort_and_filter(trained: rlnb.Session) -> None:
    ex = trained.explore()
    ex.show(sort="reward")
    text = ex.html()
    cards = re.findall(r'class="rlnb-group" data-group="\d+".*?(?=class="rlnb-group"|$)', text, flags=re.S)
    firsts = []
    for card in cards:
        rewards = [float(s["reward"]) for s in samples(card)]
        assert rewards == sorted(rewards, reverse=True)
        firsts.append(rewards[0])
    assert firsts == sorted(firsts, reverse=True)  # groups by their first sample
    ex.show(sort="advantage")
    for card in re.findall(r'class="rlnb-group".*?(?=class="rlnb-group"|$)', ex.html(), flags=re.S):
        adv = [float(s["advantage"]) for s in samples(card)]
        assert adv == sorted(adv, reverse=True)
    ex.show(sort="length")
    ex.show(sort="batch", advantage="positive")
    assert all(float(s["advantage"]) > 0 for s in samples(ex.html()))
    ex.show(advantage="all", reward="zero")
    assert all(float(s["reward"]) == 0 for s in samples(ex.html()))
    ex.show(reward="all", lag=0)
    assert {s["lag"] for s in samples(ex.html())} == {"0"} and len(samples(ex.html())) == 16
    ex.show(lag=7)
    assert samples(ex.html()) == [] and "no sample matches the filters" in ex.html()
    assert "7" in [label for label, _ in ex.controls["lag"].options]
    with pytest.raises(ValueError, match=r"show\(color='colour'\): choose one of 'behaviour'"):
        ex.show(color="colour")
    with pytest.raises(ValueError, match="lag"):
        ex.show(lag="old")
    assert ex.state["lag"] == 7  # a refused call changes nothing


def test_sort_by_lag_and_finish_by_hand() -> None:
    with rlnb.Session(CONFIG, name="explore-lag") as sess:
        ex = sess.explore(by_hand(sess))  # lags from version 0, the policy now: 0 and -1
        ex.show(sort="finish")
        assert [s["finish"] for s in samples(ex.html())][:2] == ["stop", "length"]
        ex.show(sort="lag")
        lags = [int(s["lag"]) for s in samples(ex.html())]
        assert lags[:2] == sorted(lags[:2], reverse=True)


def test_paging_through_the_kept_batches(trained: rlnb.Session) -> None:
    ex = trained.explore(0)
    assert ex.state["step"] == 1
    ex.previous()
    assert ex.state["step"] == 1 and "oldest batch kept" in ex.message.value
    ex.next()
    assert ex.state["step"] == 2 and ex.message.value == ""
    ex.show(page=-1)
    assert ex.state["step"] == 3
    ex.next()
    assert "newest batch kept" in ex.message.value
    trained.step()  # a newer batch: next finds it
    ex.next()
    assert ex.state["step"] == 4 and "4 of 4 kept" in ex.page_label.value
    with pytest.raises(IndexError, match="4 batches are kept"):
        ex.show(page=9)
    rollout = trained.explore(trained.rollout(1))
    rollout.previous()  # from groups given: the newest kept batch
    assert rollout.state["step"] == 4


def test_paging_needs_the_session_and_the_rest_does_not() -> None:
    with rlnb.Session(CONFIG, name="explore-closed") as sess:
        sess.step()
        ex = sess.explore()
    ex.show(color="version", sort="reward")  # what was computed still shows
    with pytest.raises(rlnb.ClosedError, match=r"cannot page through sess\.batches"):
        ex.show(page=0)
    ex.buttons["previous"].click()  # a click says so, never raises
    assert "ClosedError" in ex.message.value
    del sess
    gc.collect()
    assert ex.session is None  # a weak reference only


def test_text_is_escaped_and_each_reward_function_shown() -> None:
    rows = [{"prompt": "</div><script>alert(1)</script>" + "x" * 200 + f"{n}=", "answer": "<b>"} for n in range(8)]

    def exact(completion: str, answer: str) -> float:
        return float(completion == answer)

    def short(completion: str, answer: str) -> float:
        return 0.5 if len(completion) < 4 else 0.0

    register_task(Task.from_records("explore-html", rows, reward=[exact, short], eval_size=0), replace=True)
    model = rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=512)  # room for the long prompts
    with rlnb.Session(small_config(task="explore-html", model=model), name="explore-html") as sess:
        ids = tuple(sess.tokenizer.encode("<script>alert(1)</script></div>"))
        sample = Sample("p", "<script>alert(1)</script></div>", ids, (-1.0,) * len(ids), (0,) * len(ids), 0.5)
        sample = dataclasses.replace(sample, rewards={"exact": 0.0, "short": None})
        ex = sess.explore([Group(rows[0]["prompt"], (sample, sample), prompt_id=0), *sess.rollout(1)])
        text = ex.html()
    assert "<script>" not in text and "</script>" not in text
    assert "&lt;/div&gt;&lt;script&gt;" in text  # the prompt, as text
    assert text.count("<div") == text.count("</div>")  # nothing closed early
    assert "exact 0, short -" in text  # each function's value (None: did not apply)
    assert "word-break:break-all" in text  # long prompts and completions wrap


def test_a_group_whose_rewards_are_all_equal_is_flagged() -> None:
    with rlnb.Session(CONFIG, name="explore-flat") as sess:
        text = sess.explore(by_hand(sess)).html()
    cards = re.findall(r'class="rlnb-group".*?(?=class="rlnb-group"|$)', text, flags=re.S)
    assert ["rlnb-zero-variance" in card for card in cards] == [False, True]
    assert "no learning signal" in cards[1]


# -- display and close -----------------------------------------------------------------------


class FakeHandle:
    def __init__(self) -> None:
        self.updates: list[Any] = []

    def update(self, obj: Any, **kwargs: Any) -> None:
        self.updates.append((obj, kwargs))


def test_display_and_close(monkeypatch: pytest.MonkeyPatch, trained: rlnb.Session) -> None:
    import IPython.display

    displayed: list[tuple[Any, FakeHandle]] = []

    def display(obj: Any, *, raw: bool = False, display_id: bool | None = None) -> FakeHandle:
        displayed.append((obj, FakeHandle()))
        return displayed[-1][1]

    monkeypatch.setattr(IPython.display, "display", display)
    ex = trained.explore()
    ex._ipython_display_()
    ((bundle, handle),) = displayed
    assert "application/vnd.jupyter.widget-view+json" in bundle and "text/html" in bundle
    ex.show(color="version")
    widgets = [ex.widget, *ex.controls.values(), *ex.buttons.values(), ex.body]
    ex.close()
    ex.close()  # idempotent
    assert ex.closed and all(w.comm is None for w in widgets)
    ((static, kwargs),) = handle.updates
    assert static == {"text/html": ex.html(), "text/plain": repr(ex)} and kwargs == {"raw": True}
    assert "policy version" in ex.html() and "closed" in repr(ex)
    assert set(ex._repr_mimebundle_()) == {"text/html", "text/plain"}
    with pytest.raises(rlnb.ClosedError, match="explorer is closed"):
        ex.show(color="ratio")


# -- in the dashboard ---------------------------------------------------------------------------


def test_the_dashboards_explorer_section_opens_once_and_the_ticker_leaves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with rlnb.Session(CONFIG, name="explore-dash") as sess:
        dash = sess.dashboard()
        try:
            assert dash.explorer is None and dash.explorer_panel.selected_index is None
            dash.explorer_panel.selected_index = 0  # opened before any step: says why not
            assert dash.explorer is None and "no trained batch" in dash.explorer_message.value
            sess.step()
            dash.explorer_panel.selected_index = None
            dash.explorer_panel.selected_index = 0  # opened again: made now
            ex = dash.explorer
            assert isinstance(ex, Explorer) and ex.state["step"] == 1 and dash.explore() is ex
            assert dash.explorer_message.value == ""
            renders: list[int] = []
            monkeypatch.setattr(ex, "_render", lambda: renders.append(1))
            sess.step()
            for _ in range(3):
                dash.tick()
            assert renders == [] and ex.state["step"] == 1  # a newer batch only when asked
            monkeypatch.undo()
            ex.latest()
            assert ex.state["step"] == 2
        finally:
            dash.close()
        assert ex.closed


# -- conversations ------------------------------------------------------------------------------


class Echo:
    """An environment that answers each turn with ``=`` and its first two characters,
    and ends the conversation after a turn longer than three."""

    def reset(self, row: Any) -> None:
        return None

    def step(self, completion: str) -> Turn:
        return Turn(observation="=" + completion[:2] + ";", reward=0.5, done=len(completion) > 3)


def token_spans(row: str) -> list[str]:
    """A tokens row's parts in order: "tok" (a policy token), "env" (an environment's),
    "[env" and "]" (its reply's box), "turn N" and "resumed" (markers)."""
    parts = re.findall(
        r'<span style="[^"]*background:#[0-9a-f]{6};margin-right:1px"|'
        r'<span class="rlnb-env-token"|<span class="rlnb-env" |'
        r'<span class="rlnb-turn" data-at="\d+" data-turn="\d+"|<span class="rlnb-resumed"|</span></span>',
        row,
    )
    names = {'<span class="rlnb-env-token"': "env", '<span class="rlnb-env" ': "[env", "</span></span>": "]"}
    out = []
    for part in parts:
        if part.startswith('<span class="rlnb-turn"'):
            out.append("turn " + re.findall(r'data-turn="(\d+)"', part)[0])
        elif part.startswith('<span style="'):
            out.append("tok")
        else:
            out.append(names.get(part, "resumed"))
    return out


def rows_of(text: str) -> list[str]:
    return re.findall(r'<div class="rlnb-tokens"[^>]*>(.*?)</div>', text, flags=re.S)


def talk(sess: rlnb.Session) -> list[Group]:
    """A conversation made by hand: the policy says "12" (version 0), the environment
    "=1+" (mask 0: log-probs 0.0, a version that is not the policy's), the policy "34"
    (version 1); beside it a single completion of 5 tokens, longer than the policy's 4."""
    ids = tuple(sess.tokenizer.encode("12=1+34"))
    conversation = Sample(
        "1+2=", "12=1+34", ids, (-0.5, -1.0, 0.0, 0.0, 0.0, -2.0, -3.0), (0, 0, 7, 7, 7, 1, 1), reward=1.0,
        mask=(1, 1, 0, 0, 0, 1, 1), turns=(0, 5), env_reward=0.5,
    )  # fmt: skip
    single = Sample("1+2=", "12345", tuple(sess.tokenizer.encode("12345")), (-0.2,) * 5, (1,) * 5, reward=0.0)
    return [Group("1+2=", (conversation, single), prompt_id=0)]


def test_a_conversations_environment_tokens_stand_apart_uncoloured() -> None:
    with rlnb.Session(CONFIG, name="explore-talk") as sess:
        ex = sess.explore(talk(sess))
        for quantity in COLORS:
            ex.show(color=quantity)
            text = ex.html()
            row = rows_of(text)[0]
            # two policy tokens, the environment's three in a labelled box, the second turn's marker, two more
            assert token_spans(row) == ["tok", "tok", "[env", "env", "env", "env", "]", "turn 2", "tok", "tok"]
            assert len(backgrounds(text, 0)) == 4  # a colour for the policy's tokens only
            assert 'class="rlnb-env" data-at="2" data-tokens="3"' in row and ">env</span>" in row
            assert "border:1px dashed" in row and "font-style:italic" in row
            assert 'class="rlnb-turn" data-at="5" data-turn="2"' in row and "▸ turn 2" in row
            assert "rlnb-env" not in rows_of(text)[1]  # the single completion beside it: as ever
    env_titles = re.findall(r'class="rlnb-env-token" title="([^"]*)"', row)
    assert len(env_titles) == 3 and all(t.endswith("environment token (not trained on)") for t in env_titles)
    assert all("log-prob" not in t and "advantage" not in t for t in env_titles)
    # the legend says what the box and the marker mean
    assert "the environment's tokens: not trained on, so not coloured" in text
    assert "where a policy turn begins" in text
    with rlnb.Session(CONFIG, name="explore-talk-none") as sess:  # a batch without one says nothing of them
        assert "environment's tokens" not in sess.explore(by_hand(sess)).html()


def test_a_conversations_figures_count_the_policys_tokens_only() -> None:
    with rlnb.Session(CONFIG, name="explore-talk-figures") as sess:
        ex = sess.explore(talk(sess))
        text = ex.html()
        meta = re.findall(r'<div class="rlnb-sample"[^>]*><div style="[^"]*">(.*?)</div>', text, flags=re.S)
        # 4 policy tokens and 3 of the environment's; versions and lag from the policy's (not the 7 copied in)
        assert "env reward 0.5 · 4 tok + 3 env · 2 turns · v0-1 lag 0" in meta[0]
        assert "5 tok · v1 lag -1" in meta[1] and "env" not in meta[1]
        ex.show(color="version")
        assert "v7" not in ex.html() and ">v0<" in ex.html() and ">v1<" in ex.html()  # the legend's versions
        ex.show(sort="length")  # the single completion's 5 tokens before the conversation's 4 (7 with the env's)
        assert [s["sample"] for s in samples(ex.html())] == ["1", "0"]


def test_a_real_conversation_shows_each_turn_where_it_began() -> None:
    task = Task(
        "explore-echo-env", "0123456789=;", lambda rng: (str(rng.randint(0, 9)), "1"),
        reward=None, max_new_tokens=4, env=Echo, max_turns=3,
    )  # fmt: skip
    register_task(task, replace=True)
    with rlnb.Session(small_config(task="explore-echo-env"), name="explore-echo") as sess:
        sess.step()
        kept = sess.batches[-1]
        ex = sess.explore()
        ex.show(color="learner")
        text = ex.html()
    cards = re.findall(r'class="rlnb-group".*?(?=class="rlnb-group"|$)', text, flags=re.S)
    assert len(cards) == len(kept.groups)
    for group, card in zip(kept.groups, cards, strict=True):
        for sample, row in zip(group.samples, rows_of(card), strict=True):
            parts = token_spans(row)
            policy = sum(sample.mask)
            assert parts.count("tok") == policy
            assert parts.count("env") == len(sample.mask) - policy
            turns = [int(t) for t in re.findall(r'class="rlnb-turn" data-at="(\d+)"', row)]
            assert turns == list(sample.turns[1:])
            for k, at in enumerate(turns, start=2):  # each marker stands before the token its turn began at
                marker = parts.index(f"turn {k}")
                assert sum(p in ("tok", "env") for p in parts[:marker]) == at
            runs = [(str(m.start()), str(len(m.group()))) for m in re.finditer("0+", "".join(map(str, sample.mask)))]
            assert re.findall(r'class="rlnb-env" data-at="(\d+)" data-tokens="(\d+)"', row) == runs
    assert any(s.is_conversation for g in kept.groups for s in g.samples)  # the environment spoke
