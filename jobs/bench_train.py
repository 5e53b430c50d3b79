"""spark-submit entry point for the head-to-head training benchmark; same arguments as
`sparktrain bench train`.

    spark-submit --master local[2] jobs/bench_train.py --workloads digits --links none 5g

The headline contenders (ring, TorchDistributor) always run in fresh child processes that
start their own local[2] sessions; the matrix uses the session spark-submit started.
"""

import sys

from sparktrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
