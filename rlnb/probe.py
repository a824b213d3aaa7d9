"""What this process holds right now: ``rlnb.probe.snapshot()``.

A frozen :class:`Snapshot` of open FDs, live threads, live child processes (zombies
count as dead), open rlnb event loops and open tracker runs. Gauges and the leak
checker read these snapshots.
"""

from rlnb.runtime import ChildInfo, Snapshot, open_runs, snapshot

__all__ = ["ChildInfo", "Snapshot", "open_runs", "snapshot"]
