"""Benchmarks for ``deepep_ascend``, run from a checkout (not installed with the package)::

    python -m bench --help                         # the commands, one line each
    mpiexec -n 4 python -m bench normal            # V1 normal-mode dispatch + combine (the main job)
    mpiexec -n 2 python -m bench low-latency --json out.json
    python -m bench fp8-decode

One entry (:mod:`bench.commands`: the registry), one argument vocabulary (:mod:`bench.cli`), one
JSON document for every command and the sweep (:mod:`bench.schema`). What the commands share,
one module per concern: byte formulas (:mod:`bench.formulas`), workloads and fingerprints
(:mod:`bench.workload`), routing traces (:mod:`bench.routing`), timing (:mod:`bench.timing`),
the round trip (:mod:`bench.roundtrip`), the baselines a user would pick instead
(:mod:`bench.baselines`: MPI ``Alltoallv`` and torch gloo ``all_to_all_single`` pipelines;
:mod:`bench.roofline`: the single-copy memory roofline), host information (:mod:`bench.hostinfo`),
the link model (:mod:`bench.linkmodel`), the sweep's records and plots (:mod:`bench.sweep_records`,
:mod:`bench.sweep_plots`), and every library internal the commands use (:mod:`bench.internals`).
Absolute times on a small shared VM are noise; the ratios are the result.
"""
