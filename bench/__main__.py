"""``python -m bench <command> [options]``: the benchmarks' one entry (registry: :mod:`bench.commands`)."""
from bench.commands import main

raise SystemExit(main())
