"""Ray's serializers for third-party types, registered when their library is imported, not before.

Ray builds a process's serialization context at its first remote call (a worker's: as it takes its
first arguments), and registers in it its serializers for third-party types (Arrow tables for Ray
Data, pydantic's fields, starlette's state), importing those libraries to do so wherever they are
installed (Megatron-Bridge's stack installs them): 0.27-0.34 CPU-s in every process, before a rank's
program starts, and 0.4-0.5 s of a 2-core machine's wall inside the driver's first placement call.
Here the same registration (Ray's own `ray.util.serialization_addons.apply`, its developer API) runs
the moment the first of those libraries is imported in the process (wrapt's post-import hooks), and
at once where one is imported already. No object of those types can exist before its library is
imported, and a registered serializer is one cloudpickle uses when sending (what it sends names its
own deserializer): what any process sends or receives is the same as under Ray's way. Should an
upgrade move `apply`, the context is built as Ray builds it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ADDON_LIBRARIES = ("pyarrow", "pydantic", "starlette")  # what ray.util.serialization_addons serves


def serializers_when_imported() -> None:
    """From now on in this process, for a serialization context built after this call."""
    try:
        from ray.util import serialization_addons
        from wrapt import register_post_import_hook
    except ImportError:  # pragma: no cover - a Ray without it, or no wrapt: Ray's way
        return
    own = getattr(serialization_addons, "apply", None)
    if own is None or getattr(own, "when_imported", False):
        return

    def apply(context: Any) -> None:
        registered: list[bool] = []

        def register(_module: Any) -> None:
            if registered:  # once, for whichever library comes first: Ray's apply takes all
                return
            registered.append(True)
            try:
                own(context)
            except Exception as e:  # inside the program's own import: said, never raised there
                print(f"megaray: Ray's serializers for {', '.join(ADDON_LIBRARIES)} types were not "
                      f"registered: {type(e).__name__}: {e}", file=sys.stderr, flush=True)  # fmt: skip

        for name in ADDON_LIBRARIES:
            register_post_import_hook(register, name)

    apply.when_imported = True  # type: ignore[attr-defined]
    serialization_addons.apply = apply


def in_a_ray_worker() -> bool:
    """Whether this process is a worker Ray started (a rank's or a forwarder's, importing its actor's
    class before its first arguments), not a driver that imports the same module."""
    return os.path.basename(sys.argv[0] if sys.argv else "") == "default_worker.py"
