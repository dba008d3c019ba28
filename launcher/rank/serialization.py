"""Ray's serializers for third-party types, left out of megaray's own processes.

Ray builds a process's serialization context at its first remote call (a worker's: as it takes its
first arguments), and registers its serializers for third-party types in it (Arrow tables for Ray
Data, pydantic's fields, starlette's state), importing those libraries to do so wherever they are
installed (Megatron-Bridge's stack installs them): 0.27-0.34 CPU-s a process, and 0.4-0.5 s of a
2-core machine's wall inside the driver's first placement call, on the way to every rank's start.
megaray's command-line process and its nodes' forwarders send Ray none of those types: there they
are registered only where one of the libraries is imported already. A rank's process is the user
program's, and a Python process that launches (a notebook that also uses Ray Data) is the user's:
both keep Ray's way. Ray has no option for it (`ray.util.serialization_addons` is its developer
API); should an upgrade move it, the context is built as before.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ADDON_LIBRARIES = ("pyarrow", "pydantic", "starlette")  # what ray.util.serialization_addons serves


def serializers_only_where_imported() -> None:
    """From now on in this process, before its serialization context is built."""
    try:
        from ray.util import serialization_addons
    except ImportError:  # pragma: no cover - a Ray without it
        return
    own = getattr(serialization_addons, "apply", None)
    if own is None or getattr(own, "only_where_imported", False):
        return

    def apply(context: Any) -> None:
        if any(name in sys.modules for name in ADDON_LIBRARIES):
            own(context)

    apply.only_where_imported = True  # type: ignore[attr-defined]
    serialization_addons.apply = apply


def in_a_ray_worker() -> bool:
    """Whether this process is a worker Ray started (a node's forwarder, once it imports its class
    there), not a driver that imports the same module."""
    return os.path.basename(sys.argv[0] if sys.argv else "") == "default_worker.py"
