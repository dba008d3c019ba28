"""The files a Megatron config names for its data, checked before any GPU is taken.

A `dataset.blend` prefix without its `.bin`/`.idx` pair, or a tokenizer file that is not there,
fails on every rank after the model is built, minutes in; the driver reads the same paths the ranks
will (clusters share a filesystem, or have the same paths on every node).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def blend_prefixes(blend: Any) -> list[str]:
    """The path prefixes of a Megatron blend: `(["a", "b"], [0.3, 0.7])` (a list when it came from a
    YAML or command-line override), `["0.3", "a", "0.7", "b"]`, or a list of prefixes."""
    if not blend:
        return []
    if isinstance(blend, (tuple, list)) and len(blend) == 2 and isinstance(blend[0], (list, tuple)):
        return [str(p) for p in blend[0]]
    items = [str(x) for x in blend]
    return [x for x in items if not _is_number(x)]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def is_local_path(text: str | None) -> bool:
    """A path on this machine, as opposed to an HF id such as org/model (which also has a slash)."""
    return bool(text) and text.startswith(("/", "./", "../", "~"))


def missing_data(
    prefixes: Iterable[str], dataset_root: str | None = None, files: Iterable[tuple[str, str]] = ()
) -> list[str]:
    """What is not there: a prefix without `.bin` or `.idx`, the SFT dataset folder, tokenizer files
    (`files`: (setting, path) pairs, checked where they look like paths rather than HF model ids)."""
    out = []
    for p in prefixes:
        lacking = [ext for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
        if lacking:
            out.append(f"dataset.blend prefix {p} has no {' or '.join(p + e for e in lacking)}")
    if dataset_root and not os.path.isdir(dataset_root):
        out.append(f"dataset.dataset_root {dataset_root} is not a folder")
    for setting, path in files:
        if is_local_path(path) and not os.path.exists(os.path.expanduser(path)):
            out.append(f"{setting} {path} does not exist")
    return out
