"""Token authentication (Ray 2.60 turns it on for every new cluster): attach with the token this
machine has, as `ray start` on a head does, although Ray turns token mode on for an explicit address
only when RAY_AUTH_MODE=token is set; and say in one line, at once, when there is no token or the
wrong one (Ray itself retries for 20 s, printing a line a second)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ...core.errors import ClusterError
from ...core.raytoken import find_token
from . import rayprivate
from .reach import GcsAnswer, ask_gcs

log = logging.getLogger("megaray")

AUTH_HINT = (
    "uses token authentication and no token was found here: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, "
    "or write ~/.ray/auth_token) to the cluster's token, which `ray get-auth-token` prints on the head"
)


@contextlib.contextmanager
def token_mode(address: str, first: GcsAnswer | None = None, announce: bool = True) -> Iterator[None]:
    """Attach to a token-authenticated cluster with the token this machine has, as `ray start` on
    its head does, although Ray 2.60 turns token mode on for an explicit address only when
    RAY_AUTH_MODE=token is set; fail in one line when there is no token to send. `first`: the GCS's
    answer to a call without a token, where the caller asked already (driver/cluster/reach.py). `announce`:
    say which token is sent (not for the local Ray of `megaray up`, whose token it made or found)."""
    if (first or ask_gcs(address)) is not GcsAnswer.UNAUTHENTICATED:
        yield
        return
    found = find_token(os.environ, Path.home())
    if found is None:
        raise ClusterError(f"the Ray cluster at {address} {AUTH_HINT}")
    source, token = found.source, found.token
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise ClusterError(
            f"the Ray cluster at {address} uses token authentication and RAY_AUTH_MODE={mode} here: unset "
            f"it or set RAY_AUTH_MODE=token (the token in {source} is sent then)"
        )
    if ask_gcs(address, token) is GcsAnswer.UNAUTHENTICATED:
        raise ClusterError(
            f"the Ray cluster at {address} uses token authentication and rejected the token sent (from "
            f"{source}): set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, which "
            "`ray get-auth-token` prints on the head"
        )
    if os.environ.get("RAY_AUTH_MODE") == "token":
        yield
        return
    if announce:
        log.info("the cluster at %s uses token authentication: sending the token from %s", address, source)
    os.environ["RAY_AUTH_MODE"] = "token"
    rayprivate.reload_config()  # Ray read the mode when imported: as `ray start` does, have it read again
    try:
        yield
    finally:
        os.environ.pop("RAY_AUTH_MODE", None)
        rayprivate.reload_config()
