"""The shape of the model a config makes for a task: its tokenizer and its
``ModelConfig`` with the vocabulary filled in, checked against the task's prompts.
A session builds from it, and a checkpoint is checked against it before loading."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from rlnb._errors import ConfigError

if TYPE_CHECKING:
    from rlnb.config import Config, ModelConfig
    from rlnb.data import Task
    from rlnb.models._hf_tokenizer import HFTokenizer
    from rlnb.models._tokenizer import CharTokenizer

    Tokenizer: TypeAlias = CharTokenizer | HFTokenizer


def model_shape(config: Config, task: Task) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer (the task's characters, or the Hugging Face model's own) and the
    model's config with its vocabulary filled in; a LoRA adapter's targets are checked
    against the model's modules (on the meta device: nothing is loaded).

    Imports torch but runs no torch work (the prompt loader forks after this)."""
    from rlnb.models._tokenizer import CharTokenizer

    tokenizer: Tokenizer
    if config.model.path is not None:
        from rlnb.models._hf_load import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(config.model.path, max_len=config.model.max_len)
        unknown = "".join(c for c in task.alphabet if tokenizer.decode(tokenizer.encode(c)) != c)
        if unknown:
            raise ConfigError(
                f"ModelConfig.path={config.model.path!r} is invalid for task {task.name!r}: its tokenizer cannot "
                f"write {unknown!r} (they do not come back from encode and decode); use a model whose tokenizer "
                f"knows every character of the task, e.g. one made by `rlnb make-tiny-llama DIR --task {task.name}`"
            )
        if config.model.lora is not None:  # peft there, and targets the model has: before anything is built
            from rlnb.models._hf_load import hf_model_on_meta

            hf_model_on_meta(config.model.path, lora=config.model.lora)
    else:
        tokenizer = CharTokenizer(task.alphabet)
    check_positions(config, task, tokenizer)
    model, needed = config.model, tokenizer.vocab_size
    if model.vocab_size is None:
        return tokenizer, model.replace(vocab_size=needed)
    if model.vocab_size < needed:
        raise ConfigError(
            f"ModelConfig.vocab_size={model.vocab_size} is invalid: task {task.name!r} needs {needed} "
            "token ids; use None (the task's) or a larger size"
        )
    return tokenizer, model


def check_positions(config: Config, task: Task, tokenizer: Tokenizer) -> None:
    """Raise ConfigError unless ``config``'s model has room for the longest of a sample
    of the task's prompts (as ``tokenizer`` writes it) and ``max_new_tokens`` more; a
    task made from records has every record's prompt measured (they are in memory)."""
    if task.records is not None:
        task.records.check_context(
            lambda prompt: len(tokenizer.encode(prompt, bos=True)),
            max_len=config.model.max_len,
            new_tokens=config.rollout.max_new_tokens or task.max_new_tokens,
            task=task.name,
        )
    positions = max(len(tokenizer.encode(task.item(config.seed, i).encodable, bos=True)) for i in range(16))
    positions += config.rollout.max_new_tokens or task.max_new_tokens
    if config.model.max_len < positions:
        raise ConfigError(
            f"ModelConfig.max_len={config.model.max_len} is invalid: task {task.name!r} needs {positions} positions "
            f"(a prompt and up to {config.rollout.max_new_tokens or task.max_new_tokens} new tokens); "
            f"use max_len >= {positions}, or a smaller RolloutConfig.max_new_tokens"
        )
