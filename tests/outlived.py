"""Run a command and say which of the processes it started outlived it.

This process makes itself a child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`): a process the
command started that is still running once the command has ended is re-parented to it instead of to
init, where a test can find it. (A Ray a launch starts for itself is stopped before the launch ends;
its raylet's agents, which rename themselves `ray::DashboardAgent` and carry no path a test could look
for, ran on for half a minute when the raylet was killed without its stop.) After the command ends,
what is left gets up to `--grace` seconds to end; what is still there then is named and killed, by
the pids found as this process's own children. Prints one JSON line last: {"rc": ..., "left": [...]}.

    python tests/outlived.py [--grace S] [--term-once PATH] -- CMD...

`--term-once PATH`: the command gets SIGTERM once PATH exists (a scheduler's preemption, `kill`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children() -> dict[int, str]:
    """This process's children still running (not zombies), by pid: their names."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            found[int(entry)] = name
    return found


def reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--term-once")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    if args.term_once:
        while not os.path.exists(args.term_once) and proc.poll() is None:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    rc = proc.wait()
    deadline = time.monotonic() + args.grace
    while True:
        reap()
        left = children()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap()
    sys.stdout.flush()
    print(json.dumps({"rc": rc, "left": sorted(left.values())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
