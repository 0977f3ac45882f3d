"""Benchmarks for ``deepep_ascend``.

Every entry point runs under MPI, one process per rank::

    mpiexec -n 4 python -m bench.normal            # V1 normal-mode dispatch + combine

``bench.common`` holds what all benchmarks share: the byte formulas (logical and bottleneck
bytes, spec §11), barrier-synchronised timing with max-over-ranks per iteration, the workload
generator and its fingerprint, the routing-trace format, and the baselines a user would pick
instead (MPI ``Alltoallv`` pipeline, torch gloo ``all_to_all_single`` pipeline, single-copy
memory roofline). Absolute times on a small shared VM are noise; the ratios are the result.
"""
