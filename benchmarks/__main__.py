"""``python -m benchmarks NAME ...`` from the repository's root: the same as
``sparktrain bench NAME ...``."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m benchmarks"))
