"""Prefix each line of stdin with seconds since a start time: `cmd | python bench/stamp.py $(date +%s.%N)`."""

import sys
import time

t0 = float(sys.argv[1]) if len(sys.argv) > 1 else time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time() - t0:8.2f} {line}")
    sys.stdout.flush()
