"""The driver: everything that sequences Ray calls. `launch.py` reads top-down (preflight, connect,
attempts, record); an attempt is a rank gang (`gang.py`) with its output relay (`relay.py`) and the
next attempt's warm spares (`spares.py`), watched by `supervise.py`; `group.py` is the same gang for
the single-controller pattern."""

_ends_with_command = False


def end_with_command() -> None:
    """Said by the command's entry point (cli/main.py `entry`), which ends the process the moment the
    command returns: a connection to a cluster megaray did not start is then not shut down first."""
    global _ends_with_command
    _ends_with_command = True


def ends_with_command() -> bool:
    return _ends_with_command
