"""``CharTokenizer``: one id per character, plus PAD, BOS and EOS."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from rlnb._errors import ConfigError, InvalidValueError
from rlnb._samples import messages_text

__all__ = ["CharTokenizer"]


class CharTokenizer:
    """Maps each character of ``alphabet`` to one token id.

    Ids 0, 1 and 2 are PAD, BOS and EOS; the characters get ids 3, 4, ... in the
    order they appear in ``alphabet``. ``vocab_size`` is ``3 + len(alphabet)``.

    Raises :class:`~rlnb.ConfigError` if ``alphabet`` is not a non-empty string of
    distinct characters.
    """

    PAD: ClassVar[int] = 0
    BOS: ClassVar[int] = 1
    EOS: ClassVar[int] = 2
    _N_SPECIAL: ClassVar[int] = 3

    def __init__(self, alphabet: str) -> None:
        if not isinstance(alphabet, str) or not alphabet:
            raise ConfigError(
                f"CharTokenizer.alphabet={alphabet!r} is invalid: use a non-empty string of characters, "
                'e.g. alphabet="0123456789+="'
            )
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if duplicates:
            raise ConfigError(
                f"CharTokenizer.alphabet={alphabet!r} is invalid: it repeats {''.join(duplicates)!r}; "
                "list each character once"
            )
        self._alphabet = alphabet
        self._ids = {c: i + self._N_SPECIAL for i, c in enumerate(alphabet)}

    @property
    def alphabet(self) -> str:
        """The characters, in id order (the first has id 3)."""
        return self._alphabet

    @property
    def vocab_size(self) -> int:
        """Number of ids: the three specials plus one per character."""
        return self._N_SPECIAL + len(self._alphabet)

    def encode(self, text: str | Sequence[Mapping[str, str]], *, bos: bool = False, eos: bool = False) -> list[int]:
        """The ids of ``text``'s characters, optionally framed by BOS and EOS. Chat
        messages are their contents, one per line (this tokenizer has no template).

        Raises ``ValueError`` naming the first character not in the alphabet.
        """
        if not isinstance(text, str):
            text = messages_text(text)
        ids = self._ids
        try:
            body = [ids[c] for c in text]
        except KeyError as e:
            raise InvalidValueError(
                f"CharTokenizer cannot encode {e.args[0]!r} (in {text!r}): it is not in the alphabet {self._alphabet!r}"
            ) from None
        if bos:
            body.insert(0, self.BOS)
        if eos:
            body.append(self.EOS)
        return body

    def encode_observation(self, observation: str | Sequence[Mapping[str, Any]]) -> list[int]:
        """An environment's observation in a conversation: its text's ids (chat
        messages: their contents, one per line), without BOS or EOS. Raises
        ``ValueError`` naming a character not in the alphabet."""
        return self.encode(observation)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: PAD and BOS are skipped, and decoding stops at the first EOS.

        Accepts any iterable of ints (a list, or a 1-D integer tensor). Raises
        ``ValueError`` for an id outside ``range(vocab_size)``.
        """
        alphabet = self._alphabet
        out: list[str] = []
        tolist = getattr(ids, "tolist", None)
        if callable(tolist):  # a tensor or array: one conversion instead of one per element
            ids = tolist()
        for raw in ids:
            i = operator.index(raw)  # refuses floats rather than truncating them
            if i == self.EOS:
                break
            if i == self.PAD or i == self.BOS:
                continue
            j = i - self._N_SPECIAL
            if not 0 <= j < len(alphabet):
                raise InvalidValueError(f"CharTokenizer cannot decode id {i}: ids run from 0 to {self.vocab_size - 1}")
            out.append(alphabet[j])
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; :meth:`from_dict` rebuilds the tokenizer from it."""
        return {"type": "CharTokenizer", "alphabet": self._alphabet}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        """The tokenizer :meth:`to_dict` described.

        Raises :class:`~rlnb.ConfigError` if ``d`` is not such a description.
        """
        if not isinstance(d, dict) or "alphabet" not in d or d.get("type", "CharTokenizer") != "CharTokenizer":
            raise ConfigError(
                f"CharTokenizer.from_dict got {d!r}: pass what CharTokenizer.to_dict() returned, "
                'e.g. {"type": "CharTokenizer", "alphabet": "0123456789"}'
            )
        return cls(d["alphabet"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CharTokenizer):
            return NotImplemented
        return self._alphabet == other._alphabet

    def __hash__(self) -> int:
        return hash(("CharTokenizer", self._alphabet))

    def __repr__(self) -> str:
        return f"CharTokenizer({self._alphabet!r})"
