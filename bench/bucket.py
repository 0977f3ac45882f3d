"""``BucketBuffer`` (DeepEP V2.5 bucket collectives) all-gather, reduce-scatter and all-reduce, with DeepEP's
byte formulas, against MPI's own collectives and torch gloo's on the same data in the same run.

Run under ``mpiexec`` (any number of ranks)::

    mpiexec -n 4 python -m bench bucket                         # 4 MiB FP32 per collective
    mpiexec -n 4 python -m bench bucket --ranks-per-node 2      # half the peers over URMA (two simulated nodes)

Each op moves one FP32 tensor of ``--num-bytes`` (rounded down to a multiple of ``8 x ranks`` elements) per
rank: ``all_gather`` gathers it from shards of ``num-bytes / ranks``, ``reduce_scatter`` reduces it to a shard,
``all_reduce`` reduces it whole; ``reduce_scatter`` also with ``comm_precision='bf16'``. Times are per call,
the max over ranks per iteration, the median over iterations. GB/s by DeepEP's tests/bucket formulas: the
tensor's bytes (the gathered tensor for all-gather, the source for reduce-scatter and all-reduce) / time.

Peers, same tensors, same run: MPI ``Allgather`` / ``Reduce_scatter_block`` / ``Allreduce`` (``mpi``) and
gloo ``all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` (``gloo``; an op gloo does not
implement is reported as skipped). The data are small integers, so every system's result is exact: each
system's result of each op, the peers' too, is checked bit for bit on every rank against a reference built
from every rank's source regenerated from the seed. A mismatch makes the exit code 1, and the system is left
out of every ratio and of the summary (``EXCLUDED`` in the output, ``summary.excluded`` and
``"verified": false`` in the JSON; ``checks.mismatched_ops``: ranks differing per ``<system>/<op>``).
``--json FILE``: the results, the peers as baselines, the summary ``speedup_over_faster_peer_<op>`` (over
the verified peers).
"""
from __future__ import annotations

import torch

from bench import cli, schema
from bench.timing import time_collective, time_phases

SYSTEMS = ("bucket", "mpi", "gloo")
OPS = ("all_gather", "reduce_scatter", "reduce_scatter_bf16", "all_reduce")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, iters=10, warmup=2, seed=0, json=None, ranks_per_node=None,
                   helps=dict(seed="per rank: seed*65536+rank"))
    p.add_argument("--num-bytes", type=cli.int_at_least(1), default=4 << 20, metavar="B",
                   help="bytes of the FP32 tensor each collective moves per rank, rounded down to a multiple of "
                        "8 x ranks elements (default 4 MiB)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)} (default: all); bucket = BucketBuffer, "
                        "mpi = MPI's collectives, gloo = torch.distributed gloo")


def check_args(p, a) -> None:
    """The system list (``p.error``, argparse's usage error)."""
    a.systems = cli.system_list(p, a.systems, SYSTEMS)


