"""``PPBuffer`` (DeepEP V2.5 pipeline-parallel send / recv) around the ring, with DeepEP's byte formulas,
against MPI ``Isend``/``Irecv`` and torch gloo ``isend``/``irecv`` moving the same tensors in the same run.

Run under ``mpiexec`` (any number of ranks; one rank sends to itself, without gloo, which cannot)::

    mpiexec -n 4 python -m bench pp                          # 512 x 2048 BF16 tensors (2 MiB), 4 in flight
    mpiexec -n 4 python -m bench pp --ranks-per-node 2       # the ring crosses two simulated nodes (URMA)

Each measured step, as DeepEP's ``tests/pp/test_pp.py`` profiles it, for ``concurrent`` = 1 ..
min(3, ``--num-max-inflight-tensors``) and both ``hide`` settings: every rank sends ``concurrent``
tensors of ``--num-tokens x --hidden`` BF16 to its next rank, then receives as many from its previous
rank. ``hide=1`` lets the transfers land first (a barrier, DeepEP sleeps), so ``recv`` only copies out;
``hide=0`` receives at once. Times are per call (a step's sends or receives divided by ``concurrent``),
the max over ranks per iteration, the median over iterations. GB/s by DeepEP's formulas:
``send = 2 x tensor bytes / t``, ``recv = (2 if hide else 1) x tensor bytes / t``.

The ring step (``<system>/ring_c<c>``: the ``hide=0`` step's sends and receives, per tensor) is what the
peers are compared on: the same tensors sent to the next rank and received from the previous by MPI
``Isend``/``Irecv`` (``mpi_isend``) and gloo ``isend``/``irecv`` (``gloo_isend``), ``bytes`` = one tensor.
Every system's received tensors, the peers' too, are checked against the sender's (regenerated from the seed)
on every rank: exit code 1 if any differs, and a system whose tensors differ is left out of every ratio and
of the summary (``EXCLUDED`` in the output, ``summary.excluded`` and ``"verified": false`` in the JSON).
``--json FILE``: the results, the peers as baselines, the summary ``speedup_over_faster_peer_c<c>`` (per
``concurrent``, over the verified peers).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from bench import cli, schema
from bench.timing import Timing, each_step

SYSTEMS = ("pp", "mpi", "gloo")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, num_tokens=512, hidden=2048, iters=10, warmup=2, seed=0, json=None, ranks_per_node=None,
                   helps=dict(seed="per rank: seed*65536+rank", num_tokens="rows of each BF16 tensor sent"))
    p.add_argument("--num-max-inflight-tensors", type=cli.int_at_least(1), default=4, metavar="N",
                   help="PPBuffer's num_max_inflight_tensors (default 4, DeepEP's test default)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)} (default: all); pp = PPBuffer, "
                        "mpi = MPI Isend/Irecv, gloo = torch.distributed gloo isend/irecv")


def check_args(p, a) -> None:
    """The system list (``p.error``, argparse's usage error)."""
    a.systems = cli.system_list(p, a.systems, SYSTEMS)


def _tensors(seed: int, rank: int, count: int, shape) -> list:
    g = torch.Generator().manual_seed(seed * 65536 + rank)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(count)]


class _Step:
    """One system's ring step: ``send(tensors)`` to the next rank, ``recv(outs)`` from the previous."""

    def __init__(self, send, recv):
        self.send, self.recv = send, recv


def _pp_step(buf, nxt, prv) -> _Step:
    def send(ts):
        for t in ts:
            buf.send(t, nxt)

    def recv(outs):
        for o in outs:
            buf.recv(o, prv)
    return _Step(send, recv)


def _mpi_step(comm, nxt, prv) -> _Step:
    from mpi4py import MPI

    pending = []

    def send(ts):  # Isend returns at once; the step's receives complete them
        pending.extend(comm.Isend([t.view(torch.uint8).numpy(), MPI.BYTE], dest=nxt, tag=11) for t in ts)

    def recv(outs):
        reqs = [comm.Irecv([o.view(torch.uint8).numpy(), MPI.BYTE], source=prv, tag=11) for o in outs]
        MPI.Request.Waitall(reqs + pending)
        pending.clear()
    return _Step(send, recv)


def _gloo_step(nxt, prv) -> _Step:
    import torch.distributed as dist

    pending = []

    def send(ts):
        pending.extend(dist.isend(t, nxt) for t in ts)

    def recv(outs):
        works = [dist.irecv(o, prv) for o in outs]
        for w in works + pending:
            w.wait()
        pending.clear()
    return _Step(send, recv)


def _time_step(step: _Step, comm, sends, outs, hide: bool, iters: int, warmup: int) -> tuple[Timing, Timing]:
    """Per-call send and recv times (max over ranks per iteration) of ``iters`` ring steps
    (:func:`bench.timing.each_step`, after its warm-up)."""
    from mpi4py import MPI

    def ring_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        step.send(sends)
        t1 = time.perf_counter()
        if hide:  # every transfer landed before the receives start (DeepEP sleeps instead)
            comm.Barrier()
        t2 = time.perf_counter()
        step.recv(outs)
        t3 = time.perf_counter()
        return (t1 - t0) / len(sends), (t3 - t2) / len(sends)

    rows = each_step([("ring", ring_step)], comm, iters, warmup, lambda fn: fn())
    local = np.array([row["ring"] for row in rows], dtype=np.float64).reshape(iters, 2).T.copy()
    glob = np.empty_like(local)
    comm.Allreduce(local, glob, op=MPI.MAX)
    return Timing(glob[0].tolist()), Timing(glob[1].tolist())


