"""``rlnb.compare``: runs from hand-written ``metrics.jsonl`` files and from session
objects (fakes with a session's attributes, and one real tiny session), drawn on
shared axes with their change marks; the widget's ticker, in-process."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
import weakref
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import rlnb
import rlnb.notebook
from rlnb.notebook import Comparison, _compare
from tests.helpers import wait_until

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@dataclasses.dataclass
class FakeChange:
    step: int
    field: str
    old: Any
    new: Any
    time: float = 0.0


class FakeSession:
    """What ``compare`` reads of a session; ``changes=None``: no such attribute, as a
    session had before live settings."""

    def __init__(
        self,
        name: str,
        rewards: Sequence[float] = (),
        evaluations: Sequence[tuple[int, float]] = (),
        changes: Sequence[FakeChange] | None = (),
    ) -> None:
        self.name = name
        self.closed = False
        self.history: list[dict[str, float]] = []
        self.evaluations = list(evaluations)
        if changes is not None:
            self.changes = list(changes)
        for reward in rewards:
            self.train(reward)

    def train(self, reward: float) -> None:
        version = float(len(self.history) + 1)
        self.history.append({"version": version, "reward_mean": reward, "accuracy": reward / 2, "lr": 1e-4})


def write_run(root: Path, name: str, *, half_line: bool = True) -> Path:
    """A run dir as the jsonl tracker leaves it, with a change, an evaluation, warm-up
    records, an unknown event and a killed writer's half line at the end."""
    run = root / name
    run.mkdir()
    records: list[dict[str, Any]] = [
        {"event": "start", "run_id": "r1", "time": 100.0},
        {"step": 0, "warmup/loss": 2.5, "warmup/accuracy": 0.1},
        {"step": 0, "eval_accuracy": 0.25, "eval_seconds": 0.5},
        {"step": 1, "reward_mean": 0.1, "accuracy": 0.05, "lr": 0.0001},
        {"step": 2, "reward_mean": 0.3, "accuracy": 0.15, "lr": 0.0001},
        {"event": "change", "step": 2, "field": "lr", "old": 0.0001, "new": 0.001, "time": 101.0},
        {"event": "pause", "step": 2, "time": 101.5},
        {"step": 3, "reward_mean": 0.6, "accuracy": 0.3, "lr": 0.001},
        {"step": 3, "eval_accuracy": 0.75, "eval_seconds": 0.5},
        {"event": "finish", "exit_code": 0, "time": 102.0},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + ('{"step": 4, "reward_me' if half_line else ""))
    return run


