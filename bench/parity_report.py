"""Compare Megatron logs of the same recipe run under torchrun and megaray (see gpu_parity.sh).

Steady state: median of Megatron's `elapsed time per iteration (ms)` after the first 10 iterations.
Time to first iteration: seconds from the command's start to the line that logs iteration 1.
"""

import re
import statistics
import sys

ITER = re.compile(r"^\s*([\d.]+) .*iteration\s+(\d+)/\s*(\d+) .*elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"lm loss: ([\d.E+-]+)")


def read(path: str) -> dict:
    first_at, times, losses = None, [], []
    with open(path, errors="replace") as f:
        lines = f.readlines()
    for line in lines:
        m = ITER.search(line)
        if not m:
            continue
        t, it, ms = float(m.group(1)), int(m.group(2)), float(m.group(4))
        first_at = t if first_at is None else first_at
        if it > 10:
            times.append(ms)
        loss = LOSS.search(line)
        if loss:
            losses.append(float(loss.group(1)))
    return {"first_s": first_at, "times": times, "losses": losses}


def main() -> None:
    runs = {p.rsplit("/", 1)[-1].removesuffix(".log"): read(p) for p in sys.argv[1:]}
    for name, r in runs.items():
        if not r["times"]:
            print(f"{name}: no iterations logged")
            continue
        med = statistics.median(r["times"])
        spread = (min(r["times"]), max(r["times"]))
        loss = f"loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.2f}" if r["losses"] else ""
        print(
            f"{name:9s} steady {med:8.1f} ms/iter (min {spread[0]:.1f}, max {spread[1]:.1f}, "
            f"n={len(r['times'])}), "
            f"first iteration at {r['first_s']:.1f} s, {loss}"
        )
    if all(runs[k]["times"] for k in ("torchrun", "megaray") if k in runs) and len(runs) >= 2:
        ratio = statistics.median(runs["megaray"]["times"]) / statistics.median(runs["torchrun"]["times"])
        print(
            f"megaray/torchrun steady-state ratio: {ratio:.4f}; "
            f"first iteration difference: {runs['megaray']['first_s'] - runs['torchrun']['first_s']:+.1f} s"
        )


if __name__ == "__main__":
    main()
