"""``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads`` (DeepEP V2.5's redundant experts) against MPI
``Isend``/``Irecv`` and torch gloo ``isend``/``irecv`` moving the same expert tensors in the same run.

Run under ``mpiexec`` (ranks of one node: the load-balance domain is the node)::

    mpiexec -n 4 python -m bench lb                            # 4 local experts, 2 replicas per rank
    mpiexec -n 4 python -m bench lb --hidden 2048 --inter 1024 --json out.json

Workload: every rank owns ``--num-local-experts`` experts, each a SwiGLU expert's weights flattened
into one row of ``3 x hidden x inter`` BF16 elements (``w1``, ``w3`` ``[inter, hidden]``, ``w2``
``[hidden, inter]``), and holds ``--num-redundant-experts`` replica slots; slot ``c`` of rank ``l``
replicates local expert ``c mod L`` of rank ``(l + 1 + c mod (R - 1)) mod R`` (the next ranks, never
itself, so every rank sends and receives). Gradients are float32 rows of the same length.

* ``prefetch``: the owners' weights into the replicas' slots (``lb_prefetch_weights``; the peers:
  each owner ``Isend``s its experts to their replicas, each replica ``Irecv``s into its slots);
* ``reduce``: the replicas' gradients added onto the owners' (``lb_reduce_grads``: the owner's own
  gradient, then each replica's in ascending (rank, slot) order, float32; the peers receive the
  replicas' rows into a scratch and add them in the same order). The owners' gradients are reset to
  the seed outside the timed region.

Each call is timed between barriers, the max over ranks per iteration, median over ``--iters``.
GB/s: the bytes that cross ranks per rank per call (this rank's replica rows for ``prefetch``; the
replica rows of this rank's experts for ``reduce``), busiest rank; DeepEP publishes no byte formula
for these calls, so this is ours (docs/benchmarks.md). Every system's slots and gradients are
checked against the values regenerated from the seed, bit for bit (the peers add in the same
order): exit code 1 if any differs; a system that fails is left out of every ratio.
"""
from __future__ import annotations

import sys

import torch

from bench import cli, schema
from bench.timing import time_phases

SYSTEMS = ("lb", "mpi", "gloo")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, hidden=1024, iters=10, warmup=2, seed=0, json=None,
                   helps=dict(hidden="each expert row holds 3 x hidden x inter elements"))
    p.add_argument("--inter", type=cli.int_at_least(1), default=512, metavar="I",
                   help="expert intermediate size (default 512)")
    p.add_argument("--num-local-experts", type=cli.int_at_least(1), default=4, metavar="L",
                   help="experts each rank owns (default 4)")
    p.add_argument("--num-redundant-experts", type=cli.int_at_least(1), default=2, metavar="S",
                   help="replica slots per rank (default 2)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)} (default: all); lb = EPBuffer.lb_*, "
                        "mpi = MPI Isend/Irecv, gloo = torch.distributed gloo isend/irecv")


def check_args(p, a) -> None:
    """The system list (``p.error``, argparse's usage error)."""
    a.systems = cli.system_list(p, a.systems, SYSTEMS)


class Plan:
    """Who replicates what: ``owner[l][c]`` / ``expert[l][c]`` of slot ``c`` on rank ``l`` (-1: empty on one rank)."""

    def __init__(self, num_ranks: int, num_local: int, num_slots: int):
        self.R, self.L, self.S = num_ranks, num_local, num_slots
        self.owner = [[(q + 1 + c % (num_ranks - 1)) % num_ranks if num_ranks > 1 else -1 for c in range(num_slots)]
                      for q in range(num_ranks)]
        self.expert = [[c % num_local for c in range(num_slots)] for _ in range(num_ranks)]

    def mapping(self) -> torch.Tensor:
        """DeepEP's ``redundancy_mapping`` ``[R, S]`` int32: node-local global expert ids, -1 empty."""
        return torch.tensor([[o * self.L + e if o >= 0 else -1 for o, e in zip(os_, es)]
                             for os_, es in zip(self.owner, self.expert)], dtype=torch.int32)

    def replicas_of(self, rank: int) -> list[tuple[int, int, int]]:
        """``(replica rank, slot, local expert)`` of this rank's experts, ascending (rank, slot)."""
        return [(q, c, self.expert[q][c]) for q in range(self.R) for c in range(self.S) if self.owner[q][c] == rank]


