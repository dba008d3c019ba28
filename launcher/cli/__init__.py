"""The command lines: `megaray` (a launch), `megaray submit|status|logs|stop|list` (Ray jobs) and
`megaray doctor`; each parses, calls the driver, and maps the outcome to an exit code and one line."""

from .main import entry, main

__all__ = ["entry", "main"]
