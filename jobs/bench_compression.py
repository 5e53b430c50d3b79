"""spark-submit entry point for the compression benchmarks; same arguments as
`sparktrain bench compression` (speed by default, --quality, --per-layer).

    spark-submit --master local[2] jobs/bench_compression.py --quality --json runs/quality.json
"""

import sys

from sparktrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "compression", *sys.argv[1:]]))
