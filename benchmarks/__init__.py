"""sparktrain's benchmark suite, run from a checkout of the repository (it is not part of the
installed package): ``sparktrain bench NAME ...``, ``./dev bench NAME ...`` or
``python -m benchmarks NAME ...`` from the repository's root. The list: ``python -m
benchmarks --help``; the results: docs/results.md."""
