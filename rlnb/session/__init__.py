"""``rlnb.Session``: the composition root that owns every part of a training run,
and the cell-sized API on it.

``_session`` is the root (its close stack, ``on_close`` callbacks and every public
call, each a short delegation); ``_training`` and ``_rollouts`` are the parts users
drive by name (``sess.training``, ``sess.rollouts``); ``_live``, ``_fork``,
``_batches``, ``_diagnose`` and ``_export`` hold the longer bodies as functions of
the parts they use; ``_assembly`` turns config fields into the parts; ``_statistics``
is what ``statistics()`` returns; ``_stall`` says where a step that runs too long waits.
"""

from rlnb.session._diagnose import Finding, Findings
from rlnb.session._rollouts import Rollouts
from rlnb.session._session import Session
from rlnb.session._stall import Stall
from rlnb.session._statistics import SessionStatistics
from rlnb.session._training import Training

__all__ = ["Finding", "Findings", "Rollouts", "Session", "SessionStatistics", "Stall", "Training"]
