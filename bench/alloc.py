"""Cost of writing a per-call output into fresh host memory, with and without huge pages.

    python -m bench alloc [--mbytes 211] [--iters 5]

Median time of copying a tensor into (a) a preallocated destination, (b) a fresh
``torch.empty`` (4 KiB page faults on first touch), (c) a fresh huge-page tensor from the
library's host allocator (``deepep_ascend.ep.memory.empty``: huge pages advised before the first
touch). (b)/(a) is what an output costs without a caching allocator; (c)/(a) what the library's
outputs cost. ``--json FILE``: results ``copy/reused`` (the baseline), ``copy/fresh_torch_empty``
and ``copy/fresh_host_empty``, each with its bytes and ``ratio_to`` the reused copy.
"""

from __future__ import annotations

import torch

from bench import cli, schema
from bench.timing import interleaved_medians_ms


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--mbytes", type=float, default=211.0, help="size of the copy in MB (1e6 B); "
                   "211 MB is recv_x at 4 ranks of the default benchmark")
    cli.add_shared(p, iters=5, warmup=1, json=None)


def run(args) -> int:
    """Time the three copies (one process); returns 0."""
    from bench.internals import host_empty

    torch.set_num_threads(1)
    src = torch.randn(int(args.mbytes * 1e6) // 4)
    dst = torch.empty_like(src)
    ms = {}
    for name, fn in (("reused", lambda: dst.copy_(src)),
                     ("fresh_torch_empty", lambda: torch.empty_like(src).copy_(src)),
                     ("fresh_host_empty", lambda: host_empty(src.shape, src.dtype).copy_(src))):
        ms[name] = interleaved_medians_ms([fn], args.iters, args.warmup)[0]
    reused, fresh, huge = ms["reused"], ms["fresh_torch_empty"], ms["fresh_host_empty"]
    print(f"copy of {args.mbytes:.0f} MB: into reused memory {reused:.1f} ms; into fresh torch.empty "
          f"{fresh:.1f} ms ({fresh / reused:.1f}x); into fresh host.empty (huge pages) {huge:.1f} ms "
          f"({huge / reused:.1f}x)")
    if args.json:
        nbytes = src.numel() * src.element_size()
        records = [schema.result(f"copy/{k}", v / 1e3, nbytes=nbytes, formula="bytes copied") for k, v in ms.items()]
        for r in records:
            schema.add_ratios(records, r["name"], ["copy/reused"])
        schema.write(args.json, schema.document("alloc", argv=args._argv, params=cli.params_of(args, 1),
                                                results=records, baselines=["copy/reused"], checks=dict(ok=True),
                                                mpi=False))
    return 0


def main(argv=None) -> int:
    """``python -m bench alloc`` in-process (tests)."""
    from bench import commands

    return commands.call("alloc", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("alloc")
