"""Where Ray's token authentication finds this machine's token, in Ray's own order: RAY_AUTH_TOKEN,
then the file RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token. One place for the driver's attach
(driver/cluster/auth.py), the job client's bearer header (cli/jobspec.py) and `megaray up`, which makes a
token where none exists yet, as Ray's documentation says to for local development."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FoundToken:
    source: str  # "RAY_AUTH_TOKEN" or the file's path, for messages
    token: str


def token_path(environ: Mapping[str, str], home: Path) -> Path:
    """The file Ray reads the token from when RAY_AUTH_TOKEN is not set."""
    return Path(environ.get("RAY_AUTH_TOKEN_PATH") or home / ".ray" / "auth_token")


def find_token(environ: Mapping[str, str], home: Path) -> FoundToken | None:
    """The token Ray would send from a process with `environ`; None where there is none (an empty
    file counts as none, as Ray counts it)."""
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return FoundToken("RAY_AUTH_TOKEN", environ["RAY_AUTH_TOKEN"].strip())
    path = token_path(environ, home)
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return FoundToken(str(path), token) if token else None


def auth_disabled(environ: Mapping[str, str]) -> bool:
    """RAY_AUTH_MODE=disabled: the user turned token authentication off for what this process starts
    and sends."""
    return environ.get("RAY_AUTH_MODE", "").strip().lower() == "disabled"
