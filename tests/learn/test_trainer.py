"""The trainer's callbacks, seen through a session: what each hook gets and when."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

import rlnb
from rlnb.learn import Callback
from tests.helpers import small_config

CONFIG = small_config()


class Log(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_batch(self, groups: Sequence[rlnb.Group]) -> None:
        self.events.append(("batch", len(groups)))

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        self.events.append(("step_end", metrics["version"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_callbacks_see_each_batch_then_each_completed_step(mode: str) -> None:
    log = Log()
    with rlnb.Session(CONFIG.replace(mode=mode), name=f"callbacks-{mode}", callbacks=[log]) as sess:
        sess.train(2, progress=False)
        assert log.events == [("batch", 4), ("step_end", 1.0), ("batch", 4), ("step_end", 2.0)]
        sess.callbacks.remove(log)  # the live list: changes apply from the next step
        sess.step()
        assert len(log.events) == 4
        assert sess.version == 3


def test_a_callback_that_fails_after_the_step_leaves_the_step_done() -> None:
    class Broken(Callback):
        def on_step_end(self, metrics: Mapping[str, float]) -> None:
            raise ValueError("my plotting code")

    with rlnb.Session(CONFIG, name="callback-fails", callbacks=[Broken()]) as sess:
        with pytest.raises(ValueError, match="my plotting code"):
            sess.step()
        assert sess.version == 1 and sess.statistics().engine.version == 1  # updated and synced
        sess.callbacks.clear()
        assert sess.step()["version"] == 2


def test_a_callback_that_fails_before_the_update_trains_nothing_and_loses_nothing() -> None:
    class Veto(Callback):
        def __init__(self) -> None:
            self.seen: list[list[int]] = []

        def on_batch(self, groups: Sequence[rlnb.Group]) -> None:
            self.seen.append([g.prompt_id for g in groups])
            if len(self.seen) == 1:
                raise RuntimeError("not this one")

    veto = Veto()
    with rlnb.Session(CONFIG, name="callback-veto", callbacks=[veto]) as sess:
        with pytest.raises(RuntimeError, match="not this one"):
            sess.step()
        assert sess.version == 0
        sess.step()
    assert veto.seen[1] == veto.seen[0]  # the same prompts come back first, in sync mode too
