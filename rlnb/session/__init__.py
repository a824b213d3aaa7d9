"""``rlnb.Session``: the composition root that owns every part of a training run,
and the cell-sized API on it.

``_session`` is the root (its close stack and ``on_close`` callbacks); the rollout
and training cells are mixed into it from ``_rollout_cells`` and ``_training_cells``;
``_assembly`` turns config fields into the parts; ``_statistics`` is what
``statistics()`` returns; ``_stall`` says where a step that runs too long waits.
"""

from rlnb.session._diagnose import Finding, Findings
from rlnb.session._session import Session
from rlnb.session._stall import Stall
from rlnb.session._statistics import SessionStatistics

__all__ = ["Finding", "Findings", "Session", "SessionStatistics", "Stall"]
