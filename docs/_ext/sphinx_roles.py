"""A griffe extension that makes rlnb's Sphinx-style docstrings read well in MkDocs.

rlnb's docstrings are short prose with Sphinx roles (:class:`~rlnb.Session`,
:meth:`step`), ``double-backtick`` literals and "name: what it is" lines for a
config's fields. mkdocstrings renders Markdown, where a role would show as
":class:" beside the name. This rewrites each docstring before it is rendered:

- a role becomes a cross-reference that links where the target has a page and is
  plain code where it has none (an optional autoref: no warning, so a private name
  in a docstring never fails ``mkdocs build --strict``);
- a line of a class docstring that starts with one of the class's fields
  (``capacity: groups held ...``) becomes a list item, so the fields do not run
  together into one paragraph;
- a paragraph ending in ``::`` (reST's "a literal block follows") ends in ``:``.

Loaded by mkdocs.yml (mkdocstrings' python handler, ``extensions:``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|meth|func|attr|exc|data|mod|obj|const):`(~?)([^`<>]+?)`")
FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?=: )")
# A field line may name two fields ("r: the rank. alpha: its scale"), so only its start is marked.
CALLABLE_ROLES = frozenset({"meth", "func"})


def _scopes(obj: griffe.Object) -> list[griffe.Object]:
    """The objects a relative name in ``obj``'s docstring is looked up in, innermost first."""
    scopes: list[griffe.Object] = []
    current: griffe.Object | None = obj
    while current is not None:
        if current.is_class or current.is_module:
            scopes.append(current)
        current = current.parent
    return scopes


def _target(name: str, obj: griffe.Object) -> str:
    if name.startswith("rlnb"):
        return name
    first = name.split(".", 1)[0]
    for scope in _scopes(obj):
        if first in scope.members:
            return f"{scope.path}.{name}"
    return name


def _roles(text: str, obj: griffe.Object) -> str:
    def link(match: re.Match[str]) -> str:
        role, short, name = match.groups()
        title = name.rsplit(".", 1)[-1] if short else name
        if role in CALLABLE_ROLES:
            title += "()"
        target = html.escape(_target(name, obj), quote=True)
        return f'<autoref identifier="{target}" optional><code>{html.escape(title)}</code></autoref>'

    return ROLE.sub(link, text)


def _fields(text: str, obj: griffe.Object) -> str:
    if not obj.is_class:
        return text
    names = set(obj.members)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        match = FIELD.match(line)
        if match and match.group(1) in names:
            # A list needs a blank line before it when a paragraph precedes it.
            before = "\n" if i and lines[i - 1].strip() and not FIELD.match(lines[i - 1]) else ""
            lines[i] = f"{before}- `{match.group(1)}`{line[match.end() :]}"
    return "\n".join(lines)


def _literal_blocks(text: str) -> str:
    return re.sub(r"(\S)::\n\n", r"\1:\n\n", re.sub(r" ::\n\n", "\n\n", text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as the module's docstring says."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = obj.docstring.value
        text = _literal_blocks(_fields(_roles(text, obj), obj))
        obj.docstring.value = text
