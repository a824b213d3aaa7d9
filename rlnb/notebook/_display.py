"""How rollouts look in a notebook: a table of prompts, completions, rewards and versions."""

from __future__ import annotations

import html

from rlnb._samples import Group, Sample

__all__ = ["RolloutBatch"]


def _versions(sample: Sample) -> str:
    if not sample.versions:
        return "-"
    lo, hi = min(sample.versions), max(sample.versions)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _marks(sample: Sample) -> str:
    marks = []
    if sample.resumed:
        marks.append(f"resumed x{sample.resumed}")
    if sample.finish_reason != "stop":
        marks.append(sample.finish_reason)
    return ", ".join(marks)


class RolloutBatch(list[Group]):
    """Groups returned by ``Session.rollout()``: a list that renders as a table."""

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(prompt, completion, reward, versions, marks) per sample."""
        out = []
        for group in self:
            for s in group.samples:
                reward = "-" if s.reward is None else f"{s.reward:.2f}"
                out.append((group.prompt, s.completion, reward, _versions(s), _marks(s)))
        return out

    def __repr__(self) -> str:
        header = ("prompt", "completion", "reward", "versions", "marks")
        rows = [header, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return f"RolloutBatch({len(self)} groups)\n" + "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("prompt", "completion", "reward", "versions", "marks"))
        body = []
        for group in self:
            for i, s in enumerate(group.samples):
                prompt = f'<td rowspan="{len(group)}"><code>{html.escape(group.prompt)}</code></td>' if i == 0 else ""
                reward = "-" if s.reward is None else f"{s.reward:.2f}"
                body.append(
                    f"<tr>{prompt}<td><code>{html.escape(s.completion)}</code></td><td>{reward}</td>"
                    f"<td>{_versions(s)}</td><td>{html.escape(_marks(s))}</td></tr>"
                )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