def curves(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    """Each run's line on ``ax``: label -> (x, y)."""
    return {
        line.get_label(): ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        for line in ax.lines
        if line.get_gid() != "rlnb-change"
    }


def marks(ax: Any) -> list[tuple[float, str, str]]:
    """The change marks on ``ax``: (x, label, colour)."""
    return [
        (float(line.get_xdata()[0]), line.get_label(), line.get_color())
        for line in ax.lines
        if line.get_gid() == "rlnb-change"
    ]


def legend_texts(fig: Any) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def tickers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rlnb-compare"]


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ticker's pace made short, so that a test waits milliseconds, not seconds."""
    monkeypatch.setattr(_compare, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(_compare, "REDRAW_INTERVAL", 0.05)
    monkeypatch.setattr(_compare, "_TIME_SHARE", 0)


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """Swap IPython's ``display`` for one that records each raw bundle and its updates."""
    import IPython.display

    displayed: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []

    class Handle:
        def __init__(self, updates: list[dict[str, Any]]) -> None:
            self.updates = updates

        def update(self, obj: dict[str, Any], **kwargs: Any) -> None:
            assert kwargs == {"raw": True}
            self.updates.append(obj)

    def display(obj: dict[str, Any], *, raw: bool = False, display_id: bool | None = None) -> Handle | None:
        assert raw
        displayed.append((obj, []))
        return Handle(displayed[-1][1]) if display_id else None

    monkeypatch.setattr(IPython.display, "display", display)
    yield displayed


# -- exports ---------------------------------------------------------------------------


def test_compare_is_exported_from_rlnb_and_the_notebook_layer() -> None:
    assert rlnb.compare is rlnb.notebook.compare
    assert "compare" in rlnb.__all__ and "compare" in dir(rlnb)
    assert {"Comparison", "compare"} <= set(rlnb.notebook.__all__)


# -- run dirs --------------------------------------------------------------------------


def test_a_run_dir_draws_its_steps_evaluations_and_change(tmp_path: Path) -> None:
    run = write_run(tmp_path, "baseline")
    comparison = rlnb.compare(run)
    assert isinstance(comparison, Comparison)
    fig = comparison.figure()
    reward, accuracy = fig.axes[:2]
    assert len(fig.axes) == 2
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward_mean", "eval_accuracy"]
    # the half line at the end, the warm-up records and the unknown event are left out
    assert curves(reward) == {"baseline": ([1.0, 2.0, 3.0], [0.1, 0.3, 0.6])}
    assert curves(accuracy) == {"baseline": ([0.0, 3.0], [0.25, 0.75])}
    colour = reward.lines[0].get_color()
    for ax in fig.axes:  # the change is marked on every subplot, in the run's colour
        assert marks(ax) == [(2.0, "lr 0.0001→0.001", colour)]
    assert "1 · baseline at step 2: lr 0.0001→0.001" in legend_texts(fig)
    assert [a.get_text() for a in reward.texts] == ["1"]  # the mark's number above it
    (data,) = comparison.runs()
    assert data.name == "baseline" and data.source == "run dir" and not data.live
    assert data.changes == (_compare.Change(2.0, "lr", 0.0001, 0.001, 101.0),)
    assert "finished" in repr(comparison)
    comparison.close()


def test_a_run_dir_is_read_again_when_its_file_grows(tmp_path: Path) -> None:
    run = write_run(tmp_path, "growing", half_line=False)
    comparison = rlnb.compare(run, metrics=("reward_mean",))
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "reward_mean": 0.9}) + "\n")
    assert curves(comparison.figure().axes[0])["growing"][1] == [0.1, 0.3, 0.6, 0.9]
    (run / "metrics.jsonl").unlink()  # gone: the last reading stays
    assert curves(comparison.figure().axes[0])["growing"][1] == [0.1, 0.3, 0.6, 0.9]


def test_a_metrics_file_can_be_named_itself_and_the_run_is_named_by_its_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path, "by-file")
    assert rlnb.compare(run / "metrics.jsonl").names == ("by-file",)


def test_a_metric_no_run_has_says_no_data(tmp_path: Path) -> None:
    fig = rlnb.compare(write_run(tmp_path, "a"), metrics=("reward_mean", "kl")).figure()
    assert [t.get_text() for t in fig.axes[1].texts] == ["no data"]
    assert curves(fig.axes[1]) == {}
    assert "no data" not in [t.get_text() for t in fig.axes[0].texts]


# -- sessions --------------------------------------------------------------------------


def test_sessions_and_run_dirs_share_the_axes(tmp_path: Path) -> None:
    a = FakeSession(
        "a",
        [0.2, 0.4, 0.5, 0.7],
        evaluations=[(0, 0.1), (4, 0.6)],
        changes=[FakeChange(2, "lr", 1e-4, 1e-3), FakeChange(3, "temperature", 1.0, 0.7)],
    )
    b = FakeSession("b", [0.2, 0.4, 0.3], changes=None)  # no .changes at all
    fig = rlnb.compare(a, b, write_run(tmp_path, "c"), metrics=("reward_mean", "accuracy", "eval_accuracy")).figure()
    reward, accuracy, held_out = fig.axes
    assert len(fig.axes) == 3
    assert curves(reward) == {
        "a": ([1.0, 2.0, 3.0, 4.0], [0.2, 0.4, 0.5, 0.7]),
        "b": ([1.0, 2.0, 3.0], [0.2, 0.4, 0.3]),
        "c": ([1.0, 2.0, 3.0], [0.1, 0.3, 0.6]),
    }
    assert curves(accuracy)["a"][1] == [0.1, 0.2, 0.25, 0.35]
    # a session's held-out accuracy is its evaluations; b has none
    assert curves(held_out) == {"a": ([0.0, 4.0], [0.1, 0.6]), "c": ([0.0, 3.0], [0.25, 0.75])}
    colour = {line.get_label(): line.get_color() for line in reward.lines if line.get_gid() != "rlnb-change"}
    assert len(set(colour.values())) == 3  # one colour per run; its marks take it too
    assert sorted(marks(held_out)) == [
        (2.0, "lr 0.0001→0.001", colour["a"]),
        (2.0, "lr 0.0001→0.001", colour["c"]),
        (3.0, "temperature 1→0.7", colour["a"]),
    ]
    legend = legend_texts(fig)
    assert legend[:3] == ["a", "b", "c"]
    assert {"a at step 2: lr 0.0001→0.001", "c at step 2: lr 0.0001→0.001", "a at step 3: temperature 1→0.7"} == {
        t.split(" · ", 1)[1] for t in legend[3:]
    }


