"""What a session reports about itself: :class:`SessionStatistics` (``statistics()``),
:class:`Findings` of :class:`Finding` (``diagnose()``) and the :class:`Stall` in a
snapshot.

The same classes as ``rlnb.session`` exports, from modules that never import the
session itself: the notebook layer types its widgets by them, and the session
imports that layer (lazily), so importing these through ``rlnb.session`` would close
a circle.
"""

from rlnb.session._diagnose import Finding, Findings
from rlnb.session._stall import Stall
from rlnb.session._statistics import SessionStatistics

__all__ = ["Finding", "Findings", "SessionStatistics", "Stall"]
