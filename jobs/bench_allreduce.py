"""spark-submit entry point for the allreduce benchmark; same arguments as
`sparktrain bench allreduce`.

    spark-submit --master local[4] jobs/bench_allreduce.py --world 2 4 --json runs/allreduce.json
"""

import sys

from sparktrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "allreduce", *sys.argv[1:]]))
