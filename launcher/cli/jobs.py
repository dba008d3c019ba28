"""`megaray submit | status | logs | stop | list`: the same launch, run as a Ray job.

On a shared cluster the driver should not live on a laptop or a login node: the launch becomes the
entrypoint of a Ray job (`python -m launcher ...` on the head), submitted through the dashboard's job
API. The launch arguments are parsed here first, so bad input never creates a job; Ctrl-C stops the
job on the cluster instead of only detaching from its logs, as `ray job submit` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import time

from ..core.errors import ClusterError, UsageError
from .jobspec import (
    STOP_WAIT_S,
    SubmitSpec,
    auth_headers,
    build_parser,
    format_jobs,
    format_status,
    job_entrypoint,
    job_metadata,
    root_cause,
    submit_spec_from_args,
)

log = logging.getLogger("megaray")


def _client(address: str | None):
    from ray.dashboard.utils import get_address_for_submission_client
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    from ..driver.cluster.auth import token_mode

    if not address:
        _check_last_cluster()
    shown = address or get_address_for_submission_client(None)
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # "WebSocket closed"
    # Given a GCS address, Ray's client first asks the GCS for the dashboard's URL, in token mode only
    # where RAY_AUTH_MODE=token is set: attach as a launch does (the token this machine has).
    asks_gcs = token_mode(shown, announce=False) if "://" not in shown else contextlib.nullcontext()
    try:
        with asks_gcs:
            return JobSubmissionClient(address, headers=auth_headers(os.environ))
    except AuthenticationError as e:
        rejected = "invalid" in str(e).lower() or "forbidden" in str(e).lower()
        raise ClusterError(
            f"the Ray cluster at {shown} uses token authentication and "
            f"{'rejected the token sent' if rejected else 'no token was found here'}: set RAY_AUTH_TOKEN "
            "(or RAY_AUTH_TOKEN_PATH) to the cluster's token, which `ray get-auth-token` prints on the head"
        ) from None
    except (ConnectionError, ValueError) as e:
        raise ClusterError(
            f"cannot reach a Ray dashboard at {shown} ({str(e).splitlines()[0]}); pass --address "
            "http://HEAD:8265 or set RAY_API_SERVER_ADDRESS, and start the head with the dashboard"
        ) from None


def _check_last_cluster() -> None:
    """With no address, Ray's job client asks the cluster last started on this machine (the file
    `ray start` leaves in Ray's temp dir), and waits 30 s and more for one that has gone away."""
    from ..driver.cluster import rayprivate
    from ..driver.cluster.reach import check_reachable

    last = rayprivate.last_cluster_address()
    if not last:
        raise UsageError(
            "no cluster given: pass --address http://HEAD:8265 (the dashboard) or set RAY_ADDRESS"
        )
    try:
        check_reachable(last, timeout_s=3.0)
    except ClusterError:
        raise ClusterError(
            f"no --address or RAY_ADDRESS given, and the cluster last started on this machine ({last}, "
            "recorded by `ray start`) does not answer: pass --address http://HEAD:8265 or set RAY_ADDRESS"
        ) from None


def _job_info(client, job: str):
    try:
        return client.get_job_info(job)
    except RuntimeError as e:
        if "does not exist" in str(e) or "404" in str(e):
            raise UsageError(
                f"no job {job} on the cluster at {client.get_address()}; `megaray list` shows them"
            ) from None
        raise ClusterError(f"asking for job {job} failed: {str(e).splitlines()[0]}") from None


def _exit_code(info) -> int:
    status = info.status.value
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return 1
    code = getattr(info, "driver_exit_code", None)
    return code if isinstance(code, int) and code > 0 else 1


class _Signalled(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum, _frame):
    raise _Signalled(signum)


async def _stream(client, job: str, out) -> str:
    """Print the job's logs as they come; returns the last part of them (for the root cause)."""
    tail = ""
    async for chunk in client.tail_job_logs(job):
        out.write(chunk)
        out.flush()
        tail = (tail + chunk)[-20000:]
    return tail


