"""The versions every node must share with the driver, in the form they are compared and shown."""

from __future__ import annotations

import sys


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def megaray_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megaray")
    except PackageNotFoundError:
        return "unknown"
