"""Language models for the learner and the built-in engine: a character tokenizer and
``TinyPolicy``, and ``HFPolicy`` for a Hugging Face causal LM (``tiny_llama`` builds a
small one offline).

Plain torch (and transformers, imported when a model is loaded); this layer knows
nothing of sessions, loops or notebooks. A ``TinyPolicy``'s shape is a :class:`rlnb.ModelConfig`.
"""

import typing as _typing

from rlnb.models._hf_load import check_device, hf_model_on_meta, load_hf_model, load_hf_tokenizer, read_model_config
from rlnb.models._hf_policy import HFPolicy
from rlnb.models._hf_tokenizer import HFTokenizer
from rlnb.models._kvcache import KVCache
from rlnb.models._policy import TinyPolicy
from rlnb.models._shape import check_positions, model_shape
from rlnb.models._tiny_llama import tiny_llama
from rlnb.models._tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "HFPolicy",
    "HFTokenizer",
    "KVCache",
    "TinyPolicy",
    "check_device",
    "check_positions",
    "hf_model_on_meta",
    "load_hf_model",
    "load_hf_tokenizer",
    "model_shape",
    "read_model_config",
    "tiny_llama",
]

if not _typing.TYPE_CHECKING:  # hidden from mypy, so that it still reports a removed name as missing

    def __getattr__(name: str) -> object:
        # Python calls this only for names the module lacks: a removed name says what replaced it.
        if name == "PolicyConfig":
            from rlnb._errors import ConfigError

            raise ConfigError(
                "rlnb.models.PolicyConfig was merged into rlnb.ModelConfig: build a policy with "
                "TinyPolicy(rlnb.ModelConfig(vocab_size=tokenizer.vocab_size, ...), seed=0) "
                "(the seed is TinyPolicy's own keyword argument now)"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
