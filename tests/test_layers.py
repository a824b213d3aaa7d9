"""The package keeps the shape docs/architecture.md draws: imports point down the
layers, private modules stay inside their package, and no import cycle exists, lazy
imports inside functions and type-only imports included. A module may be as long as
its one concept."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Collection
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlnb"

# Lower numbers are lower layers; a module may import its own layer and those below.
LAYERS = {
    "rlnb._errors": 0,
    "rlnb._sigint": 0,
    "rlnb._checks": 0,
    "rlnb._samples": 0,
    "rlnb._reprs": 0,
    "rlnb.__version__": 0,
    "rlnb.runtime": 1,
    "rlnb._files": 1,  # holds Ctrl-C back with rlnb.runtime.defer_interrupts
    "rlnb.probe": 1,
    "rlnb.testing": 1,
    "rlnb.rewards": 2,
    "rlnb.data": 2,
    "rlnb.envs": 2,
    "rlnb.algorithms": 2,
    "rlnb.config": 3,
    "rlnb.models": 4,
    "rlnb.buffer": 4,
    "rlnb.track": 4,
    "rlnb.engines": 5,
    "rlnb.rollout": 6,
    "rlnb.learn": 7,
    "rlnb.checkpoint": 8,
    "rlnb.serve": 8,  # the endpoint: HTTP in front of the rollouts
    "rlnb.session": 9,
    "rlnb.notebook": 10,
    "rlnb.cli": 11,
    "rlnb.bench": 11,
    "rlnb.__main__": 11,
    "rlnb": 11,  # the public face: what the command line and benchmarks use
}
# The shared base: top-level private modules that any package may import. Every other
# private module, top-level ones included, is imported only inside its own package.
BASE = {"rlnb._errors", "rlnb._sigint", "rlnb._checks", "rlnb._samples", "rlnb._reprs", "rlnb._files"}

# When an import runs: as its module loads, when the function holding it is called,
# or never (under ``if TYPE_CHECKING:``, for the type checker only).
AT_IMPORT, LAZY, TYPE_ONLY = "at import", "lazy", "type-only"

# The imports that point up, (importer, imported) by their LAYERS entries, each allowed
# lazily or type-only, never at import. Session.dashboard() and Session.explore() return
# the notebook layer's widgets, which need ipywidgets: the session loads that layer
# when a view is asked for (and names its classes as return types), so `import rlnb`
# and a script or a test that never shows a widget do not load it.
UPWARD = {("rlnb.session", "rlnb.notebook")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def owner(module: str) -> str:
    """The LAYERS entry ``module`` belongs to: rlnb.data for rlnb.data._tasks."""
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return module


def layer(module: str) -> int:
    return LAYERS[owner(module)]


def imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, module, when) of every rlnb import, sorted by line: ``when`` is AT_IMPORT,
    LAZY (inside a function) or TYPE_ONLY (under ``if TYPE_CHECKING:``). Each is a
    dependency: a type-only one is for the type checker, but a reader and mypy
    follow it as they follow the others."""
    found = []
    stack: list[tuple[ast.AST, str]] = [(tree, AT_IMPORT)]
    while stack:
        node, when = stack.pop()
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlnb"):
            # ``from rlnb import checkpoint`` imports rlnb.checkpoint; ``from rlnb.data import
            # Task`` is taken as rlnb.data.Task, whose layer is rlnb.data's
            found += [(node.lineno, f"{node.module}.{a.name}", when) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, when) for a in node.names if a.name.startswith("rlnb")]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += [(child, TYPE_ONLY) for child in node.body] + [(child, when) for child in node.orelse]
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and when == AT_IMPORT:
            when = LAZY
        stack += [(child, when) for child in ast.iter_child_nodes(node)]
    return sorted(found)


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {module_name(path) for path in MODULES}


def imported_module(target: str, names: Collection[str] = NAMES) -> str:
    """The module an import loads: ``rlnb.data.Task`` is rlnb.data; ``rlnb.checkpoint``
    (from ``from rlnb import checkpoint``) is itself."""
    return target if target in names else target.rsplit(".", 1)[0]


def is_private(target: str, source: str) -> bool:
    """Whether ``target`` is a private module that ``source`` may not import: one
    whose package is not ``source``'s own (or one above it), or a top-level private
    module outside the shared base."""
    parts = target.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
    if not private:
        return False
    owner = ".".join(parts[: private[0]])
    if owner == "rlnb":
        return ".".join(parts[:2]) not in BASE
    return not (source == owner or source.startswith(owner + "."))


