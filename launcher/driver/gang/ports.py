"""MASTER_PORT: probed free on the master node, then reserved cluster-wide in Ray's GCS.

A port found free is only free until someone binds it. Two launches on one cluster could probe the
same free port before either rendezvous binds it; an atomic put-if-absent in the GCS key-value
store makes the second one take the next candidate. Reservations are dropped at teardown; a driver
killed outright leaves one key behind, which only makes that one port skipped later.
"""

from __future__ import annotations

import contextlib

from ..cluster import rayprivate

KV_NAMESPACE = "megaray"


def _key(node_ip: str, port: int) -> str:
    return f"port/{node_ip}/{port}"


def reserve(node_ip: str, candidates: list[int], job: str) -> int | None:
    """The first candidate no other job has reserved on this node, now reserved for `job`."""
    for port in candidates:
        existed = rayprivate.kv_put(_key(node_ip, port), job, overwrite=False, namespace=KV_NAMESPACE)
        if not existed:
            return port
    return None


def release(node_ip: str, port: int) -> None:
    with contextlib.suppress(Exception):  # the cluster is gone: nothing to release
        rayprivate.kv_del(_key(node_ip, port), namespace=KV_NAMESPACE)
