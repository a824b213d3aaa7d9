from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import rlnb
from rlnb.probe import snapshot
from rlnb.runtime._bridge import live_loops
from rlnb.session import Session
from tests.helpers import wait_until


async def double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def one_group(i: int = 0) -> rlnb.Group:
    return rlnb.Group(prompt=f"p{i}", samples=(rlnb.Sample(prompt=f"p{i}", completion="c"),), prompt_id=i)


def test_a_session_runs_coroutines_and_holds_a_buffer() -> None:
    with rlnb.Session(name="basic") as sess:
        assert sess.bridge.run(double(21)) == 42
        sess.buffer.put(one_group())
        assert sess.buffer.get(1, timeout=1)[0].prompt == "p0"
        assert rlnb.sessions() == [sess]
        stats = sess.statistics()
        assert stats.buffer.put == 1 and stats.buffer.taken == 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.name = "x"  # type: ignore[misc]
    assert sess.closed
    assert rlnb.sessions() == []
    assert live_loops() == ()


def test_close_is_idempotent_and_use_after_close_names_the_session() -> None:
    sess = rlnb.Session(name="twice")
    sess.bridge.run(double(1))
    sess.close()
    sess.close()
    with pytest.raises(rlnb.ClosedError, match="session 'twice' is closed"):
        sess.bridge  # noqa: B018
    with pytest.raises(rlnb.ClosedError):
        sess.statistics()


def test_same_name_replaces_the_live_session_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    first = rlnb.Session(name="cell")
    first.bridge.run(double(1))
    other = rlnb.Session(name="other-cell")
    second = rlnb.Session(name="cell")  # re-running the cell
    assert first.closed and not second.closed and not other.closed
    assert "closed the earlier session 'cell'" in capsys.readouterr().out
    assert {s.name for s in rlnb.sessions()} == {"cell", "other-cell"}
    assert second.bridge.run(double(2)) == 4
    rlnb.close_all()
    assert second.closed and other.closed


def test_bad_input_raises_before_anything_is_closed_or_built() -> None:
    live = rlnb.Session(name="keep")
    before = snapshot()
    with pytest.raises(rlnb.ConfigError, match=r"rlnb\.Config"):
        rlnb.Session({"seed": 1}, name="keep")  # type: ignore[arg-type]
    with pytest.raises(rlnb.ConfigError, match="name"):
        rlnb.Session(name="")
    assert not live.closed  # nothing already done was lost
    assert snapshot().new_since(before) == {}
    live.close()


@pytest.mark.slow  # 200 sessions, each starting a loader worker: 12-18 s on two cores
def test_200_create_close_cycles_leave_no_fds_or_threads() -> None:
    rlnb.Session(name="warm").close()
    before = snapshot()
    for i in range(200):
        with rlnb.Session(name="cycle") as sess:
            sess.bridge.run(double(i))
            sess.buffer.put(one_group(i))
    after = snapshot()
    assert after.num_fds == before.num_fds
    assert after.num_threads == before.num_threads
    assert after.new_since(before) == {}


@pytest.mark.parametrize("stage", Session._STAGES)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failure_at_any_construction_stage_leaves_nothing(
    stage: str, error: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    original: Callable[[Session], None] = getattr(Session, f"_build_{stage}")

    def build_then_fail(self: Session) -> None:
        original(self)  # the stage acquires its resource, then construction fails
        if self._bridge is not None:
            self._bridge.run(double(1))  # make the bridge hold a real thread and loop
        raise error(f"injected after {stage}")

    monkeypatch.setattr(Session, f"_build_{stage}", build_then_fail)
    before = snapshot()
    with pytest.raises(error, match=f"injected after {stage}"):
        rlnb.Session(name="broken")
    assert rlnb.sessions() == []
    assert snapshot().new_since(before) == {}


def test_close_releases_parts_newest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    sess = rlnb.Session(name="order")
    for attr in ("_bridge", "_buffer"):
        part = getattr(sess, attr)
        close = part.close

        def record(timeout: float | None = None, _close=close, _name=attr) -> None:
            events.append(f"{_name} closing, registered={sess in rlnb.sessions()}")
            _close(timeout=timeout)

        monkeypatch.setattr(part, "close", record)
    sess.close()
    assert events == ["_buffer closing, registered=False", "_bridge closing, registered=False"]


def test_a_part_that_fails_to_close_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    sess = rlnb.Session(name="bad-close")
    sess.bridge.run(double(1))
    buffer, bridge = sess.buffer, sess.bridge
    real_close = buffer.close

    def failing_close(timeout: float | None = None) -> None:
        real_close(timeout=timeout)
        raise OSError("disk gone")

    monkeypatch.setattr(buffer, "close", failing_close)
    with pytest.raises(OSError, match="disk gone"):
        sess.close()
    assert sess.closed and bridge.closed and buffer.closed
    assert rlnb.sessions() == []
    sess.close()  # still idempotent


def test_close_wakes_a_thread_blocked_on_the_buffer() -> None:
    sess = rlnb.Session(name="wake")
    outcome: list[BaseException] = []
    waiting = threading.Event()

    def learner() -> None:
        buffer = sess.buffer
        waiting.set()
        try:
            buffer.get(1)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=learner)
    thread.start()
    waiting.wait(5)
    wait_until(lambda: sess.buffer.statistics().waiting_getters == 1, "the learner to block in get()")
    sess.close()
    thread.join(5)
    assert not thread.is_alive()
    assert [type(e) for e in outcome] == [rlnb.ClosedError]


def test_a_session_cannot_be_pickled() -> None:
    with rlnb.Session(name="pickle") as sess, pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(sess)


class ClosableFake(rlnb.engines.FakeEngine):
    """A FakeEngine that records its close."""

    def __init__(self) -> None:
        super().__init__(lengths=3)
        self.close_calls = 0

    def close(self, timeout: float | None = None) -> None:
        self.close_calls += 1
        super().close(timeout)


def test_a_session_drives_any_engine_it_is_given_and_owns_it() -> None:
    engine = ClosableFake()
    with rlnb.Session(name="given-engine", engine=engine) as sess:
        assert engine.weights is not None  # it starts from the policy's weights
        batch = sess.rollout(2)
        assert len(batch) == 2 and all(s.token_ids == (3, 3, 2) for g in batch for s in g.samples)
        assert sess.statistics().engine.generated_tokens == 2 * sess.config.rollout.group_size * 3
        assert not [t for t in threading.enumerate() if t.name == "rlnb-given-engine-engine"]  # none built
        assert engine.close_calls == 0
    assert engine.close_calls == 1


def test_an_object_that_is_not_an_engine_is_refused_before_anything_is_built() -> None:
    before = snapshot()
    with pytest.raises(rlnb.ConfigError, match=r"Session\(engine=str\) is invalid.*generate"):
        rlnb.Session(name="not-an-engine", engine="vllm")  # type: ignore[arg-type]
    assert rlnb.sessions() == [] and snapshot().new_since(before) == {}


def test_a_given_engine_is_closed_when_construction_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: Session) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(Session, "_build_rollouter", fail)
    engine = ClosableFake()
    with pytest.raises(RuntimeError, match="injected"):
        rlnb.Session(name="given-then-broken", engine=engine)
    assert engine.close_calls == 1


def test_a_construction_that_fails_after_the_tracker_finishes_its_run_as_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(self: Session) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(Session, "_build_engine", fail)
    config = rlnb.Config(track=rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="injected"):
        rlnb.Session(config, name="broken")
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "finish" and last["exit_code"] == 1