def wrong_imports(source: str, tree: ast.Module, *, package: bool = False) -> list[str]:
    """What is wrong with the rlnb imports of module ``source`` (``package``: it is a
    package's ``__init__``): one pointing up the layers, outside UPWARD or at import,
    or one of another package's private module."""
    own_package = source if package else source.rsplit(".", 1)[0]
    wrong = []
    for line, target, when in imports(tree):
        inside = own_package != "rlnb" and target.startswith(own_package + ".")  # a subpackage's own modules
        if layer(target) > layer(source) and not inside:
            declared = (owner(source), owner(target)) in UPWARD
            if not declared:
                wrong.append(f"line {line}: {target} is above {source} ({when})")
            elif when == AT_IMPORT:
                wrong.append(f"line {line}: {target} is above {source}: import it inside the function that needs it")
        if is_private(target, source):
            wrong.append(f"line {line}: {target} is private to another package ({when})")
    return wrong


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down_and_private_modules_stay_inside_their_package(path: Path) -> None:
    wrong = wrong_imports(module_name(path), ast.parse(path.read_text()), package=path.name == "__init__.py")
    assert not wrong, "\n".join(wrong)


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the rlnb modules it imports, lazily and type-only too."""
    graph: dict[str, set[str]] = {}
    for source, tree in trees.items():
        # ``rlnb.__version__`` is a constant the package sets before it imports anything.
        found = [t for _, t, _ in imports(tree) if t != "rlnb.__version__"]
        graph[source] = {imported_module(t, trees) for t in found} - {source}
    return graph


def test_no_import_cycles() -> None:
    """No module imports itself back through others, lazy imports inside functions
    and type-only ones included: a cycle means two modules are one concept, or one
    needs a third (a Protocol of what it uses, say)."""
    graph = import_graph({module_name(path): ast.parse(path.read_text()) for path in MODULES})
    cycles = [scc for scc in _strongly_connected(graph) if len(scc) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively (the import graph is small, but recursion
    depth is not what this test is about)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


# What the Rollouter may know of an engine: the protocol, not a backend.
PROTOCOL = {
    "Engine",
    "EngineStatistics",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "PromptTooLong",
    "SamplingParams",
}


@pytest.mark.parametrize("path", sorted((PACKAGE / "rollout").glob("*.py")), ids=lambda p: p.name)
def test_the_rollouter_imports_the_engine_protocol_and_no_backend(path: Path) -> None:
    wrong = [
        f"line {line}: {target}"
        for line, target, _ in imports(ast.parse(path.read_text()))
        if target.startswith("rlnb.engines.") and target.removeprefix("rlnb.engines.") not in PROTOCOL
    ]
    assert not wrong, "rlnb.rollout imports a backend:\n" + "\n".join(wrong)


def test_the_cycle_check_finds_a_lazy_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in _strongly_connected(graph) if len(c) > 1] == [{"a", "b", "c"}]


def test_the_private_rule_covers_top_level_modules() -> None:
    assert is_private("rlnb.session._assembly", "rlnb.notebook._dashboard")
    assert not is_private("rlnb.session._assembly", "rlnb.session")
    assert not is_private("rlnb.session._assembly", "rlnb.session._cells")
    assert is_private("rlnb._somewhere", "rlnb.notebook._dashboard")
    assert not is_private("rlnb._errors", "rlnb.notebook._dashboard")


def _tree(code: str) -> ast.Module:
    return ast.parse(textwrap.dedent(code))


def test_imports_are_told_apart_by_when_they_run() -> None:
    tree = _tree(
        """
        from typing import TYPE_CHECKING
        from rlnb.config import Config
        if TYPE_CHECKING:
            from rlnb.learn import Trainer
        else:
            import rlnb.data
        def f():
            from rlnb.notebook import Dashboard
            if TYPE_CHECKING:
                from rlnb.engines import Engine
        """
    )
    assert imports(tree) == [
        (3, "rlnb.config.Config", AT_IMPORT),
        (5, "rlnb.learn.Trainer", TYPE_ONLY),
        (7, "rlnb.data", AT_IMPORT),
        (9, "rlnb.notebook.Dashboard", LAZY),
        (11, "rlnb.engines.Engine", TYPE_ONLY),
    ]


def test_the_session_may_import_the_notebook_layer_only_when_asked() -> None:
    lazy = """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from rlnb.notebook import Dashboard
        def dashboard(self) -> Dashboard:
            from rlnb.notebook import dashboard
            return dashboard(self)
        """
    assert wrong_imports("rlnb.session._session", _tree(lazy)) == []
    at_import = wrong_imports("rlnb.session._session", _tree("from rlnb.notebook import dashboard"))
    assert at_import == [
        "line 1: rlnb.notebook.dashboard is above rlnb.session._session: import it inside the function that needs it"
    ]
    # no other layer may reach up, even lazily or for a type
    assert wrong_imports("rlnb.learn._trainer", _tree(lazy)) == [
        "line 4: rlnb.notebook.Dashboard is above rlnb.learn._trainer (type-only)",
        "line 6: rlnb.notebook.dashboard is above rlnb.learn._trainer (lazy)",
    ]


def test_a_type_only_import_of_another_package_s_private_module_is_wrong() -> None:
    code = """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from rlnb.session._statistics import SessionStatistics
        """
    assert wrong_imports("rlnb.notebook._panels", _tree(code)) == [
        "line 4: rlnb.session._statistics.SessionStatistics is private to another package (type-only)"
    ]


def test_the_cycle_check_finds_a_type_only_cycle() -> None:
    trees = {
        "rlnb.x._a": _tree("from rlnb.x._b import helper"),
        "rlnb.x._b": _tree(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from rlnb.x._a import Thing
            """
        ),
        "rlnb.x._c": _tree("from rlnb.x._a import Thing"),
    }
    graph = import_graph(trees)
    assert graph == {"rlnb.x._a": {"rlnb.x._b"}, "rlnb.x._b": {"rlnb.x._a"}, "rlnb.x._c": {"rlnb.x._a"}}
    assert [c for c in _strongly_connected(graph) if len(c) > 1] == [{"rlnb.x._a", "rlnb.x._b"}]


def test_import_rlnb_loads_neither_the_notebook_layer_nor_ipywidgets() -> None:
    """The notebook layer loads when a view is asked for; its names on ``rlnb``
    (``rlnb.compare``, the ``%load_ext rlnb`` hooks) load it at their first use."""
    code = (
        "import sys, rlnb; "
        "print(sorted(m for m in ('rlnb.notebook', 'ipywidgets', 'IPython') if m in sys.modules)); "
        "print(callable(rlnb.load_ipython_extension), 'rlnb.notebook' in sys.modules, 'ipywidgets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True True False"]
