"""The notebook layer, above the session: display and widgets. Nothing here holds a
strong reference to a session, and nothing below imports it.

``sess.dashboard()`` and ``sess.explore()`` ask for the views this package
registers at import; ``rlnb.compare(...)`` draws several runs' curves on shared
axes; ipywidgets, IPython and matplotlib load only when a dashboard, an explorer or
a comparison is shown.
``%load_ext rlnb`` finds its hooks here (``rlnb`` re-exports them).
"""

from rlnb._samples import RolloutBatch
from rlnb.notebook._compare import Comparison, compare
from rlnb.notebook._dashboard import Dashboard, dashboard
from rlnb.notebook._explorer import Explorer
from rlnb.notebook._magics import load_ipython_extension, unload_ipython_extension
from rlnb.runtime import register_view as _register_view

_register_view("dashboard", dashboard)
_register_view("explorer", Explorer)

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
