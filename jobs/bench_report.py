"""Regenerate docs/results.md's results section from docs/results/*.json; same arguments as
`sparktrain bench report` (``--check`` exits 1 when the section is stale).

    python jobs/bench_report.py [--check]
"""

import sys

from sparktrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "report", *sys.argv[1:]]))
