"""The dashboard's settings panel: an input per live setting
(:data:`rlnb.config.LIVE_FIELDS`), an Apply button and the last outcome, in a
collapsed section; and the text that says what a change did.

The panel holds widgets and the values it last showed, never a session: the
dashboard reads ``edited()`` on a click, calls ``Session.set`` and hands back the
outcome. A field counts as edited while its input differs from the value last
shown there; ``refresh`` (the ticker's, after a change made in code) rewrites only
fields that are not, so it never overwrites what someone is typing.
"""

from __future__ import annotations

import html
import math
import re
import threading
from collections.abc import Collection, Sequence
from typing import Any

from rlnb import _reprs
from rlnb._errors import ConfigError
from rlnb.config import LIVE_FIELDS, Change, Config, algorithm_label, live_value

__all__ = ["KINDS", "SettingsPanel", "changes_text", "parse", "settings_text", "shown_value"]

# How each live setting is typed in: "float" and "int" in a number input; "optional"
# (a whole number, empty for None), "weights" (numbers separated by commas, empty
# for None) and "name" (an algorithm preset's name) in a text input. The placeholder
# says what empty means.
KINDS: dict[str, str] = {
    "lr": "float",
    "lr_decay_steps": "optional",
    "algorithm": "name",
    "clip_low": "float",
    "clip_high": "float",
    "entropy_coef": "float",
    "kl_coef": "float",
    "clip_eps": "float",
    "is_cap": "float",
    "max_grad_norm": "float",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "max_new_tokens": "optional",
    "max_policy_lag": "optional",
    "groups_per_step": "int",
    "group_size": "int",
    "reward_weights": "weights",
}
# What an empty input means: its placeholder (short, to fit) and its tooltip.
_EMPTY = {
    "lr_decay_steps": ("None: constant", "empty: None, a constant lr"),
    "algorithm": ("a preset's name", "a preset: grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, ppo, ..."),
    "max_new_tokens": ("None: task's", "empty: None, the task's own limit"),
    "max_policy_lag": ("None: no bound", "empty: None, no bound on how far rollouts run ahead"),
    "reward_weights": ("None: task's", "one number per reward function, e.g. 1, 0.5; empty: None, the task's own"),
}
_PARTS = {
    "learn": "learner: from the next update",
    "rollout": "rollouts: for groups dispatched from now on",
}
_ERROR = "color:#b00020;line-height:1.4"
_OK = "line-height:1.4"


def _number(value: float) -> str:
    """A float as short as it reads back the same ("0.0001", "1", "0.123456789")."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def shown_value(field: str, value: Any) -> Any:
    """``value`` of live setting ``field`` as its input holds it: a float, an int, or
    text (empty for None, weights as "1, 0.5")."""
    kind = KINDS[field]
    if kind == "float":
        return float(value)
    if kind == "int":
        return int(value)
    if value is None:
        return ""
    if kind == "name":
        return algorithm_label(value)
    if kind == "weights":
        return ", ".join(_number(float(w)) for w in value)
    return str(value)


def parse(field: str, value: Any) -> Any:
    """What an input holds as the value ``Session.set`` takes. Raises
    :class:`~rlnb.ConfigError` naming the field for text that is not one."""
    kind = KINDS[field]
    if kind in ("float", "int"):
        return value
    text = str(value).strip()
    if kind == "name":  # a preset's name: LearnConfig says what a wrong one is
        return text
    if text == "" or text.lower() == "none":
        return None
    if kind == "optional":
        if re.fullmatch(r"[+-]?\d+", text.replace("_", "")):
            return int(text)
        raise ConfigError(f"{field}={text!r} is not a whole number: type one, e.g. 20, or leave it empty for None")
    words = [w for w in re.split(r"[,\s]+", text.strip("()[] ")) if w]
    try:
        weights = tuple(float(w) for w in words)
    except ValueError:
        raise ConfigError(
            f"reward_weights={text!r} is not a list of numbers: type one number per reward function, separated "
            "by commas, e.g. 1, 0.5, or leave it empty for the task's own weights"
        ) from None
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward_weights={text!r}: every weight must be a finite number")
    return weights


def changes_text(changes: Sequence[Change]) -> str:
    """What :meth:`Session.set` changed, in a line: "set at step 11: lr 0.0001 → 0.001
    (from the next update), temperature 1 → 0.7 (for groups dispatched from now on)"."""
    if not changes:
        return "nothing changed: the values given are those in force"
    parts = []
    for change in changes:
        when = "from the next update" if LIVE_FIELDS[change.field] == "learn" else "for groups dispatched from now on"
        parts.append(f"{change.field} {_reprs.setting(change.old)} → {_reprs.setting(change.new)} ({when})")
    return f"set at step {changes[0].step}: " + ", ".join(parts)


def settings_text(config: Config) -> str:
    """The live settings in force, in a line: "lr 0.0001 · kl_coef 0 · …"."""
    values = (live_value(config, field) for field in LIVE_FIELDS)
    return " · ".join(f"{field} {_reprs.setting(value)}" for field, value in zip(LIVE_FIELDS, values, strict=True))


def _in_force(config: Config, field: str) -> Any:
    return live_value(config, field)


