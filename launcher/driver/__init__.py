"""The driver: everything that sequences Ray calls, in folders by what a reader looks for.

- `lifecycle/`: a launch top-down. `launch.py` (preflight, connect, record; one `LaunchContext` of
  `context.py`), `controller.py` (the states: placing, starting, running, finishing, restarting,
  and how it ended, with the failure policy's decision on a rank failure), `attempt.py` (what each
  state does); `registry.py` maps each kind of target to its runner.
- `gang/`: the ranks of an attempt (`gang.py`), from one of `sources.py` (fresh placement groups
  of `placement.py`, the previous attempt's warm spares `spares.py`, a pool); `group.py` is the
  same gang for the single-controller pattern.
- `supervision/`: `supervise.py` looks at the running ranks, `rank_ends.py` tells how each ended,
  `liveness.py` probes the nodes, `stragglers.py` and `grow.py` decide while it runs.
- `output/`: the ranks' output relayed (`relay.py`) into the run directory and onto the console.
- `cluster/`: connecting to Ray or starting it (`cluster.py`), `megaray up` (`up.py`, `pool.py`), and
  Ray's private APIs in `rayprivate.py` only.

docs/architecture.md draws it."""
