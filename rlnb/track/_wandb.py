"""The wandb backend: one run, finished and torn down in-band.

The run is made at the first log (or the first look at ``run``), so a session that
logs nothing (a cell run again before it trained, say) leaves no empty run behind.
``run.finish()`` returns in milliseconds but leaves the ``wandb-core`` service and
its threads until ``wandb.teardown()``; the backend calls both in ``finish``, the
teardown only once no other rlnb wandb run in this process is open (the service is
shared). Both are guarded: wandb may raise ``SystemExit`` on a broken service.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlnb._errors import ClosedError

__all__ = ["WandbBackend", "wandb_mode_from_env"]

_OPEN_LOCK = threading.Lock()
_OPEN = 0  # rlnb wandb runs open in this process

FLUSH_INTERVAL = 1.0
"""Seconds between wandb-core's writes of a run's records to its ``.wandb`` file."""


class WandbBackend:
    """One wandb run, made when first needed; see the module docstring."""

    name = "wandb"

    def __init__(
        self,
        *,
        run_dir: Path,
        run_id: str,
        name: str | None,
        config: Mapping[str, Any] | None,
        mode: str,
        project: str,
    ) -> None:
        self.run_dir = run_dir
        self._init: dict[str, Any] = {
            "run_id": run_id,
            "name": name,
            "config": dict(config or {}),
            "mode": mode,
            "project": project,
        }
        self._run: Any = None
        self._lock = threading.Lock()  # the first log may come from a training thread
        self._finished = False

    @property
    def started(self) -> bool:
        """Whether the run has been made (it is at the first log)."""
        return self._run is not None

    @property
    def run(self) -> Any:
        """The wandb run, made now if it was not yet."""
        with self._lock:
            if self._run is None:
                if self._finished:
                    raise ClosedError("this wandb backend has finished; it makes no new run")
                self._run = self._start(**self._init)
            return self._run

    def _start(self, *, run_id: str, name: str | None, config: dict[str, Any], mode: str, project: str) -> Any:
        global _OPEN
        import wandb

        if mode != "online":
            # wandb's usage analytics follow its process-wide settings, not this
            # run's mode: an offline run would still start two exporter threads
            # (and send usage data). Offline means nothing leaves the machine.
            _disable_analytics()
        extra: dict[str, Any] = {}
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:  # not in older wandb
            # wandb-core writes the run file every 15 s by default, and a process killed
            # with SIGKILL takes the unwritten records with it: lose at most a second.
            extra["x_transaction_log_flush_interval"] = FLUSH_INTERVAL
        settings = wandb.Settings(
            silent=True,
            console="off",  # no stdout/stderr wrapping: notebooks and progress bars stay as they are
            x_disable_stats=True,  # no system-metrics sampling
            disable_git=True,
            save_code=False,
            **extra,
        )
        run = wandb.init(
            project=project,
            dir=str(self.run_dir),
            id=run_id,
            name=name,
            config=config,
            mode=mode,  # type: ignore[arg-type]
            resume="allow",
            reinit="create_new",
            settings=settings,
        )
        with _OPEN_LOCK:
            _OPEN += 1
        return run

    @property
    def files(self) -> Path:
        """The directory wandb writes this run's files into."""
        return Path(self.run.dir).parent

    def run_file(self) -> Path:
        """This run's ``run-<id>.wandb`` record file."""
        return self.files / f"run-{self.run.id}.wandb"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_change(self, change: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        """The run's config takes the new values (wandb keeps each update in the run's
        history of config changes), and a number is logged as ``change/<field>`` at the
        step, a marker on the curves."""
        if config is not None:
            self.run.config.update(dict(config), allow_val_change=True)
        new = change["new"]
        if isinstance(new, int | float) and not isinstance(new, bool):
            self.run.log({f"change/{change['field']}": float(new)}, step=int(change["step"]))

    def finish(self, exit_code: int) -> None:
        global _OPEN
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if self._run is None:  # nothing was logged: no run was made
                return
        try:
            self.run.finish(exit_code=exit_code)
        finally:
            with _OPEN_LOCK:
                _OPEN -= 1
                last = _OPEN == 0
            if last:
                import wandb

                wandb.teardown(exit_code=exit_code)
                _stop_analytics()


def _disable_analytics() -> None:
    try:
        from wandb.analytics.opentelemetry import opentelemetry_proxy
    except ImportError:  # another wandb version: nothing of this kind to turn off
        return
    opentelemetry_proxy.disable()


def _stop_analytics() -> None:
    """Shut down wandb's analytics exporters (threads) if an online run started them."""
    try:
        from wandb.analytics.opentelemetry import opentelemetry_proxy
    except ImportError:
        return
    proxy = getattr(opentelemetry_proxy, "_singleton_telemetry_proxy", None)
    if proxy is not None:
        proxy.shutdown(timeout_millis=1000)


def wandb_mode_from_env(default: str = "offline") -> str:
    """``WANDB_MODE`` if set (``dryrun`` counts as offline), else ``default``."""
    mode = os.environ.get("WANDB_MODE", default)
    return "offline" if mode == "dryrun" else mode
