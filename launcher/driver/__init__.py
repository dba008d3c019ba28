"""The driver: everything that sequences Ray calls. A launch reads top-down: `launch.py` (preflight,
connect, record; one `LaunchContext` of `context.py`), `controller.py` (the states: placing,
starting, running, finishing, restarting, and how it ended, with the failure policy's decision on a
rank failure), `attempt.py` (what each state does: a rank gang of `gang.py` from one of
`sources.py`, its output relay `relay.py`, the next attempt's warm spares `spares.py`, looked at by
`supervise.py`, whose ranks' ends `rank_ends.py` tells). docs/architecture.md draws it.
`registry.py` maps each kind of target to its runner; `group.py` is the same gang for the
single-controller pattern."""
