"""Soak: many round trips of mixed calls with changing shapes, watching memory (a stability check, not a
speed benchmark).

Run one process per rank::

    mpiexec -n 4 python -m bench soak                          # 10,000 round trips, a report every 1,000
    mpiexec -n 4 python -m bench soak --iters 2000 --report-every 200 --json soak.json

Every round trip is one of, chosen by the round trip's number (the same choice on every rank):

* ``normal``: ``Buffer.get_dispatch_layout`` + ``dispatch`` + ``combine`` (V1), BF16;
* ``cached``: a cached ``dispatch`` through the last ``normal`` handle + ``combine``;
* ``low_latency``: ``low_latency_dispatch`` + ``low_latency_combine`` (BF16, a separate LL ``Buffer``);
* ``ep``: ``EPBuffer.dispatch`` + ``combine`` (compact layout; every fourth expanded, alignment 8).

Shapes change every round trip: each rank draws its token count in ``[0, --num-tokens]`` and the
round trip's hidden size from ``{--hidden / 4, --hidden / 2, --hidden}`` (``--hidden`` a multiple of 512, so
that each is a multiple of 128; the LL
calls keep ``--hidden``, the size their buffer was laid out for), routing is top-``--num-topk`` of
``--num-experts`` distinct experts with some slots ``-1``. Rows are small integers, so every combine of the
unmodified received rows is exact: each token's row times the number of ranks it reached (LL:
times the sum of its weights, checked within BF16's rounding). A wrong result prints ``MISMATCH``
and makes the exit code 1.

Every ``--report-every`` round trips rank 0 prints the resident set of the busiest rank split into
anonymous memory (``RssAnon``: Python and torch heap, the part that would show a leak; read after
glibc's ``malloc_trim(0)``, so that free heap pages the allocator keeps cached do not count) and touched shared
pages (``RssShmem``: the windows and segments of this job), and ``/dev/shm`` use (machine-wide: other
jobs on the host show there too, so it is reported, not judged). The verdict compares the last report
with the first (after the first ``--report-every`` calls, which touch the windows and warm the pools):
neither ``RssAnon`` nor ``RssShmem`` may grow by more than ``--tolerance-mb`` (default 64 MB) on any
rank, else ``GROWING`` and exit code 1. ``--json FILE``: the reports and the verdict in ``details``
(schema ``deepep_ascend.bench/1``; the result ``soak/round_trip`` is the median round-trip time).
"""
from __future__ import annotations

import statistics
import time

import torch

from bench import cli, schema
from bench.roundtrip import normal_buffer_bytes

OPS = ("normal", "cached", "low_latency", "ep")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--report-every", type=cli.int_at_least(1), default=1000, help="round trips between memory "
                   "reports (default 1000)")
    p.add_argument("--tolerance-mb", type=float, default=64.0, help="allowed growth of RssAnon and RssShmem "
                   "between the first and the last report, per rank (default 64 MB)")
    cli.add_shared(p, num_tokens=64, hidden=512, num_topk=4, num_experts=32, iters=10000, seed=0, json=None,
                   ranks_per_node=None, no_progress=False,
                   helps=dict(iters="round trips", num_tokens="the most tokens a rank draws",
                              hidden="a multiple of 512: its half and quarter are hidden sizes too"))


def check_args(parser, args) -> None:
    """Hidden sizes must stay multiples of 128 when divided by 4 (the LL layout and the FP8-free rows)."""
    if args.hidden % 512:
        parser.error(f"--hidden must be a multiple of 512 (its quarter is a hidden size too), got {args.hidden}")


