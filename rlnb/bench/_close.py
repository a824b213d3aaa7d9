"""``rlnb bench close``: how fast things stop.

- a replay-buffer feeder with a 5 s poll interval, closed while it waits;
- an empty ``Session.close()`` (its bridge loop started);
- ``rlnb.close_all()`` of three such sessions;
- with ``--tracker wandb``: ``Session.close()`` of a session whose tracker has an
  offline wandb run with a few steps logged (finish, teardown, wandb-core gone),
  so that a kernel restart, which allows 2.5 s, stays graceful.
"""

from __future__ import annotations

import tempfile
import threading

from rlnb._errors import InvalidValueError
from rlnb.bench._common import BenchResult, Target, median, p99, time_ms
from rlnb.buffer import ReplayBuffer
from rlnb.runtime import close_all as close_all_sessions
from rlnb.session import Session


async def _noop() -> None:
    return None


def _feeder_close_ms(poll_interval: float) -> float:
    polled = threading.Event()

    def feeder() -> tuple[()]:
        polled.set()
        return ()

    buf = ReplayBuffer(feeder=feeder, poll_interval=poll_interval, name="bench-buffer")
    polled.wait(5.0)
    # the feeder thread is now in (or about to enter) its 5 s wait
    threading.Event().wait(0.002)
    return time_ms(buf.close)


def _started_session(name: str) -> Session:
    sess = Session(name=name)
    sess.bridge.run(_noop())
    return sess


def _wandb_close_ms(run_dir: str) -> float:
    from rlnb.config import Config, DataConfig, ModelConfig, RolloutConfig, TrackConfig

    config = Config(
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=RolloutConfig(group_size=4, groups_per_step=4),
        data=DataConfig(num_workers=0),
        track=TrackConfig(backends=("wandb",), run_dir=run_dir, wandb_mode="offline"),
    )
    sess = Session(config, name="bench-close-wandb")
    for _ in range(3):
        sess.step()
    return time_ms(sess.close)


def run(*, repeats: int = 50, poll_interval: float = 5.0, tracker: str | None = None) -> BenchResult:
    """Measure; blocks for a few seconds (tens with ``tracker="wandb"``)."""
    if tracker not in (None, "wandb"):
        raise InvalidValueError(f"bench close --tracker {tracker!r}: only 'wandb' is measured")
    feeder = [_feeder_close_ms(poll_interval) for _ in range(repeats)]
    session = []
    for i in range(repeats):
        sess = _started_session(f"bench-close-{i}")
        session.append(time_ms(sess.close))
    close_all = []
    for _ in range(max(5, repeats // 5)):
        for i in range(3):
            _started_session(f"bench-close-all-{i}")
        close_all.append(time_ms(close_all_sessions))
    figures = {
        "feeder_poll_interval_s": poll_interval,
        "feeder_close_median_ms": median(feeder),
        "feeder_close_p99_ms": p99(feeder),
        "session_close_median_ms": median(session),
        "session_close_p99_ms": p99(session),
        "close_all_3_median_ms": median(close_all),
        "close_all_3_p99_ms": p99(close_all),
    }
    targets = [
        Target("feeder_close_p99", p99(feeder), "<=", 10.0, " ms"),
        Target("session_close_median", median(session), "<=", 50.0, " ms"),
        Target("close_all_3_median", median(close_all), "<=", 200.0, " ms"),
    ]
    if tracker == "wandb":
        with tempfile.TemporaryDirectory(prefix="rlnb-bench-wandb-") as run_dir:
            wandb = [_wandb_close_ms(run_dir) for _ in range(max(3, repeats // 10))]
        figures["wandb_session_close_median_ms"] = median(wandb)
        figures["wandb_session_close_max_ms"] = max(wandb)
        targets.append(Target("wandb_session_close_max", max(wandb) / 1e3, "<=", 1.5, " s"))
    return BenchResult("close", figures, tuple(targets))
