"""The notebook layer, above the session: display and widgets. Nothing here holds a
strong reference to a session, and nothing below imports it.

``sess.dashboard()`` asks for the view this package registers at import;
``rlnb.compare(...)`` draws several runs' curves on shared axes; ipywidgets,
IPython and matplotlib load only when a dashboard or a comparison is shown.
``%load_ext rlnb`` finds its hooks here (``rlnb`` re-exports them).
"""

from rlnb._samples import RolloutBatch
from rlnb.notebook._compare import Comparison, compare
from rlnb.notebook._dashboard import Dashboard, dashboard
from rlnb.notebook._magics import load_ipython_extension, unload_ipython_extension
from rlnb.runtime import register_view as _register_view

_register_view("dashboard", dashboard)

__all__ = [
    "Comparison",
    "Dashboard",
    "RolloutBatch",
    "compare",
    "dashboard",
    "load_ipython_extension",
    "unload_ipython_extension",
]