def test_change_values_that_are_not_numbers_and_runs_of_one_name() -> None:
    change = FakeChange(1, "pause_mode", "abort", "keep")
    comparison = rlnb.compare(FakeSession("x", [0.5], changes=[change]), FakeSession("x", [0.1]))
    assert comparison.names == ("x", "x (2)")
    assert marks(comparison.figure().axes[0])[0][:2] == (1.0, "pause_mode abort→keep")
    assert _compare.Change(5, "lr", 3.14159e-05, 12345678, None).label == "lr 3.14e-05→1.23e+07"
    # an algorithm by its label, as metrics.jsonl records it, not its dataclass's repr
    mine = rlnb.Algorithm(loss=lambda inputs: -inputs.logp)
    assert _compare.Change(3, "algorithm", "grpo", mine, None).label.startswith("algorithm grpo→custom (loss=")
    assert _compare.Change(3, "algorithm", "grpo", rlnb.algorithms.preset("dapo"), None).label == "algorithm grpo→dapo"


def test_a_real_session_beside_a_run_dir(tmp_path: Path) -> None:
    config = rlnb.Config(
        task="addition",
        seed=0,
        data=rlnb.DataConfig(num_workers=0),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=2, max_new_tokens=4),
        model=rlnb.ModelConfig(d_model=32, n_layers=1),
    )
    with rlnb.Session(config, name="cmp-a") as sess:
        sess.train(2, progress=False)
        sess.evaluate()
    history, evaluations = sess.history, sess.evaluations
    comparison = rlnb.compare(sess, write_run(tmp_path, "cmp-b"))
    fig = comparison.figure()
    reward, held_out = fig.axes
    assert curves(reward)["cmp-a"] == ([1.0, 2.0], [step["reward_mean"] for step in history])
    assert curves(reward)["cmp-b"] == ([1.0, 2.0, 3.0], [0.1, 0.3, 0.6])
    assert curves(held_out)["cmp-a"] == ([float(v) for v, _ in evaluations], [a for _, a in evaluations])
    assert [label for _, label, _ in marks(reward)] == ["lr 0.0001→0.001"]
    assert not comparison.live and "cmp-a" in repr(comparison)
    png = comparison.save(tmp_path / "out" / "cmp.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    comparison.close()


# -- saving ----------------------------------------------------------------------------


def test_save_writes_png_or_svg_by_suffix(tmp_path: Path) -> None:
    comparison = rlnb.compare(write_run(tmp_path, "a"), FakeSession("b", [0.5, 0.6]))
    png = comparison.save(tmp_path / "cmp.png")
    assert png == tmp_path / "cmp.png" and png.read_bytes().startswith(PNG_MAGIC)
    svg = comparison.save(str(tmp_path / "cmp.SVG"))
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ids = {el.get("id") for el in root.iter()}
    assert "rlnb-change" in ids or any(i and i.startswith("rlnb-change") for i in ids)
    with pytest.raises(ValueError, match=r"Comparison.save\(path='.*cmp.jpg'\): use a path ending in .png or .svg"):
        comparison.save(tmp_path / "cmp.jpg")
    with pytest.raises(TypeError, match=r"Comparison.save\(path=3\)"):
        comparison.save(3)  # type: ignore[arg-type]


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((), {}, ValueError, r"rlnb.compare\(\) got no runs: pass sessions or run directories"),
        (("RUN", 3), {}, TypeError, r"argument 2 is 3 \(type int\): pass an rlnb.Session or a run directory"),
        ((["RUN"],), {}, TypeError, r"argument 1 is \[.*\] \(type list\): unpack it: rlnb.compare\(\*runs\)"),
        ((b"runs/a",), {}, TypeError, r"argument 1 is a bytes path"),
        (("RUN",), {"metrics": "reward_mean"}, TypeError, r"metrics='reward_mean'\) is invalid: .*\('reward_mean',\)"),
        (("RUN",), {"metrics": ()}, ValueError, r"metrics=\(\)\) is empty: use a non-empty sequence"),
        (("RUN",), {"metrics": ("reward_mean", 3)}, TypeError, r"metrics=\('reward_mean', 3\)\) is invalid"),
        (("RUN",), {"metrics": None}, TypeError, r"metrics=None\) is invalid"),
        (("RUN",), {"metrics": ("kl", "kl")}, ValueError, r"names a metric twice"),
    ],
    ids=["no-runs", "an-int", "a-list", "bytes", "metrics-a-str", "metrics-empty", "metric-an-int", "none", "twice"],
)
def test_bad_arguments_name_the_argument_and_the_fix(
    tmp_path: Path, args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    run = write_run(tmp_path, "a")
    args = tuple(run if a == "RUN" else a for a in args)
    with pytest.raises(error, match=words):
        rlnb.compare(*args, **kwargs)
    assert not tickers()


def test_a_missing_run_dir_or_metrics_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"argument 1: run directory '.*nope' does not exist; expected a run"):
        rlnb.compare(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"argument 2: '.*empty/metrics.jsonl' does not exist; .*metrics.jsonl"):
        rlnb.compare(FakeSession("a"), tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(NotADirectoryError, match=r"'.*notes.txt' is not a directory"):
        rlnb.compare(str(tmp_path / "notes.txt"))


# -- the widget and its ticker ---------------------------------------------------------


def test_the_widget_follows_an_open_session_and_keeps_its_last_image(fast: None) -> None:
    import ipywidgets

    sess = FakeSession("live", [0.1, 0.2])
    with rlnb.compare(sess) as comparison:
        assert not tickers()  # nothing starts before the widget is made
        widget = comparison.widget
        assert isinstance(widget, ipywidgets.Image) and widget.format == "png"
        assert bytes(widget.value).startswith(PNG_MAGIC)
        assert comparison.widget is widget and len(tickers()) == 1 and tickers()[0].daemon
        assert "live" in repr(comparison)
        first = bytes(widget.value)
        sess.train(0.3)
        wait_until(lambda: bytes(widget.value) != first, "a redraw after a step")
        drawn = comparison.redraws
        threading.Event().wait(0.2)  # the data stays: no redraw
        assert comparison.redraws == drawn
        sess.changes.append(FakeChange(3, "lr", 1e-4, 1e-3))
        wait_until(lambda: comparison.redraws == drawn + 1, "a redraw after a change")
        sess.train(0.9)
        sess.closed = True
        wait_until(lambda: not tickers(), "the ticker to end once the session closed")
        assert comparison.runs()[0].curves["reward_mean"][-1] == (4.0, 0.9)  # drawn before it ended
        assert bytes(widget.value) == comparison._png  # the last image, drawn with the last step
        assert widget.comm is not None  # and the widget stays
        assert "finished" in repr(comparison)
    assert widget.comm is None


@pytest.mark.slow  # seconds of waiting or drawing: the integration tier
def test_redraws_are_paced_while_data_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compare, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(_compare, "REDRAW_INTERVAL", 0.3)
    monkeypatch.setattr(_compare, "_TIME_SHARE", 0)
    sess = FakeSession("busy", [0.1])
    with rlnb.compare(sess) as comparison:
        assert comparison.widget is not None
        started = time.monotonic()
        stop = threading.Event()
        # data grows every 10 ms until a few redraws came (however slow the machine)
        while not stop.wait(0.01) and comparison.redraws < 6 and time.monotonic() - started < 30:
            sess.train(0.5)
        elapsed = time.monotonic() - started
        # the widget's first draw, then at most one every 0.3 s: not one per new step
        assert comparison.redraws >= 6, f"{comparison.redraws} redraws in {elapsed:.1f} s while data grew"
        assert comparison.redraws <= 2 + elapsed / 0.3, (comparison.redraws, elapsed)


def test_a_redraw_waits_for_its_pace_and_close_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # An hour between redraws: a close that waited for the pace would hang this test
    # (pytest-timeout fails it) instead of ending the ticker.
    monkeypatch.setattr(_compare, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(_compare, "REDRAW_INTERVAL", 3600.0)
    sess = FakeSession("slow", [0.1])
    with rlnb.compare(sess) as comparison:
        assert comparison.widget is not None
        assert len(tickers()) == 1
        sess.train(0.2)
        threading.Event().wait(0.2)  # twenty looks at the runs' sizes
        assert comparison.redraws == 1  # the widget's first draw only: the next waits for its pace
    assert not tickers()


def test_close_ends_the_ticker_at_once_and_is_idempotent(fast: None) -> None:
    sess = FakeSession("open", [0.1])
    with rlnb.compare(sess) as comparison:
        widget = comparison.widget
        (ticker,) = tickers()
        comparison.close()
        assert not ticker.is_alive()  # joined by close()
        comparison.close()
        assert comparison.closed and "closed" in repr(comparison) and widget.comm is None
        with pytest.raises(rlnb.ClosedError, match="comparison is closed: its figure"):
            _ = comparison.widget
        assert curves(comparison.figure().axes[0]) == {"open": ([1.0], [0.1])}  # figure() still works


def test_a_session_collected_before_the_widget_shows_its_last_reading() -> None:
    with rlnb.compare(FakeSession("brief", [0.3, 0.4])) as comparison:  # only the comparison held it
        assert not comparison.live
        assert comparison.widget is not None
        assert not tickers()  # nothing to follow
        assert curves(comparison.figure().axes[0]) == {"brief": ([1.0, 2.0], [0.3, 0.4])}


def test_the_widget_holds_no_strong_reference_to_a_session(fast: None) -> None:
    sess = FakeSession("gone", [0.1, 0.2], changes=[FakeChange(1, "lr", 1e-4, 2e-4)])
    ref = weakref.ref(sess)
    with rlnb.compare(sess) as comparison:
        assert comparison.widget is not None
        assert len(tickers()) == 1
        del sess
        wait_until(lambda: gc.collect() >= 0 and ref() is None, "the session to be collected")
        wait_until(lambda: not tickers(), "the ticker to end once its only session is gone")
        fig = comparison.figure()  # the last reading stays
        assert curves(fig.axes[0]) == {"gone": ([1.0, 2.0], [0.1, 0.2])}
        assert marks(fig.axes[0])[0][:2] == (1.0, "lr 0.0001→0.0002")


def test_shown_live_it_is_the_widget_with_an_image_then_the_image(fast: None, shown: list[Any]) -> None:
    sess = FakeSession("shown", [0.1])
    with rlnb.compare(sess) as comparison:
        comparison._ipython_display_()
        ((bundle, updates),) = shown
        assert bundle[WIDGET_VIEW]["model_id"] == comparison.widget.model_id
        assert bundle["image/png"] and "shown" in bundle["text/plain"]
        sess.train(0.5)
        sess.closed = True
        wait_until(lambda: bool(updates), "the display to become the last image")
        assert set(updates[0]) == {"image/png", "text/plain"}
        assert updates[0]["image/png"] != bundle["image/png"]  # with the last step in it
    assert len(updates) == 1  # close() has no display left to update


def test_shown_finished_it_is_an_image_and_starts_nothing(tmp_path: Path, shown: list[Any]) -> None:
    sess = FakeSession("done", [0.1])
    sess.closed = True
    with rlnb.compare(sess, write_run(tmp_path, "run")) as comparison:
        bundle = comparison._repr_mimebundle_()
        assert set(bundle) == {"image/png", "text/plain"} and WIDGET_VIEW not in bundle
        comparison._ipython_display_()
        assert set(shown[0][0]) == {"image/png", "text/plain"}
        assert comparison._widget is None and not tickers()


def test_a_failure_on_the_ticker_surfaces_at_the_next_call(fast: None) -> None:
    class Broken(FakeSession):
        fail = False

        @property
        def evaluations(self) -> list[tuple[int, float]]:
            if self.fail:
                raise OSError("disk gone")
            return []

        @evaluations.setter
        def evaluations(self, value: list[tuple[int, float]]) -> None:
            pass

    sess = Broken("broken", [0.1])
    with rlnb.compare(sess, metrics=("reward_mean",)) as comparison:
        assert comparison.widget is not None
        sess.fail = True
        wait_until(lambda: not tickers(), "the failed ticker to end")
        with pytest.raises(RuntimeError, match="ticker thread failed: OSError") as caught:
            comparison.figure()
        assert isinstance(caught.value.__cause__, OSError)
        sess.fail = False
        comparison.figure()  # raised once


def test_runs_that_ended_with_their_sessions_open_get_their_last_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draw paced at many times its cost (a loaded machine) must not leave the image
    at an earlier step once the runs have ended: notebook 09's branches reached 100
    while the image stayed near 82."""
    monkeypatch.setattr(_compare, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(_compare, "REDRAW_INTERVAL", 0.2)
    monkeypatch.setattr(_compare, "_TIME_SHARE", 10_000)  # the paced redraw: never, in this test
    sess = FakeSession("ended", [0.1])
    with rlnb.compare(sess) as comparison:
        widget = comparison.widget
        first = bytes(widget.value)
        sess.train(0.5)  # the run's last step; its session stays open
        wait_until(lambda: bytes(widget.value) != first, "the last frame once the run stopped growing")
        assert bytes(widget.value) == comparison._png and comparison.redraws == 2


def test_close_shows_every_step_read_now_not_the_last_frame_drawn(shown: list[Any]) -> None:
    sess = FakeSession("late", [0.1])
    with rlnb.compare(sess) as comparison:  # at the default pace: no redraw for 2 s
        comparison._ipython_display_()
        ((bundle, updates),) = shown
        sess.train(0.5)
        comparison.close()
        (update,) = updates
        assert update["image/png"] != bundle["image/png"]  # with the last step in it
        assert comparison.redraws == 2


def test_a_run_holding_huge_values_and_a_change_draws_beside_the_others(tmp_path: Path) -> None:
    run = write_run(tmp_path, "baseline")
    huge = tmp_path / "huge"
    huge.mkdir()
    records = [
        {"step": 1, "reward_mean": 1e308},
        {"step": 2, "reward_mean": -1e308},
        {"event": "change", "step": 2, "field": "lr", "old": 0.0001, "new": 0.001, "time": 101.0},
        {"step": 3, "reward_mean": 0.5},
        {"event": "change", "step": 1e308, "field": "top_k", "old": 0, "new": 5, "time": 102.0},
    ]
    (huge / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with rlnb.compare(run, huge) as comparison:
        fig = comparison.figure()  # before: LinAlgError, from every draw, hiding the baseline too
        reward = fig.axes[0]
        assert curves(reward) == {"baseline": ([1.0, 2.0, 3.0], [0.1, 0.3, 0.6]), "huge": ([3.0], [0.5])}
        assert "2 values beyond ±3.4e+38 not drawn" in [t.get_text() for t in reward.texts]
        assert [x for x, _, _ in marks(reward)] == [2.0, 2.0]  # the mark at step 1e308 is off the chart too
        assert comparison.save(tmp_path / "both.png").read_bytes().startswith(PNG_MAGIC)
        huge_run = comparison.runs()[1]
        assert huge_run.curves["reward_mean"][0] == (1.0, 1e308)  # the data is as read