class SettingsPanel:
    """The settings section's widgets: ``inputs`` (by field), ``button`` (Apply),
    ``message`` (the last outcome) and ``widget`` (the collapsed ``Accordion``
    holding them). Thread-safe: the ticker refreshes it while a click reads it."""

    def __init__(self, config: Config) -> None:
        import ipywidgets as w

        self._lock = threading.Lock()
        self.config = config
        self.inputs: dict[str, Any] = {}
        self._shown: dict[str, Any] = {}
        style = {"description_width": "8.6em"}
        rows = []
        for part, caption in _PARTS.items():
            boxes = []
            for field in (f for f, p in LIVE_FIELDS.items() if p == part):
                value = shown_value(field, live_value(config, field))
                kind = KINDS[field]
                owner = f"{type(getattr(config, part)).__name__}.{field}"
                options: dict[str, Any] = {
                    "value": value,
                    "description": field,
                    "tooltip": f"{owner}; {_EMPTY[field][1]}" if field in _EMPTY else owner,
                    "style": style,
                    "layout": w.Layout(width="18.5em"),
                    "continuous_update": True,  # so the kernel knows what is being typed
                }
                if kind == "float":
                    box = w.FloatText(**options)
                elif kind == "int":
                    box = w.IntText(**options)
                else:
                    box = w.Text(placeholder=_EMPTY[field][0], **options)
                box.add_class(f"rlnb-setting-{field}")
                self.inputs[field] = box
                self._shown[field] = value
                boxes.append(box)
            label = w.HTML(f'<span style="color:#666">{html.escape(caption)}</span>')
            rows += [label, w.HBox(boxes, layout=w.Layout(flex_flow="row wrap"))]
        self.button = w.Button(
            description="apply",
            icon="check",
            tooltip="sess.set(**the fields edited here)",
            layout=w.Layout(width="auto"),
        )
        self.button.add_class("rlnb-settings-apply")
        self.message = w.HTML(layout=w.Layout(margin="0 0 0 1em"))
        self.message.add_class("rlnb-settings-message")
        footer = w.HBox([self.button, self.message], layout=w.Layout(align_items="center"))
        body = w.VBox([*rows, footer])
        self.widget = w.Accordion(children=[body], titles=("settings",), selected_index=None)
        self.widget.add_class("rlnb-settings")
        self.widgets: list[Any] = [*self.inputs.values(), *rows, self.button, self.message, footer, body, self.widget]

    def edited(self) -> dict[str, Any]:
        """The fields whose input differs from the value last shown there, as
        ``Session.set`` takes them. Raises :class:`~rlnb.ConfigError` for text that
        is not a value of its field, once that input shows the value in force again
        (left as typed, it would fail every later Apply)."""
        with self._lock:
            typed = {f: box.value for f, box in self.inputs.items() if box.value != self._shown[f]}
        values, refused = {}, {}
        for field, value in typed.items():
            try:
                values[field] = parse(field, value)
            except ConfigError as exc:
                refused[field] = str(exc)
        if refused:
            raise ConfigError("; ".join(m.rstrip(".") for m in refused.values()) + self.reset(refused))
        return values

    def refused(self, values: dict[str, Any]) -> list[str]:
        """The fields of ``values`` that the config in force refuses alone (all of them
        where none does: it refuses them together)."""
        alone = []
        for field, value in values.items():
            try:
                self.config.with_live(**{field: value})
            except ConfigError:
                alone.append(field)
        return alone or list(values)

    def reset(self, fields: Collection[str]) -> str:
        """Show the value in force in each of ``fields`` (refused: nothing changed); the
        sentence that says so, to end an error's message with."""
        self.refresh(self.config, force=fields)
        shown = ", ".join(f"{field} {_reprs.setting(_in_force(self.config, field))}" for field in fields)
        return f". Nothing was applied; back to the value in force: {shown}."

    def refresh(self, config: Config, *, force: Collection[str] = ()) -> None:
        """Show ``config``'s values in every input not being edited (and in the
        ``force`` fields whatever they hold: just applied). Cheap when nothing changed."""
        with self._lock:
            if config is self.config and not force:
                return
            self.config = config
            for field in LIVE_FIELDS:
                value = shown_value(field, live_value(config, field))
                box, shown = self.inputs[field], self._shown[field]
                if value == shown and field not in force:
                    continue
                if box.value == shown or field in force:
                    box.value = value
                self._shown[field] = value  # an input being edited stays edited against it

    def keep(self, config: Config) -> None:
        """Take ``config`` as the values in force without touching the inputs (the
        session closed: only the static copy shows them)."""
        with self._lock:
            self.config = config

    def say(self, text: str, *, error: bool = False) -> None:
        """Show ``text`` under the inputs, in red when it is an error."""
        text = text if len(text) <= 600 else text[:599] + "…"
        kind, style = ("error", _ERROR) if error else ("ok", _OK)
        self.message.value = f'<div class="rlnb-{kind}" style="{style}">{html.escape(text)}</div>'

    def set_disabled(self, *, button: bool, inputs: bool) -> None:
        self.button.disabled = button
        for box in self.inputs.values():
            box.disabled = inputs

    def route(self) -> None:
        """Send a harmless update of every input and the button from this thread, so
        that ipykernel routes the page's next messages to them (typed values, the
        click) where this thread's updates are sent as caused by: one place, in order."""
        for widget in (*self.inputs.values(), self.button):
            widget.send_state("disabled")

    def static_html(self) -> str:
        """The settings in force, and the last change applied here, as plain HTML (an
        error said here is left out: it changed nothing)."""
        text = html.escape(settings_text(self.config))
        last = self.message.value if 'class="rlnb-ok"' in self.message.value else ""
        return f'<div class="rlnb-settings" style="{_OK};color:#444;max-width:60em"><b>settings</b>: {text}{last}</div>'
