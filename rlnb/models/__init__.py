"""Small language models for the built-in engine: a character tokenizer and ``TinyPolicy``.

Plain torch only; this layer knows nothing of sessions, loops or notebooks.
"""

from rlnb.models._policy import KVCache, PolicyConfig, TinyPolicy
from rlnb.models._tokenizer import CharTokenizer

__all__ = ["CharTokenizer", "KVCache", "PolicyConfig", "TinyPolicy"]