def _data(seed: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s FP32 source: small integers, so every sum is exact in any order and in BF16."""
    g = torch.Generator().manual_seed(seed * 65536 + rank)
    return torch.randint(-3, 4, (numel,), generator=g).float()


def _references(seed: int, rank: int, R: int, numel: int) -> dict:
    """Each op's expected result on ``rank``, from every rank's source regenerated from the seed (no
    communication): the gathered tensor, this rank's shard of the sum, the whole sum."""
    shard = numel // R
    total, gathered = torch.zeros(numel), torch.empty(numel)
    for q in range(R):
        d = _data(seed, q, numel)
        total += d
        gathered[q * shard:(q + 1) * shard] = d[q * shard:(q + 1) * shard]
    return {"all_gather": gathered, "reduce_scatter": total[rank * shard:(rank + 1) * shard].clone(),
            "all_reduce": total}


def run(args) -> int:
    """Time every op on every system (collective); rank 0 prints and writes the results. Returns 1 if any
    system's result differs from the reference, else 0."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    from deepep_ascend import BucketBuffer, BufferAllocator
    from deepep_ascend.transports import Topology

    comm = MPI.COMM_WORLD
    r, R = comm.Get_rank(), comm.Get_size()
    numel = max(8 * R, args.num_bytes // 4 // (8 * R) * (8 * R))
    shard = numel // R
    nbytes = numel * 4
    data = _data(args.seed, r, numel)
    nodes = Topology.from_comm(comm, args.ranks_per_node).num_nodes

    plan = BufferAllocator()
    tensors = {op: plan.allocate((numel,), torch.float32) for op in OPS}
    buf = BucketBuffer(comm, plan, explicitly_destroy=True, ranks_per_node=args.ranks_per_node)

    def refill(op):  # each call consumes its source: refill outside the timed region
        t = tensors[op]
        if op == "all_gather":
            t[r * shard:(r + 1) * shard].copy_(data[r * shard:(r + 1) * shard])
        else:
            t.copy_(data)

    calls = {
        "all_gather": lambda: buf.all_gather(tensors["all_gather"][r * shard:(r + 1) * shard]).wait(),
        "reduce_scatter": lambda: buf.reduce_scatter(tensors["reduce_scatter"]).wait(),
        "reduce_scatter_bf16": lambda: buf.reduce_scatter(tensors["reduce_scatter_bf16"], comm_precision="bf16").wait(),
        "all_reduce": lambda: buf.all_reduce(tensors["all_reduce"]).wait(),
    }
    def nans(n):  # a peer's output before its first call: a call that writes nothing cannot pass the check
        return torch.full((n,), float("nan"))

    mpi_out = {"all_gather": nans(numel), "reduce_scatter": nans(shard), "all_reduce": nans(numel)}
    src = data.numpy()
    mpi_calls = {
        "all_gather": lambda: comm.Allgather(src[r * shard:(r + 1) * shard], mpi_out["all_gather"].numpy()),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(src, mpi_out["reduce_scatter"].numpy(), op=MPI.SUM),
        "all_reduce": lambda: comm.Allreduce(src, mpi_out["all_reduce"].numpy(), op=MPI.SUM),
    }
    results, skipped, mismatches = [], {}, {}
    formula = {"all_gather": "DeepEP tests/bucket: gathered tensor bytes / t",
               "reduce_scatter": "DeepEP tests/bucket: source bytes / t",
               "all_reduce": "DeepEP tests/bucket: source bytes / t"}

    def bucket_call(op):
        def fn():
            refill(op)
            return calls[op]()
        return fn

    if "bucket" in args.systems:
        for op in OPS:
            timing = time_phases([(None, lambda op=op: refill(op)), ("op", calls[op])], comm, args.iters,
                                 args.warmup)["op"]
            base = op.removesuffix("_bf16")
            results.append(schema.result(f"bucket/{op}", None, timing=timing, nbytes=nbytes, formula=formula[base]))
    if "mpi" in args.systems:
        for op, fn in mpi_calls.items():
            results.append(schema.result(f"mpi/{op}", None, timing=time_collective(fn, comm, args.iters, args.warmup),
                                         nbytes=nbytes, formula=formula[op]))
    group = None
    if "gloo" in args.systems:
        import torch.distributed as dist

        from bench.baselines import start_gloo

        group = start_gloo(comm)
        gloo_out = {"all_gather": nans(numel), "reduce_scatter": nans(shard), "all_reduce": nans(numel)}
        gloo_calls = {
            "all_gather": lambda: dist.all_gather_single(gloo_out["all_gather"], data[r * shard:(r + 1) * shard]),
            "reduce_scatter": lambda: dist.reduce_scatter_single(gloo_out["reduce_scatter"], data),
            "all_reduce": lambda: dist.all_reduce(gloo_out["all_reduce"].copy_(data)),  # in place: refill
        }
        for op, fn in gloo_calls.items():
            try:
                fn()
                err = None
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            errs = comm.allgather(err)
            if any(errs):
                skipped[f"gloo/{op}"] = next(e for e in errs if e)
                continue
            results.append(schema.result(f"gloo/{op}", None, timing=time_collective(fn, comm, args.iters, args.warmup),
                                         nbytes=nbytes, formula=formula[op]))

    # every system's last result per op against the reference, on every rank; a system that differs anywhere
    # is left out of every ratio (docs/benchmarks.md, "Correctness first")
    ref = _references(args.seed, r, R, numel)
    outs = {}
    if "bucket" in args.systems:  # one more call per op: the timed ones' sources were refilled after
        outs.update({f"bucket/{op}": bucket_call(op)() for op in OPS})
    if "mpi" in args.systems:
        outs.update({f"mpi/{op}": t for op, t in mpi_out.items()})
    if "gloo" in args.systems:
        outs.update({f"gloo/{op}": t for op, t in gloo_out.items() if f"gloo/{op}" not in skipped})
    bad = [name for name, got in outs.items()
           if not torch.equal(got, ref[name.partition("/")[2].removesuffix("_bf16")])]
    every = comm.allgather(bad)
    for name in outs:
        mismatches[name] = sum(name in b for b in every)
    wrong: dict = {}
    for name, n in mismatches.items():
        if n:
            system, _, op = name.partition("/")
            wrong.setdefault(system, []).append(f"{op} on {n} rank(s)")
    failed = {s: "differs from the reference: " + ", ".join(v) for s, v in wrong.items()}
    summary = {}
    by = {x["name"]: x for x in results}
    peers = [p for p in ("mpi", "gloo") if p in args.systems]
    trusted = list(schema.trusted(dict.fromkeys(peers), failed))  # a peer that failed takes part in no ratio
    for op in OPS:
        base = op.removesuffix("_bf16")
        name = f"bucket/{op}"
        if name in by and "bucket" not in failed:
            others = [f"{p}/{base}" for p in trusted if f"{p}/{base}" in by]
            schema.add_ratios(results, name, others)
            if others:
                summary[f"speedup_over_faster_peer_{op}"] = min(by[o]["seconds"] for o in others) / by[name]["seconds"]
    ok = not any(mismatches.values())
    outs.clear()
    tensors.clear()
    del plan
    buf.destroy()
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()

    if r == 0:
        print(f"[bucket] {R} ranks ({nodes} node{'s' if nodes > 1 else ''}), FP32 tensors of {nbytes} B "
              f"(shards of {shard * 4} B); per call, max over ranks, median of {args.iters}", flush=True)
        schema.print_results(results, skipped, summary, ok, {k: v for k, v in mismatches.items() if v}, width=28,
                             failed=failed)
        if args.json:
            schema.write(args.json, schema.document(
                "bucket", argv=args._argv, params=cli.params_of(args, R), results=results,
                baselines=[x["name"] for x in results if x["system"] in peers],
                checks=dict(ok=ok, mismatched_ops=mismatches), summary=summary, failed=failed,
                details=dict(nodes=nodes, tensor_bytes=nbytes, shard_bytes=shard * 4, skipped=skipped,
                             timed="per call, max over ranks; BucketBuffer sources refilled outside the timing")))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench bucket`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("bucket", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("bucket")