def _weights(seed: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 65536 + rank)
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def _grads(seed: int, rank: int, rows: int, cols: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 65536 + rank * 16 + salt + 1)
    return torch.randn(rows, cols, generator=g)


def _expected_grads(plan: Plan, seed: int, rank: int, cols: int) -> torch.Tensor:
    """This rank's owner gradients after one reduce: its seed, then each replica row in (rank, slot) order."""
    out = _grads(seed, rank, plan.L, cols, 0)
    for q, c, e in plan.replicas_of(rank):
        out[e] += _grads(seed, q, plan.S, cols, 1)[c]
    return out


class _Peer:
    """The same two calls over point-to-point messages: ``send`` / ``recv`` / ``wait`` of mpi or gloo."""

    def __init__(self, plan: Plan, rank: int, isend, irecv, wait):
        self.plan, self.rank = plan, rank
        self.isend, self.irecv, self.wait = isend, irecv, wait

    def prefetch(self, slots: torch.Tensor, weights: torch.Tensor) -> None:
        p, me = self.plan, self.rank
        reqs = [self.irecv(slots[c], p.owner[me][c]) for c in range(p.S) if p.owner[me][c] >= 0]
        reqs += [self.isend(weights[e], q) for q, _, e in p.replicas_of(me)]
        self.wait(reqs)

    def reduce(self, slot_grads: torch.Tensor, grads: torch.Tensor, scratch: torch.Tensor) -> None:
        p, me = self.plan, self.rank
        mine = p.replicas_of(me)
        reqs = [self.irecv(scratch[i], q) for i, (q, _, _) in enumerate(mine)]
        reqs += [self.isend(slot_grads[c], p.owner[me][c]) for c in range(p.S) if p.owner[me][c] >= 0]
        self.wait(reqs)
        for i, (_, _, e) in enumerate(mine):  # the same order as lb_reduce_grads
            grads[e] += scratch[i]


def _mpi_peer(comm, plan: Plan) -> _Peer:
    from mpi4py import MPI

    def buf(t):
        return [t.view(torch.uint8).numpy(), MPI.BYTE]

    # one tag per (slot) keeps the pairs apart when a rank exchanges several rows with one peer
    return _Peer(plan, comm.Get_rank(), lambda t, dst: comm.Isend(buf(t), dest=dst, tag=7),
                 lambda t, src: comm.Irecv(buf(t), source=src, tag=7), MPI.Request.Waitall)


def _gloo_peer(plan: Plan, rank: int) -> _Peer:
    import torch.distributed as dist

    def wait(works):
        for w in works:
            w.wait()
    return _Peer(plan, rank, lambda t, dst: dist.isend(t, dst), lambda t, src: dist.irecv(t, src), wait)


