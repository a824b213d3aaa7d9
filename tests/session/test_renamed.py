"""The Session's old names (``rlnb.session._session.RENAMED``) still work for one release:
each does what its new name does, and warns once with a DeprecationWarning that names
the new one and points at the caller's line, so a user's notebook cell is what shows."""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections.abc import Callable

import pytest

import rlnb
from rlnb.rollout import RolloutState
from rlnb.session._session import RENAMED
from tests.helpers import small_config

CONFIG = small_config()


def quarter(completion: str, answer: object) -> float:
    return 0.25


@dataclasses.dataclass(frozen=True)
class OldUse:
    """``before`` readies the session, ``old`` uses the old name (on a line that names
    it: the warning must point there), ``then`` says the use did what the new name does."""

    old: Callable[[rlnb.Session], object]
    then: Callable[[rlnb.Session, object], bool]
    before: Callable[[rlnb.Session], object] = lambda sess: None
    after: Callable[[rlnb.Session], object] = lambda sess: None


def running(sess: rlnb.Session) -> bool:
    return sess.statistics().rollout.dispatching


# By old name, as RENAMED spells it. The text on each ``old`` line is what the warning's
# line must hold (the attribute after the dot).
USES = {
    "start()": OldUse(
        old=lambda sess: sess.start(1),
        then=lambda sess, _: sess.training.wait(60) is None and sess.version == 1,
    ),
    "stop()": OldUse(
        before=lambda sess: sess.training.start(),
        old=lambda sess: sess.stop(60),
        then=lambda sess, _: not sess.training.running,
    ),
    "wait()": OldUse(
        before=lambda sess: sess.training.start(1),
        old=lambda sess: sess.wait(60),
        then=lambda sess, _: sess.version == 1 and not sess.training.running,
    ),
    "training (a bool)": OldUse(
        before=lambda sess: sess.training.start(),
        old=lambda sess: bool(sess.training),
        then=lambda sess, value: value is True and sess.training.running,
        after=lambda sess: sess.training.stop(60),
    ),
    "start_rollouts()": OldUse(
        old=lambda sess: sess.start_rollouts(),
        then=lambda sess, _: running(sess),
        after=lambda sess: sess.rollouts.stop(),
    ),
    "stop_rollouts()": OldUse(
        before=lambda sess: sess.rollouts.start(),
        old=lambda sess: sess.stop_rollouts(),
        then=lambda sess, _: not running(sess),
    ),
    "pause()": OldUse(
        before=lambda sess: sess.rollouts.start(),
        old=lambda sess: sess.pause("abort"),
        then=lambda sess, _: sess.rollouts.state is RolloutState.PAUSED,
        after=lambda sess: sess.rollouts.resume(),
    ),
    "resume()": OldUse(
        before=lambda sess: (sess.rollouts.start(), sess.rollouts.pause("abort")),
        old=lambda sess: sess.resume(),
        then=lambda sess, _: sess.rollouts.state is RolloutState.RUNNING,
    ),
    "wait_paused()": OldUse(
        before=lambda sess: (sess.rollouts.start(), sess.rollouts.pause("wait")),
        old=lambda sess: sess.wait_paused(60),
        then=lambda sess, _: sess.rollouts.state is RolloutState.PAUSED,
        after=lambda sess: sess.rollouts.resume(),
    ),
    "set_reward()": OldUse(
        old=lambda sess: sess.set_reward(quarter),
        then=lambda sess, _: sess.rollouts.reward_name == "quarter" and sess.rollouts.reward is quarter,
    ),
    "reward_name": OldUse(
        before=lambda sess: sess.rollouts.set_reward(quarter),
        old=lambda sess: sess.reward_name,
        then=lambda sess, value: value == "quarter",
    ),
}


def test_every_old_name_has_a_use_here() -> None:
    assert sorted(USES) == sorted(RENAMED)


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_works_and_warns_naming_the_new_one_at_the_callers_line(old: str, new: str) -> None:
    use = USES[old]
    attribute = old.split(" ")[0].removesuffix("()")  # "start()" -> "start", "training (a bool)" -> "training"
    with rlnb.Session(CONFIG, name="renamed") as sess:
        use.before(sess)
        with pytest.warns(DeprecationWarning) as warned:
            value = use.old(sess)
        assert use.then(sess, value), f"sess.{old} did not do what sess.{new} does"
        use.after(sess)

    (warning,) = [w for w in warned if issubclass(w.category, DeprecationWarning)]
    message = str(warning.message)
    assert f"Session.{attribute}" in message and f"sess.{new}" in message and "next release" in message, message
    assert warning.filename == __file__, (warning.filename, warning.lineno)
    line = linecache.getline(warning.filename, warning.lineno)
    assert re.search(rf"\bsess\.{attribute}\b", line), f"the warning points at {warning.lineno}: {line!r}"
