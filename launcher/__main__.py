"""`python -m launcher ...`: the same as `megaray ...`; what a submitted job runs on the head node."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
