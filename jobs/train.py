"""spark-submit entry point for training; same arguments as `sparktrain train`.

spark-submit --master local[2] jobs/train.py conf/digits_mlp.toml --set epochs=5
"""

import sys

from sparktrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
