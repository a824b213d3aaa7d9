from __future__ import annotations

import json

import pytest
import torch

from rlnb import ConfigError
from rlnb.models import CharTokenizer

ALPHABET = "0123456789+= "


def test_ids_follow_the_specials_in_alphabet_order() -> None:
    tok = CharTokenizer(ALPHABET)
    assert (tok.PAD, tok.BOS, tok.EOS) == (0, 1, 2)
    assert tok.alphabet == ALPHABET
    assert tok.vocab_size == 3 + len(ALPHABET)
    assert tok.encode("01+") == [3, 4, 13]
    assert tok.encode("9", bos=True, eos=True) == [tok.BOS, 12, tok.EOS]


def test_round_trip() -> None:
    tok = CharTokenizer(ALPHABET)
    for text in ["", "12+34=", "99+99= 198", ALPHABET]:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


def test_decode_skips_pad_and_bos_and_stops_at_eos() -> None:
    tok = CharTokenizer(ALPHABET)
    ids = [tok.BOS, *tok.encode("12"), tok.PAD, *tok.encode("3"), tok.EOS, *tok.encode("45"), tok.EOS]
    assert tok.decode(ids) == "123"
    assert tok.decode(torch.tensor(ids)) == "123"  # a tensor decodes like a list
    assert tok.decode([tok.EOS, *tok.encode("7")]) == ""


def test_decode_refuses_ids_outside_the_vocabulary() -> None:
    tok = CharTokenizer("ab")
    with pytest.raises(ValueError, match="id 5"):
        tok.decode([3, 5])
    with pytest.raises(ValueError, match="id -1"):
        tok.decode([-1])


def test_unknown_character_error_names_it_and_the_alphabet() -> None:
    tok = CharTokenizer("0123456789")
    with pytest.raises(ValueError, match=r"'x'.*'0123456789'"):
        tok.encode("12x3")


@pytest.mark.parametrize(("alphabet", "match"), [("", "non-empty"), ("abca", "repeats 'a'"), (None, "non-empty")])
def test_bad_alphabets_raise_config_error(alphabet: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CharTokenizer(alphabet)  # type: ignore[arg-type]


def test_to_dict_round_trips_through_json() -> None:
    tok = CharTokenizer(ALPHABET + "é")
    back = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert back == tok
    assert hash(back) == hash(tok)
    assert back.encode("1é") == tok.encode("1é")
    assert tok != CharTokenizer("0123")


def test_from_dict_refuses_other_dicts() -> None:
    with pytest.raises(ConfigError, match="to_dict"):
        CharTokenizer.from_dict({"letters": "abc"})
