"""The driver: everything that sequences Ray calls. `launch.py` reads top-down (preflight, connect,
attempts, record); an attempt is a rank gang (`gang.py`) with its output relay (`relay.py`) and the
next attempt's warm spares (`spares.py`), watched by `supervise.py`; `group.py` is the same gang for
the single-controller pattern."""