def follow(client, job: str) -> int:
    """Stream until the job ends; Ctrl-C or SIGTERM stops the job on the cluster, not just the stream."""
    old = {s: signal.signal(s, _raise_signalled) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        tail = asyncio.run(_stream(client, job, sys.stdout))
    except _Signalled as e:
        name = signal.Signals(e.signum).name
        log.warning("%s: stopping job %s on the cluster (Ctrl-C again leaves it running)", name, job)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            info = stop_and_wait(client, job)
        except KeyboardInterrupt:
            log.error("left job %s running; stop it with `megaray stop %s`", job, job)
            return 130
        log.error("job %s %s after %s", job, info.status.value, name)
        return 128 + e.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    info = _wait_terminal(client, job, 30.0)
    return _report_end(info, tail)


def _wait_terminal(client, job: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.get_job_info(job)
        if info.status.is_terminal() or time.monotonic() > deadline:
            return info
        time.sleep(0.25)


def stop_and_wait(client, job: str):
    client.stop_job(job)
    info = _wait_terminal(client, job, STOP_WAIT_S)
    if not info.status.is_terminal():
        raise ClusterError(
            f"job {job} is still {info.status.value} {STOP_WAIT_S:g} s after the stop request; check "
            f"`megaray status {job}` and the head node"
        )
    return info


def _report_end(info, tail: str) -> int:
    code = _exit_code(info)
    took = (
        f" in {(info.end_time - info.start_time) / 1000:.1f} s" if info.end_time and info.start_time else ""
    )
    if code == 0:
        log.info("job %s SUCCEEDED%s", info.submission_id, took)
        return 0
    cause = root_cause(tail) or info.message or "see the logs above"
    log.error(
        "job %s %s%s (exit %d); root cause: %s", info.submission_id, info.status.value, took, code, cause
    )
    return code


AGENT_WAIT_S = 30.0  # for a head just started: its job agent registers a few seconds after its dashboard


def _submit(client, spec: SubmitSpec) -> str:
    """Ray's dashboard answers "No available agent to submit job, please try again later" until a
    node's job agent has registered (seconds after `ray start`): it is tried again, as it says."""
    deadline = time.monotonic() + AGENT_WAIT_S
    for attempt in itertools.count():
        try:
            return client.submit_job(
                entrypoint=job_entrypoint(spec),
                submission_id=spec.submission_id,
                runtime_env=dict(spec.runtime_env) or None,
                metadata=job_metadata(spec),
            )
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            if not attempt:
                log.info("the cluster's job agent is not up yet: trying again for up to %.0f s", AGENT_WAIT_S)
            time.sleep(1.0)
    raise AssertionError("unreachable")  # itertools.count() does not end


def submit(spec: SubmitSpec) -> int:
    client = _client(spec.address)
    try:
        job = _submit(client, spec)
    except RuntimeError as e:
        if "already exists" in str(e):
            raise UsageError(
                f"a job named {spec.submission_id} exists on the cluster already: pick another --job-name"
            ) from None
        if "status code 413" in str(e) or "maximum request body" in str(e).lower():
            raise UsageError(
                f"the working directory ({spec.working_dir or '.'}) packs to more than Ray's dashboard takes "
                "in one upload (100 MiB): leave data and checkpoints out of it (.gitignore or .rayignore) "
                "and read them from storage every node reaches"
            ) from None
        raise ClusterError(f"submitting the job failed: {str(e).splitlines()[0]}") from None
    log.info("submitted job %s to %s", job, client.get_address())
    if not spec.wait:
        print(job, flush=True)
        log.info("follow it with `megaray logs %s --follow`; stop it with `megaray stop %s`", job, job)
        return 0
    return follow(client, job)


def main(argv: list[str], exits_after: bool = False) -> int:
    """Dispatch `megaray <command> ...` for the job commands; raises MegarayError on bad input."""
    if argv[0] == "submit":
        return submit(submit_spec_from_args(argv[1:]))
    args = build_parser().parse_args(argv)
    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if args.command == "list":
        from .up import show_pools

        # a dashboard URL names no GCS to ask for the pool; `megaray up`'s Ray has no dashboard
        up_running = show_pools(None if address and "://" in address else address, exits_after)
        if not address:  # this machine's `megaray up` alone, or nothing (after `megaray down`)
            print(
                "jobs: none on `megaray up`'s Ray (no dashboard); `megaray submit --address` runs one"
                if up_running
                else "nothing runs here: no `megaray up` on this machine; a cluster's jobs: "
                "`megaray list --address http://HEAD:8265` (or RAY_ADDRESS)"
            )
            return 0
        from ray.job_submission import JobType

        # submitted jobs; not the drivers that merely connected (this very listing's, a launch's)
        listed = [j for j in _client(address).list_jobs() if j.type == JobType.SUBMISSION]
        jobs = sorted(listed, key=lambda j: j.start_time or 0)
        print(format_jobs(jobs))
        return 0
    client = _client(address)
    info = _job_info(client, args.job)
    if args.command == "status":
        print(format_status(info))
        return 0
    if args.command == "stop":
        if info.status.is_terminal():
            log.info("job %s has already ended: %s", args.job, info.status.value)
            return 0
        info = stop_and_wait(client, args.job)
        log.info("job %s %s", args.job, info.status.value)
        return 0
    if args.follow:
        return follow(client, args.job)
    logs = client.get_job_logs(args.job)
    sys.stdout.write(logs)
    sys.stdout.flush()
    return 0
