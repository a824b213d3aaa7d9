"""The package keeps the shape docs/architecture.md draws: imports point down the
layers, private modules stay inside their package, and no import cycle exists,
lazy imports inside functions included. A module may be as long as its one concept."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlnb"

# Lower numbers are lower layers; a module may import its own layer and those below.
LAYERS = {
    "rlnb._errors": 0,
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
    "rlnb.config": 3,
    "rlnb.models": 4,
    "rlnb.buffer": 4,
    "rlnb.track": 4,
    "rlnb.engines": 5,
    "rlnb.rollout": 6,
    "rlnb.learn": 7,
    "rlnb.checkpoint": 8,
    "rlnb.session": 9,
    "rlnb.notebook": 10,
    "rlnb.cli": 11,
    "rlnb.bench": 11,
    "rlnb.__main__": 11,
    "rlnb": 11,  # the public face: what the command line and benchmarks use
}
# The shared base: top-level private modules that any package may import. Every other
# private module, top-level ones included, is imported only inside its own package.
BASE = {"rlnb._errors", "rlnb._checks", "rlnb._samples", "rlnb._reprs", "rlnb._files"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return LAYERS[module]


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every rlnb import that runs, lazy ones included; imports
    under ``if TYPE_CHECKING:`` are for the type checker only and are skipped."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlnb"):
            # ``from rlnb import checkpoint`` imports rlnb.checkpoint; ``from rlnb.data import
            # Task`` is taken as rlnb.data.Task, whose layer is rlnb.data's
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("rlnb")]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {module_name(path) for path in MODULES}


def imported_module(target: str) -> str:
    """The module an import loads: ``rlnb.data.Task`` is rlnb.data; ``rlnb.checkpoint``
    (from ``from rlnb import checkpoint``) is itself."""
    return target if target in NAMES else target.rsplit(".", 1)[0]


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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down_and_private_modules_stay_inside_their_package(path: Path) -> None:
    source = module_name(path)
    own_package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
    wrong = []
    for line, target in runtime_imports(ast.parse(path.read_text())):
        inside = own_package != "rlnb" and target.startswith(own_package + ".")  # a subpackage's own modules
        if layer(target) > layer(source) and not inside:
            wrong.append(f"line {line}: {target} is above {source}")
        if is_private(target, source):
            wrong.append(f"line {line}: {target} is private to another package")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    """No module imports itself back through others, lazy imports inside functions
    included: a cycle means two modules are one concept, or one needs a third."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        source = module_name(path)
        # ``rlnb.__version__`` is a constant the package sets before it imports anything.
        found = [t for _, t in runtime_imports(ast.parse(path.read_text())) if t != "rlnb.__version__"]
        graph[source] = {imported_module(t) for t in found} - {source}
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
        for line, target in runtime_imports(ast.parse(path.read_text()))
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
