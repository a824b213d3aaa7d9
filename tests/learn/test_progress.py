"""Progress bars suit where they go: plain lines in a file or log, tqdm's bar in a
terminal, the widget bar in a notebook, nothing with ``progress=False``."""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING, Any

import pytest

import rlnb
from rlnb.learn import progress_bar

if TYPE_CHECKING:
    from tests.helpers.kernel import OpenKernel


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_bar(total: int, steps: int, desc: str = "rlnb t") -> None:
    with progress_bar(total, desc) as bar:
        for i in range(steps):
            bar.set_postfix(loss=f"{i:.3f}")
            bar.update(1)


def test_in_a_file_or_log_a_short_run_is_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    run_bar(10, 10)
    out, err = capsys.readouterr()
    assert out == "" and "\r" not in err
    assert re.fullmatch(r"rlnb t: 10/10 steps \(100%\) in \d+\.\d s, [\d.e+]+ steps/s, loss 9\.000\n", err), err


def test_in_a_file_or_log_a_line_comes_every_interval(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLNB_PROGRESS_INTERVAL", "0")
    run_bar(4, 4)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines[:3]] == [f"rlnb t: step {n}/4 ({25 * n}%)" for n in (1, 2, 3)]
    assert lines[1].endswith(", loss 1.000")
    assert len(lines) == 4 and lines[3].startswith("rlnb t: 4/4 steps (100%) in ")


def test_a_bar_left_early_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyboardInterrupt), progress_bar(5, "rlnb t") as bar:
        bar.update(2)
        raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert err.startswith("rlnb t: 2/5 steps (40%) in ") and err.endswith("  (stopped early)\n"), err


def test_a_bar_of_no_steps_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    run_bar(0, 0)
    assert capsys.readouterr().err == ""


def test_in_a_terminal_it_is_tqdms_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    run_bar(3, 3)
    shown = terminal.getvalue()
    assert "\r" in shown and "3/3 [" in shown and "loss=2.000" in shown and "|" in shown


def test_progress_false_writes_nothing_anywhere(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLNB_PROGRESS_INTERVAL", "bogus")  # not read when there is no bar
    with progress_bar(3, "rlnb t", enabled=False) as bar:
        bar.set_postfix(loss="1")
        bar.update(3)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("value", ["bogus", "-1", "nan"])
def test_a_bad_interval_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("RLNB_PROGRESS_INTERVAL", value)
    with pytest.raises(rlnb.ConfigError, match=f"RLNB_PROGRESS_INTERVAL='{value}' is invalid: use a number"):
        progress_bar(3, "rlnb t")


NOTEBOOK_BAR = """
from rlnb.learn import progress_bar
with progress_bar(3, "rlnb k") as bar:
    for _ in range(3):
        bar.set_postfix(loss="0.5")
        bar.update(1)
"""


@pytest.mark.slow
def test_in_a_notebook_it_is_the_widget_bar_left_as_its_last_line(open_kernel: OpenKernel) -> None:
    from tests.helpers.kernel import TIMEOUT

    with open_kernel() as (_, kc):
        msgs: list[dict[str, Any]] = []
        reply = kc.execute_interactive(NOTEBOOK_BAR, timeout=TIMEOUT, output_hook=msgs.append)
        assert reply["content"]["status"] == "ok", reply["content"]
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"]
    assert len(shown) == 1 and "application/vnd.jupyter.widget-view+json" in shown[0]
    last = [m["content"]["data"] for m in msgs if m["msg_type"] == "update_display_data"][-1]
    assert "rlnb k: 100%" in last["text/plain"] and "3/3" in last["text/plain"]
    assert not [m for m in msgs if m["msg_type"] == "stream"]  # nothing written to the cell's stderr
