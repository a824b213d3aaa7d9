"""``HFTokenizer``: a transformers tokenizer as rlnb's parts use one (prompts through
the chat template, an environment's observations between turns, the PAD and EOS ids)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlnb._errors import ConfigError, InvalidValueError
from rlnb._files import as_path, check_not_in_use
from rlnb._samples import messages_text

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """A transformers tokenizer as rlnb's parts use one: ``encode(prompt)`` (through
    the chat template when the tokenizer has one), ``decode(ids)``, and the PAD and
    EOS ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no eos_token: rlnb needs one to end completions; "
                "set eos_token in its tokenizer_config.json"
            )
        self.EOS: int = eos
        self.PAD: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.vocab_size: int = len(tokenizer)

    def encode(
        self,
        text: str | Sequence[Mapping[str, str]],
        *,
        bos: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """A prompt's ids (``bos``: through the chat template if there is one, else with
        the tokenizer's special tokens), or a target's (``bos=False``: the text's own).
        A prompt may be chat messages ({"role", "content"}): the chat template gets them
        as they are; without one, their contents are the text, one per line. ``tools``:
        the JSON schemas of tools the chat template describes to the model."""
        if not isinstance(text, str) and not (bos and self.chat):
            text = messages_text(text)
        if not bos:
            assert isinstance(text, str)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.chat:
            messages = [{"role": "user", "content": text}] if isinstance(text, str) else [dict(m) for m in text]
            extra = {"tools": [dict(t) for t in tools]} if tools else {}
            return self._template(messages, add_generation_prompt=True, **extra)
        return list(self.tokenizer(text, add_special_tokens=bos)["input_ids"])

    def _template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode_observation(self, observation: str | Sequence[Mapping[str, Any]]) -> list[int]:
        """An environment's observation in a conversation, after a policy turn. With a
        chat template, the tokens the template puts between an assistant turn and the
        next one: the observation's messages (text is a user message; a tool's result
        has role "tool") and the assistant's generation prompt, cut out of a rendering
        of a stand-in conversation. Without one, the text's own ids."""
        if not self.chat:
            text = observation if isinstance(observation, str) else messages_text(observation)
            return self.encode(text)
        messages = (
            [{"role": "user", "content": observation}]
            if isinstance(observation, str)
            else [dict(m) for m in observation]
        )
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        before = self._template(base)
        after = self._template(base + messages, add_generation_prompt=True)
        if after[: len(before)] != before:  # a template that renders earlier turns differently later
            raise InvalidValueError(
                "the chat template renders a conversation's earlier turns differently once it goes on"
            )
        return after[len(before) :]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """The tokenizer's files into ``directory`` (beside what is there, as Hugging
        Face writes them), never into what a live session reads, such as its base
        model (:class:`~rlnb.CheckpointError`, before anything is written)."""
        target = Path(os.path.abspath(as_path(directory, call="HFTokenizer.save_pretrained", argument="directory")))
        check_not_in_use(target, "the tokenizer")
        self.tokenizer.save_pretrained(target)
