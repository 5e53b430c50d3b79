"""Spark clusters for the tests and the benchmarks of a checkout: a standalone cluster on
loopback (:mod:`tests.cluster.standalone`) and one whose workers live in network namespaces
behind tc-shaped veths (:mod:`tests.cluster.netcluster`). Not part of the installed package;
the benchmarks (``benchmarks/``, also run from a checkout) import them from here."""