def _release_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: return the heap's free pages to the system, so that ``RssAnon`` counts
    memory in use rather than what the allocator keeps cached (no-op where there is no glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _memory() -> tuple[int, int, int]:
    """``(RssAnon, RssShmem, /dev/shm used)`` of this process, bytes, after :func:`_release_free_heap`."""
    import os
    _release_free_heap()
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    st = os.statvfs("/dev/shm")
    return fields.get("RssAnon", 0), fields.get("RssShmem", 0), (st.f_blocks - st.f_bfree) * st.f_frsize


def _routing(g: torch.Generator, n: int, k: int, num_experts: int) -> torch.Tensor:
    """``[n, k]`` int64: distinct experts per row, about one slot in eight ``-1``."""
    idx = torch.rand(n, num_experts, generator=g).topk(k, dim=1).indices
    return idx.masked_fill(torch.rand(n, k, generator=g) < 0.125, -1)


def run(args) -> int:
    """The soak loop (collective); rank 0 prints the reports and the verdict. Returns 1 on a wrong result or
    growing memory, else 0."""
    torch.set_num_threads(1)
    from mpi4py import MPI
    from tqdm import tqdm

    import deepep_ascend as de

    comm = MPI.COMM_WORLD
    R, rank = comm.Get_size(), comm.Get_rank()
    M, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    if E % R:
        raise SystemExit(f"--num-experts ({E}) must be a multiple of the ranks ({R})")
    nvl, rdma = normal_buffer_bytes(de.Buffer, M, H, R, args.ranks_per_node, K, E, fp8=False)
    buf = de.Buffer(comm, nvl, rdma, explicitly_destroy=True, ranks_per_node=args.ranks_per_node)
    ll = de.Buffer(comm, 0, de.Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                   num_qps_per_rank=max(1, E // R), explicitly_destroy=True, ranks_per_node=args.ranks_per_node)
    ep = de.EPBuffer(comm, num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True,
                     ranks_per_node=args.ranks_per_node)
    bf16 = torch.bfloat16
    last_handle = None  # (handle, x) of the last normal round trip, for the cached ones
    bad, times, reports = [], [], []
    ran = dict.fromkeys(OPS, 0)
    bar = tqdm(total=args.iters, disable=rank != 0 or args.no_progress, desc="soak", unit="rt")
    for i in range(args.iters):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i * 131 + rank)
        shared = torch.Generator().manual_seed(args.seed * 1_000_003 + i)  # same on every rank
        op = OPS[int(torch.randint(0, len(OPS), (1,), generator=shared))]
        if op == "cached" and last_handle is None:
            op = "normal"
        hidden = H if op == "low_latency" else H // (1 << int(torch.randint(0, 3, (1,), generator=shared)))
        n = int(torch.randint(0, M + 1, (1,), generator=g))
        x = torch.randint(-8, 9, (n, hidden), generator=g).to(bf16)
        topk_idx = _routing(g, n, K, E)
        reached = torch.stack([((topk_idx >= r * (E // R)) & (topk_idx < (r + 1) * (E // R))).any(1)
                               for r in range(R)]).sum(0) if n else torch.zeros(0, dtype=torch.int64)
        comm.Barrier()
        t0 = time.perf_counter()
        if op == "normal":
            ntpr, ntprr, ntpe, itr, _ = buf.get_dispatch_layout(topk_idx, E)
            rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                                  is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                                  topk_weights=torch.ones(n, K))
            combined, _, _ = buf.combine(rx, handle)
            want = x.float() * reached[:, None]
            last_handle = (handle, n)
        elif op == "cached":
            handle, n_h = last_handle
            xc = torch.randint(-8, 9, (n_h, hidden), generator=g).to(bf16)
            rx, _, _, _, _, _ = buf.dispatch(xc, handle=handle)
            combined, _, _ = buf.combine(rx, handle)
            want = xc.float() * handle.is_token_in_rank.sum(1)[:, None]
        elif op == "low_latency":
            w = torch.rand(n, K, generator=g)
            rx, _, h, _, _ = ll.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False)
            combined, _, _ = ll.low_latency_combine(rx, topk_idx, w, h)
            want = x.float() * w.masked_fill(topk_idx < 0, 0).sum(1, keepdim=True)
        else:
            expand = i % 4 == 3
            rx, _, _, handle, _ = ep.dispatch(x, topk_idx, num_experts=E, do_expand=expand,
                                              expert_alignment=8 if expand else 1)
            if expand:  # the expanded rows are per (token, expert): combine sums a rank's slots first
                combined, _, _ = ep.combine(rx, handle)
                want = x.float() * (topk_idx >= 0).sum(1)[:, None]
            else:
                combined, _, _ = ep.combine(rx, handle)
                want = x.float() * reached[:, None]
        times.append(time.perf_counter() - t0)
        ran[op] += 1
        tol = 0.02 * want.abs() + 0.5 if op == "low_latency" else 0
        if not bool(((combined.float() - want).abs() <= tol).all()):
            bad.append((i, op))
        bar.update(1)
        if (i + 1) % args.report_every == 0 or i + 1 == args.iters:
            mem = comm.allgather(_memory())
            reports.append(dict(calls=i + 1, rss_anon=[m[0] for m in mem], rss_shmem=[m[1] for m in mem],
                                dev_shm=mem[0][2]))
            if rank == 0:
                r = reports[-1]
                bar.write(f"[soak] {i + 1:>7,} round trips | RssAnon max {max(r['rss_anon']) / 1e6:8.1f} MB | "
                          f"RssShmem max {max(r['rss_shmem']) / 1e6:8.1f} MB | /dev/shm {r['dev_shm'] / 1e6:8.1f} MB "
                          f"(machine-wide)")
    bar.close()
    bad_all = [b for part in comm.allgather(bad) for b in part]
    ep.destroy()
    ll.destroy()
    buf.destroy()
    first, last = reports[0], reports[-1]
    growth = max(b - a for key in ("rss_anon", "rss_shmem") for a, b in zip(first[key], last[key]))
    flat = growth <= args.tolerance_mb * 1e6
    if rank == 0:
        verdict = f"MISMATCH in {len(bad_all)} round trips, first {bad_all[:5]}" if bad_all else \
            "every combine equal to the reference"
        print(f"[check] {verdict}")
        print(f"[soak]  {args.iters:,} round trips at {R} ranks ({', '.join(f'{k} {v}' for k, v in ran.items())}), "
              f"median {statistics.median(times) * 1e3:.2f} ms | "
              f"growth from {first['calls']:,} to {last['calls']:,} calls: {growth / 1e6:+.1f} MB "
              f"({'flat' if flat else 'GROWING'}, tolerance {args.tolerance_mb:g} MB)")
        if args.json:
            doc = schema.document("soak", argv=args._argv, params=dict(num_ranks=R, num_tokens=M, hidden=H,
                                                                        num_topk=K, num_experts=E),
                                  results=[schema.result("soak/round_trip", statistics.median(times))],
                                  checks=dict(ok=not bad_all and flat, combine=not bad_all, memory_flat=flat),
                                  details=dict(reports=reports, round_trips_per_op=ran, growth_bytes=growth,
                                               mismatches=bad_all[:100]))
            schema.write(args.json, doc)
    return 1 if bad_all or not flat else 0
