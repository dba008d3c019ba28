"""The error file torch elastic's `@record` writes (`TORCHELASTIC_ERROR_FILE`), read as torchrun reads
it: a failed rank's message and traceback as the program recorded them, preferred to what the
launcher saw of the exception (torchrun's `ProcessFailure` does the same)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RecordedError:
    """What `ErrorHandler.record_exception` wrote: `{"message": {"message", "extraInfo": {...}}}`,
    or a plain string message (written by hand, as torch's docs allow)."""

    message: str
    traceback: str = ""
    timestamp: int | None = None


def parse_error_file(text: str) -> RecordedError | None:
    """The recorded error, or None where the text is not one (empty, cut short, another shape)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or "message" not in data:
        return None
    message = data["message"]
    if isinstance(message, str):
        return RecordedError(message.strip())
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    stamp = str(extra.get("timestamp", ""))
    return RecordedError(
        str(message.get("message", "")).strip(),
        str(extra.get("py_callstack", "")),
        int(stamp) if stamp.isdigit() else None,
    )
