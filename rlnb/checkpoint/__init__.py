"""Checkpoints: a directory of safetensors files and one JSON file; nothing is pickled.

Layout of ``sess.save(path)``::

    path/checkpoint.json           format, config, step, prompt-loader state, buffer
                                   (groups with their tokens and log-probs), prompts
                                   given back by an interrupted rollout, Python RNG
                                   state, tracker run id, vocabulary (what each token
                                   id means), data (what it trained on: for a task
                                   made from records, their count and SHA-256, the
                                   fields read and the split), live settings changed
                                   (``Session.set``; the config holds the values in
                                   force), SHA-256 of every file below
    path/model.safetensors         the policy (with LoRA, only its adapter: the model's
                                   own weights are read from ModelConfig.path)
    path/optimizer.safetensors     AdamW's moments (its hyper-parameters are in the JSON)
    path/warmup_optimizer.safetensors, path/reference.safetensors   when they exist
    path/rng.safetensors           torch's CPU generator state

Loading checks the format, every checksum and every entry against the saved config
before building anything: a damaged or mismatched checkpoint gets a :class:`CheckpointError`
naming the file and what is wrong, not an error from deep inside torch after a half-built load.

:func:`capture` says what of a session goes into a checkpoint and :func:`restore`
how it is applied to a freshly built one; :func:`write` and :func:`read` put it on
disk and take it back. The package is cut the same way: ``_format`` (the files),
``_validate`` (the checks before loading), ``_state`` (capture, save, read, restore).
A config goes to and from JSON with :func:`rlnb.config.config_to_dict` and
:func:`rlnb.config.config_from_dict` (re-exported here).
"""

from rlnb.checkpoint._format import FORMAT, FORMAT_VERSION, saved_config, write
from rlnb.checkpoint._state import capture, read, restore, save
from rlnb.checkpoint._validate import check
from rlnb.config import config_from_dict, config_to_dict

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "capture",
    "check",
    "config_from_dict",
    "config_to_dict",
    "read",
    "restore",
    "save",
    "saved_config",
    "write",
]
