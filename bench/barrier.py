"""Benchmark target: join the process group (gloo), pass a barrier, record when, exit.

Run unchanged by torchrun and by megaray; `--out DIR` receives one file per rank holding the
wall-clock time at which that rank was past the barrier, and the CPU seconds its process had used
by then (interpreter, imports, launcher setup and rendezvous: what each launcher costs per rank).
"""

import argparse
import os
import time
from datetime import timedelta

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
dist.barrier()
with open(os.path.join(args.out, f"rank{dist.get_rank()}"), "w") as f:
    cpu = os.times()
    f.write(f"{time.time()!r} {cpu.user + cpu.system!r}")
dist.destroy_process_group()
