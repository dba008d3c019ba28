"""Launch a torchrun-style program on a Ray cluster: `python main.py --nodes 2 --gpus-per-node 8 ...`."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
