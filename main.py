"""Launch a torchrun-style program on a Ray cluster: `python main.py --nodes 2 --gpus-per-node 8 ...`."""

from launcher.cli import entry

if __name__ == "__main__":
    entry()
