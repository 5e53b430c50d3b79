"""spark-submit entry point for every benchmark; same arguments as ``sparktrain bench``.
From the repository's root:

    spark-submit --master local[4] benchmarks/submit.py allreduce --world 2 4 --json PATH
    spark-submit --master local[2] benchmarks/submit.py compression --quality --json PATH
    spark-submit --master local[2] benchmarks/submit.py train --workloads digits --links none 5g

``bench train``'s headline contenders (ring, TorchDistributor) always run in fresh child
processes that start their own local[2] sessions; its matrix uses the session spark-submit
started.
"""

import sys
from pathlib import Path

# spark-submit puts this file's folder on sys.path, not the repository's root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="spark-submit benchmarks/submit.py"))
