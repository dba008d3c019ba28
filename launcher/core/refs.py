"""`pkg.module:function` references: entrypoints, recipe functions and warm-up steps are all named this
way, and resolved here."""

from __future__ import annotations

import importlib
import re
from typing import Any

FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z")


def split_ref(ref: str) -> tuple[str, str]:
    """`pkg.module:function` into its module and function names ("" when there is no function)."""
    module, _, func = ref.partition(":")
    return module, func


def load_function(ref: str) -> Any:
    """Import `pkg.module` and return its `function`; ImportError or AttributeError when missing."""
    module, func = split_ref(ref)
    return getattr(importlib.import_module(module), func)
