"""``EngramBuffer`` (DeepEP V2.5's Engram fetch) against the same fetch built on MPI and gloo, in one run.

Run one process per rank::

    mpiexec -n 4 python -m bench engram                       # BF16, DeepEP's shape with fewer entries
    mpiexec -n 4 python -m bench engram --use-fp8 --json engram.json
    mpiexec -n 4 python -m bench engram --ranks-per-node 2    # two simulated nodes: URMA between them

Workload (DeepEP's ``tests/engram/test_engram.py``, fewer entries per rank): per layer ``n_l`` entries per rank
(``--num-entries-per-layer``, default ``16384,16405``; DeepEP: ``524288,524309``) of ``--hidden`` (256)
channels, ``randn`` in BF16 (``--use-fp8``: e4m3 with a float32 scale per 128 channels, replicated scale
tables); every rank fetches ``--num-tokens`` (512) tokens of ``--num-entries-per-token`` (24) entries per
layer, entry ``e`` drawn uniformly from the ``e``-th slice of the layer's table (that test's ``gen_indices``),
seeded ``seed * 65536 + rank``.

Systems, fetching the same indices:

* ``engram``: ``hooks = EngramBuffer.fetch(indices)`` then every hook (DeepEP's ``fetch_and_wait``), in a
  buffer of ``get_storage_size_hint`` with ``get_theoretical_config``'s queue-pair counts;
* ``mpi_alltoallv``: the two-sided equivalent: the requested row numbers to their owners (``Alltoall`` of
  counts, ``Alltoallv`` of int32 ids), each owner's ``index_select`` of its rows, ``Alltoallv`` of the rows
  back, and their scatter into token order (scales likewise, from the replicated table: a local gather);
* ``gloo_all_to_all``: the same over torch gloo ``all_to_all_single``.

Timing (:func:`bench.timing.time_phases`): a barrier before each fetch, ``time.perf_counter`` around it, the
max over ranks per iteration, the median (min, max) over ``--iters`` after ``--warmup``.

Bytes (DeepEP's test): ``num_layers * num_tokens * num_entries_per_token * hidden * itemsize`` per rank (the
entries' data; scales not counted), GB/s = that / the median time (1 GB = 1e9 B); also millions of entries
per second (DeepEP's MPPS). ``moved``: what the Engram fetch read per channel kind on the busiest rank.

Checks (a mismatch prints ``MISMATCH`` and makes the exit code 1): every system's fetched data (and scales),
the peers' too, equal bit for bit on every rank a reference gathered from the owners' tables regenerated from
the seed. A system that differs is left out of every ratio and of the summary (``EXCLUDED`` in the output,
``summary.excluded`` and ``"verified": false`` in the JSON).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from bench import cli, schema
from bench.timing import Timing, time_phases

SYSTEMS = ("engram", "mpi_alltoallv", "gloo_all_to_all")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--num-entries-per-layer", type=cli.int_list(1), default=[16384, 16405], metavar="N,N,...",
                   help="entries per rank of each layer (default 16384,16405)")
    p.add_argument("--num-entries-per-token", type=cli.int_at_least(1), default=24, metavar="E",
                   help="entries fetched per token and layer (default 24)")
    p.add_argument("--use-fp8", action="store_true", help="FP8 entries with replicated float32 scales")
    p.add_argument("--no-hybrid", action="store_true",
                   help="allow_hybrid_mode=False: node peers' storage read over URMA too")
    cli.add_shared(p, num_tokens=512, hidden=256, iters=10, warmup=2, seed=0, ranks_per_node=None, json=None)


def check_args(p, args) -> None:
    if not args.num_entries_per_layer:
        p.error("--num-entries-per-layer: give at least one layer")
    if args.use_fp8 and args.hidden % 128:
        p.error(f"--hidden must be a multiple of 128 with --use-fp8 (one scale per 128 channels), got {args.hidden}")


def _indices(args, rank: int, R: int) -> torch.Tensor:
    """DeepEP's ``gen_indices``: entry ``e`` of a token from the ``e``-th slice of the layer's global table."""
    g = torch.Generator().manual_seed(args.seed * 65536 + rank + 7777)
    E, T = args.num_entries_per_token, args.num_tokens
    layers = []
    for n in args.num_entries_per_layer:
        size = R * n // E
        layers.append(torch.arange(E) * size + torch.randint(0, size, (T, E), generator=g))
    return torch.stack(layers).to(torch.int32)


class _Pipeline:
    """The fetch built on a two-sided all-to-all: ids to their owners, rows back, scattered into token order."""

    def __init__(self, name, counts, exchange, shards, sfs, row_bytes, R):
        self.name, self._counts, self._exchange = name, counts, exchange
        self.shards = [s.view(torch.uint8).view(s.size(0), -1) for s in shards]
        self.sfs, self.row_bytes, self.R = sfs, row_bytes, R
        self.out = None

    def __call__(self, indices: torch.Tensor, entries) -> None:
        L, T, E = indices.shape
        out = []
        for layer, n in enumerate(entries):
            idx = indices[layer].reshape(-1).long()
            owner = torch.div(idx, n, rounding_mode="floor")
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=self.R).numpy().astype(np.int64)
            recv_counts = self._counts(send_counts)
            ask = (idx - owner * n)[order].to(torch.int32)
            asked = torch.empty(int(recv_counts.sum()), dtype=torch.int32)
            self._exchange(ask.view(-1, 1).view(torch.uint8), asked.view(-1, 1).view(torch.uint8),
                           send_counts, recv_counts)
            rows = torch.index_select(self.shards[layer], 0, asked.long())
            got = torch.empty(idx.numel(), self.row_bytes, dtype=torch.uint8)
            self._exchange(rows, got, recv_counts, send_counts)
            data = torch.empty_like(got).index_copy_(0, order, got)
            sf = None if self.sfs is None else self.sfs[layer][idx].view(T, -1)
            out.append((data.view(T, -1), sf))
        self.out = out


def _mpi_pipeline(comm, *rest):
    from mpi4py import MPI

    types: dict[int, object] = {}

    def counts(send):
        recv = np.empty_like(send)
        comm.Alltoall(send, recv)
        return recv

    def exchange(send, out, send_counts, recv_counts):
        row = send.size(1)
        t = types.get(row)
        if t is None:
            t = types[row] = MPI.BYTE.Create_contiguous(row).Commit()
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
        comm.Alltoallv([send.numpy(), (send_counts, sd), t], [out.numpy(), (recv_counts, rd), t])

    pipe = _Pipeline("mpi_alltoallv", counts, exchange, *rest)
    pipe.close = lambda: [t.Free() for t in types.values()]
    return pipe


def _gloo_pipeline(group, *rest):
    import torch.distributed as dist

    def counts(send):
        s = torch.from_numpy(np.ascontiguousarray(send, dtype=np.int64))
        r = torch.empty_like(s)
        dist.all_to_all_single(r, s, group=group)
        return r.numpy()

    def exchange(send, out, send_counts, recv_counts):
        dist.all_to_all_single(out, send, output_split_sizes=[int(c) for c in recv_counts],
                               input_split_sizes=[int(c) for c in send_counts], group=group)

    pipe = _Pipeline("gloo_all_to_all", counts, exchange, *rest)
    pipe.close = lambda: None
    return pipe


def _same(a, b) -> bool:
    """The same bytes in the same order (rows may be shaped differently: the pipelines hold raw byte rows)."""
    a, b = a.contiguous().view(torch.uint8).reshape(-1), b.contiguous().view(torch.uint8).reshape(-1)
    return a.shape == b.shape and torch.equal(a, b)


def _reference(args, indices: torch.Tensor, R: int) -> list:
    """Every layer's expected fetch on this rank, ``[(data, scales)]``: ``data`` ``[T * E, row]`` (raw bytes
    of the entries in token order), ``scales`` ``[T * E, hidden / 128]`` float32 (``None`` in BF16). Built
    from each owner's table regenerated from the seed (:func:`run`'s order), no communication."""
    from deepep_ascend.gemm import per_token_cast_to_fp8

    row, rows = args.hidden * (1 if args.use_fp8 else 2), indices[0].numel()
    out = [(torch.empty(rows, row, dtype=torch.uint8), torch.empty(rows, args.hidden // 128) if args.use_fp8 else None)
           for _ in args.num_entries_per_layer]
    for q in range(R):
        g = torch.Generator().manual_seed(args.seed * 65536 + q)
        for layer, n in enumerate(args.num_entries_per_layer):
            x = torch.randn(n, args.hidden, generator=g).to(torch.bfloat16)
            data, sf = per_token_cast_to_fp8(x, use_ue8m0=False) if args.use_fp8 else (x, None)
            idx = indices[layer].reshape(-1).long()
            mine = torch.nonzero(torch.div(idx, n, rounding_mode="floor") == q).squeeze(1)
            local = idx[mine] - q * n
            ref_data, ref_sf = out[layer]
            ref_data[mine] = data.contiguous().view(torch.uint8)[local]
            if ref_sf is not None:
                ref_sf[mine] = sf[local].float()
    return out


def run(args) -> int:
    """Run the three systems on the same indices (collective); rank 0 prints and writes the results."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    from bench.baselines import start_gloo
    from deepep_ascend import EngramBuffer
    from deepep_ascend.gemm import per_token_cast_to_fp8

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    root = rank == 0
    rpn = args.ranks_per_node or R
    entries, hidden, T, E = args.num_entries_per_layer, args.hidden, args.num_tokens, args.num_entries_per_token
    problem = (f"--ranks-per-node {rpn} does not divide {R} ranks" if R % rpn else
               f"every layer needs ranks x entries >= --num-entries-per-token {E} (one table slice per entry)"
               if R * min(entries) < E else None)
    if problem:
        if root:
            print(f"python -m bench engram: error: {problem}", file=sys.stderr)
        return 2
    L = len(entries)
    dtype = torch.float8_e4m3fn if args.use_fp8 else torch.bfloat16
    packs = hidden // 128 if args.use_fp8 else 0
    g = torch.Generator().manual_seed(args.seed * 65536 + rank)
    shards, sfs = [], [] if args.use_fp8 else None
    for n in entries:
        x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
        if args.use_fp8:
            data, sf = per_token_cast_to_fp8(x, use_ue8m0=False)
            table = torch.empty(R * n, packs, dtype=sf.dtype)
            comm.Allgather(sf.contiguous().numpy(), table.numpy())  # DeepEP's test replicates the scales
            shards.append(data)
            sfs.append(table)
        else:
            shards.append(x)
    indices = _indices(args, rank, R)
    gpu, storage = EngramBuffer.get_storage_size_hint(comm, entries, hidden, T, E, dtype, packs,
                                                      ranks_per_node=args.ranks_per_node)
    qps, depth, restrict = EngramBuffer.get_theoretical_config(comm, L, T, E, ranks_per_node=args.ranks_per_node)
    nbytes = L * T * E * hidden * dtype.itemsize  # DeepEP's num_fetched_bytes
    if root:
        print(f"[config]   ranks {R} ({R // rpn} node(s) x {rpn}) | entries/rank per layer {entries} | hidden {hidden} "
              f"{'FP8 + float32 scales' if args.use_fp8 else 'BF16'} | fetch {T} tokens x {E} entries x {L} layers | "
              f"storage/rank {sum(entries) * hidden * dtype.itemsize / 2 ** 20:.1f} MiB | num_gpu_bytes {gpu} | "
              f"QPs {qps} depth {depth} | hybrid {not args.no_hybrid} | iters {args.iters} ({cli.warmup_text(args)})",
              flush=True)

    buf = EngramBuffer(comm, gpu, storage, True, qps, depth, restrict, allow_hybrid_mode=not args.no_hybrid,
                       explicitly_destroy=True, ranks_per_node=args.ranks_per_node)
    buf.set_config(entries, hidden, T, E, dtype, packs)
    buf.write(shards, sfs)
    fetched = {}

    fetches = [0]

    def engram():
        hooks = buf.fetch(indices)
        fetched["engram"] = [h() for h in hooks]
        fetches[0] += 1

    before = buf.get_traffic()
    timings = {"engram": time_phases([("fetch", engram)], comm, args.iters, args.warmup)["fetch"]}
    after = buf.get_traffic()
    moved = {k: (after[k] - before[k]) // fetches[0] for k in after}  # the warm-up's fetches counted too
    engram_out = [f if args.use_fp8 else (f, None) for f in fetched["engram"]]  # valid after destroy()
    buf.destroy()

    row_bytes = hidden * dtype.itemsize
    pipes = [_mpi_pipeline(comm, shards, sfs, row_bytes, R), _gloo_pipeline(start_gloo(comm), shards, sfs,
                                                                             row_bytes, R)]
    for pipe in pipes:
        timings[pipe.name] = time_phases([("fetch", lambda p=pipe: p(indices, entries))], comm, args.iters,
                                         args.warmup)["fetch"]
    # every system's last fetch against the reference on every rank; a system that differs anywhere is left
    # out of every ratio (docs/benchmarks.md, "Correctness first")
    ref = _reference(args, indices, R)
    outs = {"engram": engram_out, **{pipe.name: pipe.out for pipe in pipes}}
    bad = [name for name, out in outs.items()
           if not all(_same(d, rd) and (rs is None or _same(sf, rs)) for (d, sf), (rd, rs) in zip(out, ref))]
    for pipe in pipes:
        pipe.close()
    every = comm.allgather(bad)
    failed = {name: "fetched data" + (" or scales" if args.use_fp8 else "") + " differ from the reference on rank(s) "
              + str([q for q, b in enumerate(every) if name in b]) for name in SYSTEMS if any(name in b for b in every)}
    ok = not failed
    moved_max = {k: int(comm.allreduce(v, op=MPI.MAX)) for k, v in moved.items()}
    peers = list(schema.trusted(dict.fromkeys(SYSTEMS[1:]), failed))  # a peer that failed takes part in no ratio
    faster = min(timings[n].median for n in peers) if peers and "engram" not in failed else None

    code = 0 if ok else 1
    if root:
        for name in SYSTEMS:
            t: Timing = timings[name]
            print(f"[{name:16s}] fetch + wait {t.fmt('ms')} | {nbytes / t.median / 1e9:6.2f} GB/s | "
                  f"{L * T * E / t.median / 1e6:6.2f} M entries/s ({row_bytes} B each)"
                  + (" (EXCLUDED)" if name in failed else ""), flush=True)
        print("[moved]    engram, busiest rank per fetch: " + ", ".join(f"{k} {v} B" for k, v in moved_max.items()))
        for name in SYSTEMS:
            print(f"[check]    {name} vs reference (the tables regenerated from the seed): "
                  f"{'MISMATCH' if name in failed else 'ok'}")
        if faster is not None:
            print(f"[summary]  engram over the faster verified peer: {timings['engram'].median / faster:.2f}x the "
                  f"time ({faster / timings['engram'].median:.2f}x the speed)", flush=True)
        for line in schema.excluded_lines(failed):
            print(line, flush=True)
        if args.json:
            formula = "num_layers * num_tokens * num_entries_per_token * hidden * itemsize (DeepEP's test)"
            results = [schema.result(f"{n}/fetch", None, timing=timings[n], nbytes=nbytes, formula=formula,
                                     **({"by_kind": moved_max} if n == "engram" else {})) for n in SYSTEMS]
            if "engram" not in failed:
                schema.add_ratios(results, "engram/fetch", [f"{n}/fetch" for n in peers])
            schema.write(args.json, schema.document(
                "engram", argv=args._argv, params=cli.params_of(args, R), results=results,
                baselines=[f"{n}/fetch" for n in SYSTEMS[1:]], checks=dict(ok=ok), failed=failed,
                summary={} if faster is None else dict(speedup_over_faster_peer=faster / timings["engram"].median),
                details=dict(nodes=R // rpn, num_gpu_bytes=gpu, num_rdma_storage_bytes=storage, qps=qps,
                             qp_depth=depth, moved_per_fetch=moved_max)))
    return code


def main(argv=None) -> int:
    """``python -m bench engram`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("engram", argv)
