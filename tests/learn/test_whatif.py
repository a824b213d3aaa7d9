"""What a what-if shows of the clip: where it could not act (one update per batch,
whose ratio is 1, or a loss without a clip), its table says so, so that two equal
columns after a clip change read as what they are; its title names an algorithm or a
function, not its repr."""

from __future__ import annotations

import html
import re

import torch

import rlnb
from rlnb.algorithms.functional import LossInputs
from rlnb.config import LearnConfig
from rlnb.learn import WhatIf
from rlnb.learn._whatif import clip_note
from tests.helpers import small_config

ONE = LearnConfig()  # epochs=1, minibatches=1: the ratio is 1
TWO = LearnConfig(epochs=2)


def test_the_note_says_why_two_columns_under_a_clip_change_are_the_same() -> None:
    note = clip_note({"clip_eps": 0.1}, ONE, LearnConfig(clip_eps=0.1), (False, False))
    assert note == (
        "clip inactive in both columns (ratio 1: one update per batch): clip_eps can change nothing here; "
        "for the clip to act, more than one update per batch: LearnConfig(epochs=2) or minibatches > 1"
    )
    # no clip setting asked about: just the state
    assert clip_note({"lr": 1e-3}, ONE, LearnConfig(lr=1e-3), (False, False)) == (
        "clip inactive in both columns (ratio 1: one update per batch)"
    )
    assert clip_note({"clip_eps": 0.1}, TWO, LearnConfig(epochs=2, clip_eps=0.1), (True, True)) == ""
    assert clip_note({"epochs": 2}, ONE, TWO, (False, True)) == (
        "clip inactive now (ratio 1: one update per batch), active with the change"
    )
    sapo = LearnConfig(epochs=2, algorithm="sapo")
    assert clip_note({"algorithm": "sapo"}, TWO, sapo, (True, False)) == (
        "clip active now, inactive with the change (the loss 'sapo' has no clip)"
    )


def test_the_table_shows_clip_active_and_the_note() -> None:
    row = {"loss": 0.5, "clip_active": 0.0, "clip_fraction": 0.0}
    result = WhatIf(3, {"clip_eps": 0.1}, {**row, "clip_active": 0.0}, row, row, note="clip inactive in both columns")
    lines = repr(result).splitlines()
    assert re.fullmatch(r"clip_active +no +no +no", lines[3]), lines
    assert lines[-1] == "clip inactive in both columns"
    page = result._repr_html_()
    assert "<tr><td>clip_active</td><td>no</td><td>no</td><td>no</td></tr>" in page
    assert '<div class="rlnb-whatif-note">clip inactive in both columns</div>' in page
    quiet = WhatIf(3, {}, {}, {**row, "clip_active": 1.0}, {**row, "clip_active": 1.0})
    assert "rlnb-whatif-note" not in quiet._repr_html_() and "yes" in repr(quiet)


def test_a_sessions_what_if_of_clip_eps_with_one_update_per_batch_says_the_clip_is_inactive() -> None:
    with rlnb.Session(small_config(), name="whatif-clip") as sess:
        sess.train(2, progress=False)
        result = sess.what_if(clip_eps=0.1)
        more = sess.what_if(epochs=2, clip_eps=0.1)
    assert result.baseline["clip_active"] == result.changed["clip_active"] == 0.0
    assert result.baseline["loss"] == result.changed["loss"]  # the same: the clip never acted
    assert "clip inactive in both columns (ratio 1: one update per batch): clip_eps can change nothing" in repr(result)
    assert more.changed["clip_active"] == 1.0
    assert more.note == "clip inactive now (ratio 1: one update per batch), active with the change"


def test_the_title_names_an_algorithm_and_a_function_not_their_reprs() -> None:
    def my_loss(inputs: LossInputs) -> torch.Tensor:
        return -inputs.logp

    row = {"loss": 0.5, "clip_active": 1.0}
    mine = rlnb.Algorithm(loss=my_loss)
    shown = WhatIf(3, {"algorithm": mine, "loss": my_loss, "lr": 1e-3}, row, row, row)
    name = f"{__name__}.test_the_title_names_an_algorithm_and_a_function_not_their_reprs.<locals>.my_loss"
    title = f"what if algorithm=custom (loss='{name}'), loss={name}, lr=0.001, on the batch of step 3"
    assert repr(shown).splitlines()[0] == title + ":"
    assert f"<b>{html.escape(title.split(', on')[0])}</b>" in shown._repr_html_()
    assert repr(WhatIf(3, {"algorithm": "dapo"}, row, row, row)).startswith("what if algorithm='dapo', on")
