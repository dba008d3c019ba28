"""Token authentication (Ray 2.60 turns it on for every new cluster): attach with the token this
machine has, as `ray start` on a head does, although Ray turns token mode on for an explicit address
only when RAY_AUTH_MODE=token is set; and say in one line, at once, when there is no token or the
wrong one (Ray itself retries for 20 s, printing a line a second)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from ..core.errors import ClusterError

log = logging.getLogger("megaray")

AUTH_HINT = (
    "uses token authentication and no token was found here: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, "
    "or write ~/.ray/auth_token) to the cluster's token, which `ray get-auth-token` prints on the head"
)


def _refused(address: str, token: str | None = None, timeout_s: float = 5.0) -> bool | None:
    """Whether the GCS at `address` refuses a call that carries `token` (or none), asked with one
    gRPC call instead of Ray's 20 s of retries and log lines; None where it could not be asked."""
    import grpc  # a Ray dependency

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with grpc.insecure_channel(address) as channel:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=timeout_s, metadata=metadata
            )
        return False
    except grpc.RpcError as e:
        return True if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    except Exception:  # an address grpc cannot parse: ray.init will say why
        return None


def _token() -> tuple[str, str] | None:
    """The token Ray would send from this process and where it comes from, in Ray's own order."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN", os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        return path, open(path).read().strip()
    except OSError:
        return None


@contextlib.contextmanager
def token_mode(address: str) -> Iterator[None]:
    """Attach to a token-authenticated cluster with the token this machine has, as `ray start` on
    its head does, although Ray 2.60 turns token mode on for an explicit address only when
    RAY_AUTH_MODE=token is set; fail in one line when there is no token to send."""
    if _refused(address) is not True:
        yield
        return
    found = _token()
    if found is None:
        raise ClusterError(f"the Ray cluster at {address} {AUTH_HINT}")
    source, token = found
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise ClusterError(
            f"the Ray cluster at {address} uses token authentication and RAY_AUTH_MODE={mode} here: unset "
            f"it or set RAY_AUTH_MODE=token (the token in {source} is sent then)"
        )
    if _refused(address, token):
        raise ClusterError(
            f"the Ray cluster at {address} uses token authentication and rejected the token sent (from "
            f"{source}): set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, which "
            "`ray get-auth-token` prints on the head"
        )
    if os.environ.get("RAY_AUTH_MODE") == "token":
        yield
        return
    from ray._raylet import Config

    log.info("the cluster at %s uses token authentication: sending the token from %s", address, source)
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray read the mode when imported: as `ray start` does, have it read again
    try:
        yield
    finally:
        os.environ.pop("RAY_AUTH_MODE", None)
        Config.initialize("")
