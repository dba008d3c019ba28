"""Benchmark targets that import nothing heavy, so the launcher's own cost is what gets measured."""

import os
import signal
import sys
import time


def cpu_seconds() -> float:
    """CPU seconds this rank's process has used so far: the Ray worker's start-up and megaray's
    setup, which run on the rank's own node and so, on a real cluster, in parallel across nodes."""
    t = os.times()
    return t.user + t.system


def wait_forever() -> None:
    """Write this rank's pid to <argv[1]>/pid-<rank>, then block until killed. With a second argument
    S, a SIGTERM handler takes S seconds before exiting, as a checkpoint-on-SIGTERM would."""
    out = sys.argv[1]
    if len(sys.argv) > 2:
        seconds = float(sys.argv[2])

        def handler(signum, frame):
            time.sleep(seconds)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, handler)
    with open(os.path.join(out, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


if __name__ == "__main__":  # as a torchrun script
    wait_forever()
