"""Is there a Ray GCS at this address? Asked in seconds, before `ray.init`.

Ray's driver retries an address that is not a working GCS for minutes (a port that accepts and says
nothing: 30 s per attempt, again and again, naming the machine's other address instead of the one
given). So the address is asked three things, each bounded: does it accept a TCP connection; does it
answer an HTTP/2 connection preface as a gRPC server does (a SETTINGS frame, at once); does its GCS
answer a call (`GetClusterId`, the first call Ray's own client makes), with or without a token.
Whatever still goes wrong inside `ray.init` after that is bounded by driver/cluster/cluster.py's deadline.
"""

from __future__ import annotations

import enum
import os
import socket
import ssl

from ...core.errors import ClusterError

PROBE_TIMEOUT_S = 5.0

_FIX = (
    "give the head's GCS port (6379 unless `ray start --head --port` chose another) in --address or "
    "RAY_ADDRESS"
)


class GcsAnswer(enum.Enum):
    """What the GCS said to one `GetClusterId` call."""

    OK = "ok"  # a GCS, and the call (with the token sent, if any) was accepted
    UNAUTHENTICATED = "unauthenticated"  # a GCS with token authentication, which refused the token sent
    UNIMPLEMENTED = "unimplemented"  # a gRPC server without Ray's GCS service
    NO_ANSWER = "no answer"  # nothing in time, or the connection failed
    UNASKED = "unasked"  # the address could not be asked (a form grpc does not take, or TLS)


def _uses_tls() -> bool:
    """RAY_USE_TLS as Ray reads it: the GCS speaks TLS with the cluster's certificates."""
    return os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")


def ask_gcs(address: str, token: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> GcsAnswer:
    """One gRPC call to the GCS at `address` carrying `token` (or none), instead of Ray's minutes of
    retries and log lines."""
    if _uses_tls():
        return GcsAnswer.UNASKED  # the GCS speaks TLS with the cluster's certificates: Ray's to ask
    import grpc  # a Ray dependency

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with grpc.insecure_channel(address) as channel:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=timeout_s, metadata=metadata
            )
        return GcsAnswer.OK
    except grpc.RpcError as e:
        return {
            grpc.StatusCode.UNAUTHENTICATED: GcsAnswer.UNAUTHENTICATED,
            grpc.StatusCode.UNIMPLEMENTED: GcsAnswer.UNIMPLEMENTED,
        }.get(e.code(), GcsAnswer.NO_ANSWER)
    except Exception:  # an address grpc cannot parse
        return GcsAnswer.UNASKED


def check_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> GcsAnswer:
    """Raise ClusterError (one line, the cause and the fix) unless a Ray GCS answers at `address`,
    within about `timeout_s` for each of the three questions; return its answer to a call without a
    token (UNAUTHENTICATED: it uses token authentication)."""
    if address.lower().startswith(("http://", "https://")):
        raise ClusterError(
            f"{address} is a dashboard's URL, which `megaray submit` takes; a launch attaches to the "
            "cluster's GCS: give --address HEAD:6379 (`ray start --head` prints it), or use `megaray submit "
            "--address` with this URL"
        )
    if address in ("auto", "local") or "://" in address:  # ray:// (Ray Client): Ray's own to check
        return GcsAnswer.UNASKED
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} is not HOST:PORT; fix --address or RAY_ADDRESS")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
            answer = _http2_answer(s, timeout_s)
    except OSError as e:
        raise ClusterError(
            f"cannot reach a Ray cluster at {address} ({e.strerror or e}); start one with "
            "`ray start --head` or fix --address / RAY_ADDRESS"
        ) from None
    tls = _uses_tls()
    if answer is None and not tls:
        raise ClusterError(
            f"{address} accepts connections but says nothing within {timeout_s:.0f} s, so it is not a "
            f"working Ray GCS (another service, or a GCS that is stopped or overloaded): {_FIX}"
        )
    if answer is not None and answer[3:4] != b"\x04" and not tls:
        if answer.startswith((b"HTTP/", b"<")):
            what = "an HTTP server (Ray's dashboard listens on 8265)"
        elif not answer and _speaks_tls(host.strip("[]"), int(port), timeout_s):
            what = "a TLS server (a Ray cluster with TLS needs RAY_USE_TLS=1 and its certificates here)"
        elif not answer:
            what = "a server that closes the connection"
        else:
            what = "no gRPC server"
        raise ClusterError(f"{address} answers, but as {what}, not as Ray's GCS: {_FIX}")
    gcs = ask_gcs(address, timeout_s=timeout_s)
    if gcs is GcsAnswer.UNIMPLEMENTED:
        raise ClusterError(f"{address} answers, but as a gRPC server without Ray's GCS service: {_FIX}")
    if gcs is GcsAnswer.NO_ANSWER:
        raise ClusterError(
            f"{address} answers as a gRPC server, but its Ray GCS did not answer a call within "
            f"{timeout_s:.0f} s (a GCS that is stopped or overloaded, or another service): {_FIX}"
        )
    return gcs


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether the port completes a TLS handshake (any certificate: only the protocol is asked)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s, ctx.wrap_socket(s):
            return True
    except (OSError, ssl.SSLError):
        return False


def _http2_answer(s: socket.socket, timeout_s: float) -> bytes | None:
    """What a port says to an HTTP/2 connection preface: Ray's GCS (gRPC) answers with a SETTINGS
    frame (type 4 in the frame's fourth byte) at once. None when it says nothing in time; b"" when it
    closes the connection."""
    s.settimeout(timeout_s)
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        return s.recv(64) or b""
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""
