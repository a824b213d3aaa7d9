"""``tiny_llama``: a small random Llama and its character tokenizer, built offline into
a model directory (what the tests, benchmarks and ``rlnb make-tiny-llama`` use)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlnb._errors import ConfigError
from rlnb._files import write_model_dir
from rlnb.models._hf_load import quiet_transformers

__all__ = ["tiny_llama"]


def tiny_llama(
    path: str | os.PathLike[str],
    *,
    alphabet: str = "0123456789+=",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 64,
    seed: int = 0,
) -> Path:
    """Build a small random Llama and its character tokenizer into ``path``, offline.

    One token per character of ``alphabet``, then ``<bos>``, ``<eos>``, ``<pad>``
    and ``<unk>``; the tokenizer puts ``<bos>`` before each text. The defaults are
    the 332K-parameter model of ``benchmarks/trl_baseline.py`` (head size 32: vLLM's
    CPU attention needs 32 or more). ``path`` is written as ``Session.save_pretrained``
    writes (new, empty or a model rlnb saved; anything else is refused with a
    :class:`~rlnb.CheckpointError`). Returns ``path``, absolute."""
    transformers = quiet_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate([*alphabet, "<bos>", "<eos>", "<pad>", "<unk>"])}
    if len(vocab) != len(alphabet) + 4:
        raise ConfigError(f"tiny_llama(alphabet={alphabet!r}) is invalid: list each character once")
    bos, eos, pad = vocab["<bos>"], vocab["<eos>"], vocab["<pad>"]
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)

    def fill(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    return write_model_dir(path, fill, call="tiny_llama", argument="path")
