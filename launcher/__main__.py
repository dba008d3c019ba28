"""`python -m launcher ...`: the same as `megaray ...`; what a submitted job runs on the head node."""

from .cli import entry

if __name__ == "__main__":
    entry()
