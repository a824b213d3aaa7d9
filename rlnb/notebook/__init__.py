"""The notebook layer, above the session: display and widgets. Nothing here holds a
strong reference to a session, and nothing here imports it: the widgets know a
session by what they use of it (a Protocol), since the session imports this layer.

``sess.dashboard()`` and ``sess.explore()`` import this package when first called
(``import rlnb`` does not) and return its :func:`dashboard` and :class:`Explorer`;
``rlnb.compare(...)`` draws several runs' curves on shared axes; ipywidgets, IPython
and matplotlib load only when a dashboard, an explorer or a comparison is shown.
``%load_ext rlnb`` finds its hooks here (``rlnb`` forwards them at their first use).
"""

from rlnb._samples import RolloutBatch
from rlnb.notebook._compare import Comparison, compare
from rlnb.notebook._dashboard import Dashboard, dashboard
from rlnb.notebook._explorer import Explorer
from rlnb.notebook._magics import load_ipython_extension, unload_ipython_extension

__all__ = [
    "Comparison",
    "Dashboard",
    "Explorer",
    "RolloutBatch",
    "compare",
    "dashboard",
    "load_ipython_extension",
    "unload_ipython_extension",
]
