"""The goodput ledger (core/goodput.py, #47) against what a run was made to spend: a plain program of
two ranks reports an iteration every `--pace-s`, waits `--startup-s` before its first, fails at
`--fail-at` (rank 0, which reports, exits 1) after checkpointing every `--save-every` iterations,
and the relaunch waits `--relaunch-s`, resumes from the last checkpoint and runs to `--iterations`.

What the program spends is known for training (its iterations, but the first of each attempt, at
the pace, which sleeping and reporting stretch by a few percent) and for the iterations made again
(from the checkpoint to the failure); the start-up and the restart hold what it waited on purpose
plus megaray's own part (the processes' start, finding the failure, the teardown, the relaunch),
shown apart. The ledger's parts are checked to add up to summary.json's `duration_s`.

    python bench/goodput.py --pace-s 0.1 --startup-s 10 --fail-at 75 --save-every 20 --relaunch-s 10

The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import textwrap
from pathlib import Path

from common import PY, REPO, clean_env

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    import launcher

    pace, startup, fail_at, every, relaunch, total = map(float, sys.argv[1:7])
    ckpt = sys.argv[7]
    rank = int(os.environ["RANK"])
    again = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    saved = os.path.join(ckpt, "iteration")
    start = int(open(saved).read()) if os.path.exists(saved) else 0
    time.sleep(relaunch if again else startup)
    for it in range(start + 1, int(total) + 1):
        time.sleep(pace)
        if rank == 0:
            launcher.report(it, total=int(total), loss=1.0 / it)
            if it % int(every) == 0:
                with open(saved + ".tmp", "w") as f:
                    f.write(str(it))
                os.replace(saved + ".tmp", saved)
        if not again and it == int(fail_at) and rank == 0:
            sys.exit(1)  # the rank that reports: it reached fail_at (another may be a step behind)
    """
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pace-s", type=float, default=0.1)
    ap.add_argument("--startup-s", type=float, default=10.0)
    ap.add_argument("--fail-at", type=int, default=75)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--relaunch-s", type=float, default=10.0)
    ap.add_argument("--iterations", type=int, default=300)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megaray-goodput-"))
    (work / "ckpt").mkdir()
    program = work / "program.py"
    program.write_text(PROGRAM)
    args = (a.pace_s, a.startup_s, a.fail_at, a.save_every, a.relaunch_s, a.iterations, work / "ckpt")
    cmd = [PY, "main.py", "--device", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--max-restarts", "1",
           "--job-name", "goodput", "--runs-dir", str(work), str(program), *map(str, args)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((work / "goodput" / "summary.json").read_text())
    seconds = summary["goodput"]["seconds"]
    resumed = a.fail_at // a.save_every * a.save_every
    made = {  # what the program spent on purpose
        "training": ((a.fail_at - 1) + (a.iterations - resumed - 1) - (a.fail_at - resumed - 1)) * a.pace_s,
        "recomputed": (a.fail_at - resumed) * a.pace_s,
        "start-up": a.startup_s + a.pace_s,
        "restarts": a.relaunch_s,
    }
    print(f"{'cause':<11} {'ledger s':>9} {'made s':>8} {'megaray s':>10}")
    for cause, s in seconds.items():
        want = made.get(cause)
        extra = "" if want is None else f"{s - want:>+10.2f}"
        print(f"{cause:<11} {s:>9.2f} {'' if want is None else f'{want:>8.2f}'} {extra}")
    total, wall = sum(seconds.values()), summary["duration_s"]
    print(f"parts add up to {total:.2f} s of duration_s {wall:.2f} s ({100 * abs(total - wall) / wall:.2f}%)")
    off = {c: abs(seconds[c] - made[c]) / made[c] for c in ("training", "recomputed")}
    print(
        f"pace_s={a.pace_s} wall_s={wall:.2f} sum_off={abs(total - wall) / wall:.4f} "
        f"training_off={off['training']:.4f} recomputed_off={off['recomputed']:.4f} "
        f"startup_megaray_s={seconds['start-up'] - made['start-up']:.2f} "
        f"restart_megaray_s={seconds['restarts'] - made['restarts']:.2f}"
    )


if __name__ == "__main__":
    main()
