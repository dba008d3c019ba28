"""Benchmark target for torchrun: megaray's dry run (the rendezvous check, then the tiny Megatron GPT
trainer) as a plain program, writing when the first training step was reported.

    torchrun --nproc-per-node 2 bench/first_step.py OUT_FILE steps=3

Under megaray the same code runs as `--dry-run steps=3`, and the first report's time is in the run
directory's summary.json (`progress.first_report_at`).
"""

import sys
import time

import launcher.megatron.tiny_gpt as tiny_gpt
from launcher.megatron.dryrun import check_and_train

out = sys.argv[1]


def report(iteration: int, *args, **kwargs) -> None:  # the rank megaray's report() would be called on
    if iteration == 1:
        with open(out, "w") as f:
            f.write(repr(time.time()))


tiny_gpt.report = report
check_and_train(*sys.argv[2:])
