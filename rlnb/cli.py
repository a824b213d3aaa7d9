"""The ``rlnb`` command: ``rlnb demo`` and ``rlnb bench NAME``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

BENCHES = ("bridge", "close", "rollout")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlnb", description="Notebook-first RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the built-in demo on CPU")
    demo.add_argument("--json", action="store_true", help="end with one JSON line of results")

    bench = sub.add_parser("bench", help="run a benchmark against a floor measured in the same run")
    bench.add_argument("name", choices=BENCHES, help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    bench.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    return parser


def _demo(as_json: bool) -> int:
    """Until training lands: rollouts from the built-in (untrained) policy through the
    background rollouter, a pause and a resume, and what the process holds before,
    during and after the session."""
    import rlnb
    from rlnb.probe import snapshot
    from rlnb.runtime._bridge import warm_up_loop_backend

    start = time.perf_counter()
    warm_up_loop_backend()
    before = snapshot()
    with rlnb.Session(rlnb.Config(task="addition"), name="demo") as sess:
        print(f"rlnb demo: task {sess.task.name!r}, built-in tiny policy (untrained), CPU")
        print(repr(sess.rollout(2)))
        sess.start_rollouts()
        sess.buffer.get(4, timeout=60)  # background generation reached the buffer
        sess.pause("abort")
        paused = sess.statistics()
        sess.resume()
        sess.stop_rollouts()
        during = snapshot()
        stats = sess.statistics()
    after = snapshot()
    r = stats.rollout
    result = {
        "task": sess.task.name,
        "groups_finished": r.groups_finished,
        "samples_dispatched": r.dispatched,
        "samples_accounted": r.finished + r.kept_partial + r.failed + r.in_flight,
        "kept_partial_at_pause": paused.rollout.kept_partial,
        "engine_running_at_pause": paused.engine.running,
        "generated_tokens": stats.engine.generated_tokens,
        "threads": [before.num_threads, during.num_threads, after.num_threads],
        "fds": [before.num_fds, during.num_fds, after.num_fds],
        "left_behind": after.new_since(before),
        "seconds": round(time.perf_counter() - start, 3),
    }
    print(
        f"background rollouts: {result['groups_finished']} groups, {result['generated_tokens']} tokens; "
        f"pause kept {result['kept_partial_at_pause']} partial samples with the engine quiescent "
        f"({result['engine_running_at_pause']} running); dispatched {result['samples_dispatched']} = "
        f"accounted {result['samples_accounted']}"
    )
    print(f"threads before/during/after: {result['threads']}, FDs: {result['fds']}")
    print(f"left behind after close: {result['left_behind'] or 'nothing'}")
    if as_json:
        print(json.dumps(result, sort_keys=True))
    return 1 if result["left_behind"] or result["samples_dispatched"] != result["samples_accounted"] else 0


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
