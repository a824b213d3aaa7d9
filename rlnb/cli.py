"""The ``rlnb`` command: ``rlnb demo`` and ``rlnb bench NAME``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

BENCHES = ("bridge", "close", "rollout")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlnb", description="Notebook-first RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the built-in demo session on CPU")
    demo.add_argument("--json", action="store_true", help="end with one JSON line of results")

    bench = sub.add_parser("bench", help="run a benchmark against a floor measured in the same run")
    bench.add_argument("name", choices=BENCHES, help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    bench.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    return parser


def _demo(as_json: bool) -> int:
    """A session smoke: bridge, buffer and close, with what the process holds before and after."""
    import rlnb
    from rlnb.probe import snapshot
    from rlnb.runtime._bridge import warm_up_loop_backend

    start = time.perf_counter()
    warm_up_loop_backend()
    before = snapshot()
    with rlnb.Session(rlnb.Config(), name="demo") as sess:

        async def make_group(i: int) -> rlnb.Group:
            await asyncio.sleep(0)
            samples = [rlnb.Sample(prompt=f"{i}+{i}=", completion=str(2 * i), reward=1.0) for _ in range(4)]
            return rlnb.Group(prompt=f"{i}+{i}=", samples=tuple(samples), prompt_id=i)

        for i in range(8):
            sess.buffer.put(sess.bridge.run(make_group(i)))
        batch = sess.buffer.get(4, timeout=1.0)
        during = snapshot()
        stats = sess.statistics()
    after = snapshot()
    result = {
        "groups_put": stats.buffer.put,
        "groups_taken": stats.buffer.taken,
        "first_prompt": batch[0].prompt,
        "threads": [before.num_threads, during.num_threads, after.num_threads],
        "fds": [before.num_fds, during.num_fds, after.num_fds],
        "left_behind": after.new_since(before),
        "seconds": round(time.perf_counter() - start, 3),
    }
    print(f"rlnb demo: put {result['groups_put']} groups, took {result['groups_taken']} through the bridge and buffer")
    print(f"  threads before/during/after: {result['threads']}, FDs: {result['fds']}")
    print(f"  left behind after close: {result['left_behind'] or 'nothing'}")
    if as_json:
        print(json.dumps(result, sort_keys=True))
    return 1 if result["left_behind"] else 0


def _bench(name: str, as_json: bool, strict: bool) -> int:
    import importlib

    result = importlib.import_module(f"rlnb.bench._{name}").run()
    print(result.to_json() if as_json else result.report())
    return 1 if strict and not result.ok else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args.json)
    if args.command == "bench":
        return _bench(args.name, args.json, args.strict)
    raise AssertionError(args.command)  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
