"""Methods that vLLM mixes into its worker process, reached with ``collective_rpc``.

vLLM imports this module in its worker (``worker_extension_cls``), so it imports
nothing from rlnb and nothing heavy at module level.

Weights travel as safetensors bytes: tensors inside an RPC's arguments do not
arrive as tensors, bytes do. They are loaded through the model runner's
``reload_weights``, which maps Hugging Face names onto vLLM's fused layers and
repacks them as the platform wants (a CPU build repacks its linear layers, so
``model.load_weights`` alone leaves the old weights in use).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RlnbWorkerExtension"]


class RlnbWorkerExtension:
    """Mixed into vLLM's ``Worker``; ``self.model_runner`` is the worker's."""

    model_runner: Any

    def rlnb_load_weights(self, data: bytes) -> int:
        """Load a Hugging Face state dict saved with ``safetensors.torch.save``;
        returns how many tensors it held."""
        from safetensors.torch import load

        state = load(data)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        return len(state)

    def rlnb_pid(self) -> int:
        """This worker's pid (the guard learns whom to kill from it)."""
        import os

        return os.getpid()