def run(args) -> int:
    """Run the ring steps of every system (collective); rank 0 prints and writes the results. Returns 1
    if a received tensor differs from the one sent, else 0."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    from deepep_ascend import PPBuffer
    from deepep_ascend.transports import Topology

    comm = MPI.COMM_WORLD
    r, R = comm.Get_rank(), comm.Get_size()
    nxt, prv = (r + 1) % R, (r - 1) % R
    shape = (args.num_tokens, args.hidden)
    nbytes = args.num_tokens * args.hidden * 2
    k = args.num_max_inflight_tensors
    concurrents = list(range(1, min(3, k) + 1))
    sends = _tensors(args.seed, r, max(concurrents), shape)
    expected = _tensors(args.seed, prv, max(concurrents), shape)
    nodes = Topology.from_comm(comm, args.ranks_per_node).num_nodes

    steps, cleanup = {}, []
    if "pp" in args.systems:
        buf = PPBuffer(comm, nbytes, k, explicitly_destroy=True, ranks_per_node=args.ranks_per_node)
        steps["pp"] = _pp_step(buf, nxt, prv)
        cleanup.append(buf.destroy)
    if "mpi" in args.systems:
        steps["mpi_isend"] = _mpi_step(comm, nxt, prv)
    group = None
    skipped = {}
    if "gloo" in args.systems and R == 1:
        skipped["gloo_isend"] = "gloo cannot send to its own rank"
    elif "gloo" in args.systems:
        from bench.baselines import start_gloo

        group = start_gloo(comm)
        steps["gloo_isend"] = _gloo_step(nxt, prv)

    results, mismatches, summary = [], {}, {}
    for system, step in steps.items():
        for c in concurrents:
            for hide in ((True, False) if system == "pp" else (False,)):
                # NaN-filled: a receive that writes nothing cannot pass on memory that held an earlier step's data
                outs = [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(c)]
                t_send, t_recv = _time_step(step, comm, sends[:c], outs, hide, args.iters, args.warmup)
                bad = sum(not torch.equal(o, e) for o, e in zip(outs, expected))
                mismatches[system] = mismatches.get(system, 0) + int(comm.allreduce(bad))
                if system == "pp":
                    h = int(hide)
                    results.append(schema.result(f"pp/send_c{c}_hide{h}", None, timing=t_send, nbytes=2 * nbytes,
                                                 formula="DeepEP tests/pp: 2 x tensor bytes per send"))
                    results.append(schema.result(
                        f"pp/recv_c{c}_hide{h}", None, timing=t_recv, nbytes=(2 if hide else 1) * nbytes,
                        formula=f"DeepEP tests/pp: {2 if hide else 1} x tensor bytes per recv"))
                if not hide:
                    results.append(schema.result(f"{system}/ring_c{c}", None, timing=t_send + t_recv, nbytes=nbytes,
                                                 formula="tensor bytes per rank per ring step (send + recv)"))
    failed = {s: f"{n} received tensor(s) differ from the sender's, summed over ranks and steps"
              for s, n in mismatches.items() if n}
    peers = [p for p in ("mpi_isend", "gloo_isend") if p in steps]
    trusted = list(schema.trusted(dict.fromkeys(peers), failed))  # a peer that failed takes part in no ratio
    by = {x["name"]: x for x in results}
    for c in concurrents:
        if "pp" in steps and "pp" not in failed:
            schema.add_ratios(results, f"pp/ring_c{c}", [f"{p}/ring_c{c}" for p in trusted])
            if trusted:
                faster = min(by[f"{p}/ring_c{c}"]["seconds"] for p in trusted)
                summary[f"speedup_over_faster_peer_c{c}"] = faster / by[f"pp/ring_c{c}"]["seconds"]
    ok = not failed
    for fn in cleanup:
        fn()
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()

    if r == 0:
        print(f"[pp] {R} ranks ({nodes} node{'s' if nodes > 1 else ''}), tensors {shape[0]} x {shape[1]} BF16 = "
              f"{nbytes} B, {k} in flight; per call, max over ranks, median of {args.iters}", flush=True)
        schema.print_results(results, skipped, summary, ok, mismatches, width=22, failed=failed)
        if args.json:
            schema.write(args.json, schema.document(
                "pp", argv=args._argv, params=cli.params_of(args, R), results=results,
                baselines=[x["name"] for x in results if x["system"] in peers],
                checks=dict(ok=ok, mismatched_tensors=mismatches), summary=summary, failed=failed,
                details=dict(nodes=nodes, tensor_bytes=nbytes, skipped=skipped, concurrent=concurrents,
                             timed="per call: a step's sends or receives / concurrent; max over ranks")))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench pp`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("pp", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("pp")
