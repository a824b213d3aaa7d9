"""The notebook layer, above the session: display and widgets. Nothing here holds a
strong reference to a session, and nothing below imports it."""

from rlnb._samples import RolloutBatch

__all__ = ["RolloutBatch"]