def run(args) -> int:
    """Run both calls of every system (collective); rank 0 prints and writes the results. Returns 1 if
    a slot or a gradient differs from the expected one, else 0."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    import deepep_ascend

    comm = MPI.COMM_WORLD
    r, R = comm.Get_rank(), comm.Get_size()
    plan = Plan(R, args.num_local_experts, args.num_redundant_experts)
    cols = 3 * args.hidden * args.inter
    L, S = plan.L, plan.S
    weights = _weights(args.seed, r, L, cols)
    seed_grads = _grads(args.seed, r, L, cols, 0)
    slot_grad_values = _grads(args.seed, r, S, cols, 1)
    expect_slots = torch.zeros(S, cols, dtype=torch.bfloat16)
    for c in range(S):
        if plan.owner[r][c] >= 0:
            expect_slots[c] = _weights(args.seed, plan.owner[r][c], L, cols)[plan.expert[r][c]]
    expect_grads = _expected_grads(plan, args.seed, r, cols)
    mine = plan.replicas_of(r)
    bytes_prefetch = comm.allreduce(sum(plan.owner[r][c] >= 0 for c in range(S)) * cols * 2, op=MPI.MAX)
    bytes_reduce = comm.allreduce(len(mine) * cols * 4, op=MPI.MAX)

    systems, cleanup, skipped = {}, [], {}
    if "lb" in args.systems:
        alloc = deepep_ascend.BufferAllocator()
        slots = alloc.allocate((S, cols), torch.bfloat16)
        slot_grads = alloc.allocate((S, cols), torch.float32)
        buf = deepep_ascend.EPBuffer(comm, num_max_tokens_per_rank=1, hidden=128, num_topk=1,
                                     lb_allocation_plan_or_num_bytes=alloc, explicitly_destroy=True)
        mapping = plan.mapping()
        systems["lb"] = (slots, slot_grads,
                         lambda s, w: buf.lb_prefetch_weights(s, w, mapping).wait(),
                         lambda sg, g, _: buf.lb_reduce_grads(sg, g, mapping).wait())
        cleanup.append(buf.destroy)  # the LB tensors stay valid while referenced
        if buf.num_nvlink_ranks != R:  # the same on every rank: all leave here together
            for f in cleanup:
                f()
            if r == 0:
                print(f"bench lb: needs one node (the load-balance domain is the node, and the plan places replicas on "
                      f"all {R} ranks), got {buf.num_rdma_ranks} nodes of {buf.num_nvlink_ranks} rank(s); unset "
                      f"DEEPEP_ASCEND_RANKS_PER_NODE or set it to {R}", file=sys.stderr)
            return 2
    scratch = torch.empty(max(1, len(mine)), cols)
    if "mpi" in args.systems:
        peer = _mpi_peer(comm, plan)
        systems["mpi_isend"] = (torch.zeros(S, cols, dtype=torch.bfloat16), torch.empty(S, cols),
                                peer.prefetch, peer.reduce)
    group = None
    if "gloo" in args.systems and R == 1:
        skipped["gloo_isend"] = "gloo cannot send to its own rank"
    elif "gloo" in args.systems:
        from bench.baselines import start_gloo

        group = start_gloo(comm)
        peer = _gloo_peer(plan, r)
        systems["gloo_isend"] = (torch.zeros(S, cols, dtype=torch.bfloat16), torch.empty(S, cols),
                                 peer.prefetch, peer.reduce)

    results, failed, summary = [], {}, {}
    grads = torch.empty_like(seed_grads)
    for name, (slots, slot_grads, prefetch, reduce) in list(systems.items()):
        slot_grads.copy_(slot_grad_values)

        def reset(grads=grads):
            grads.copy_(seed_grads)

        t = time_phases([("prefetch", lambda: prefetch(slots, weights)), (None, reset),
                         ("reduce", lambda: reduce(slot_grads, grads, scratch))], comm, args.iters, args.warmup)
        bad = []
        if not torch.equal(slots, expect_slots):
            bad.append("replica slots")
        if not torch.equal(grads, expect_grads):
            bad.append("owner gradients")
        bad_ranks = [i for i, b in enumerate(comm.allgather(bad)) if b]
        if bad_ranks:
            failed[name] = f"{' and '.join(bad)} differ from the seed's on rank(s) {bad_ranks}"
        for phase, nbytes in (("prefetch", bytes_prefetch), ("reduce", bytes_reduce)):
            results.append(schema.result(f"{name}/{phase}", None, timing=t[phase], nbytes=nbytes,
                                         formula="bytes crossing ranks per call, busiest rank (bench/lb.py)"))
    peers = [p for p in ("mpi_isend", "gloo_isend") if p in systems]
    by = {x["name"]: x for x in results}
    for phase in ("prefetch", "reduce"):
        names = [f"{s}/{phase}" for s in systems]
        for n in names:
            schema.add_ratios(results, n, names)
        ok_peers = [p for p in peers if p not in failed]
        if "lb" in systems and "lb" not in failed and ok_peers:
            faster = min(by[f"{p}/{phase}"]["seconds"] for p in ok_peers)
            summary[f"speedup_over_faster_peer_{phase}"] = faster / by[f"lb/{phase}"]["seconds"]
    ok = not failed
    for fn in cleanup:
        fn()
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()

    if r == 0:
        print(f"[lb] {R} ranks, {L} experts per rank, {S} replica slots per rank, expert row {cols} elements "
              f"(3 x {args.hidden} x {args.inter}): weights {cols * 2} B BF16, gradients {cols * 4} B float32; "
              f"per call, max over ranks, median of {args.iters}", flush=True)
        schema.print_results(results, skipped, summary, ok, {k: 1 for k in failed}, width=20, failed=failed)
        if args.json:
            schema.write(args.json, schema.document(
                "lb", argv=args._argv, params=cli.params_of(args, R), results=results,
                baselines=[x["name"] for x in results if x["system"] in peers],
                checks=dict(ok=ok), summary=summary, failed=failed,
                details=dict(mapping=plan.mapping().tolist(), expert_elements=cols, skipped=skipped,
                             prefetch_bytes=bytes_prefetch, reduce_bytes=bytes_reduce)))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench lb`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("lb", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("lb")
