"""The low-latency dispatch's receive with and without streaming stores, and the experts' first read after it.

    python -m bench ll-receive [--num-tokens 128] [--hidden 7168] [--num-topk 8] [--num-experts 256]
                               [--sources 2] [--read gather|decode] [--evict-mb 1024] [--iters 20]

One process, one thread, standing for rank 0 of ``--sources`` ranks: each rank's FP8 messages of ``--num-tokens`` tokens
(:func:`deepep_ascend.native.ll_cast_messages` of ``bench.workload``'s ``x``) lie in its send region, its routed
token indices and counts in rank 0's index table (:func:`deepep_ascend.native.ll_route`,
:func:`deepep_ascend.native.ll_dispatch_send`), as a low-latency dispatch on one node leaves them. Timed, in turn for
each store mode of :func:`deepep_ascend.native.ll_stream_rows` (``never``, the baseline of the ratios; ``large``, the
library's default, which streams when the received rows take at least :func:`deepep_ascend.native.ll_stream_min_bytes`,
the threshold in force (``DEEPEP_ASCEND_LL_STREAM_MIN_BYTES``, 16 MiB unless set); and ``always``):

* ``receive``: :func:`deepep_ascend.native.ll_dispatch_recv`, every row routed to rank 0 loaded into ``recv_x``
  ``[L, R·M, H]`` e4m3 with its scales and ``src_info`` (the receive of ``Buffer.low_latency_dispatch``);
* ``read``: the experts' first read of those rows, into one reused output: ``gather`` (the default) copies them
  into ``[rows, H]`` (``torch.index_select``: memory traffic alone, where a slower read shows most), ``decode``
  gathers and decodes them to BF16 (:func:`deepep_ascend.native.dequant_rows_e4m3`, as an FP8 expert begins);

in two regimes: ``warm``, each mode's calls back to back (the call before left ``recv_x``'s rows, reused as the
pool reuses them, cached or, streamed, not), and ``cold``, with ``--evict-mb`` MB written once before each call,
untimed (a model's other layers between two dispatches leave the cache to their own data). The modes take turns in
blocks of up to 5 calls after 2 untimed ones, until ``--iters`` calls of each are timed; medians. Then, for each
mode, the outputs are filled with a byte pattern, received once more and compared with ``never``'s, bit for bit
(exit code 1 if they differ). Rows below 256 bytes (``--hidden`` under 256) are copied by ``memcpy`` in every mode,
so the modes then time the same code. ``--json FILE``: results ``<mode>/<regime>/{receive,read,total}``, the
``never`` ones the baselines (none, with ``checks.native`` false, where the kernels are not loaded).

docs/design/data-path.md, "Streaming stores into ``recv_x``", reads these times and says why ``large`` is the
default.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import cli, schema
from bench.workload import make_workload
from deepep_ascend import native as N

MODES = N.LL_STREAM_MODES  # never (the baseline of the ratios), large, always
REGIMES = ("warm", "cold")
PARTS = ("receive", "read", "total")
BLOCK, BLOCK_WARMUP = 5, 2  # timed calls of one mode in a row, after untimed ones


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--sources", type=cli.int_at_least(1), default=2,
                   help="ranks whose messages rank 0 receives, itself included (default 2)")
    p.add_argument("--read", choices=("gather", "decode"), default="gather",
                   help="the experts' first read: gather the rows (default) or gather and decode them to BF16")
    p.add_argument("--evict-mb", type=cli.int_at_least(1), default=1024,
                   help="MB written before each call of the cold regime, untimed (default 1024: past this host's "
                        "caches)")
    cli.add_shared(p, num_tokens=128, hidden=7168, num_topk=8, num_experts=256, iters=20, seed=0, json=None)


def check_args(p, args) -> None:
    """``p.error`` for a shape the low-latency FP8 dispatch refuses."""
    if args.hidden % 128:
        p.error(f"--hidden must be a multiple of 128 (the FP8 scale group), got {args.hidden}")
    if args.num_experts % args.sources:
        p.error(f"--num-experts ({args.num_experts}) must be a multiple of --sources ({args.sources})")
    if args.num_topk > args.num_experts:
        p.error(f"--num-topk ({args.num_topk}) must be at most --num-experts ({args.num_experts})")


class _Receive:
    """Rank 0's receive of one dispatch from ``R`` ranks' send regions, and the read of its rows."""

    def __init__(self, args):
        R, M, H, E = args.sources, args.num_tokens, args.hidden, args.num_experts
        L, sw = E // R, H // 128
        self.R, self.L, self.M, self.H, self.sw = R, L, M, H, sw
        self.mb = N.ll_cast_message_bytes(H, False)
        index_off = 4 * R * L
        self.send_off = index_off + 4 * L * R * M
        self.wins = [torch.zeros(self.send_off + M * self.mb, dtype=torch.uint8) for _ in range(R)]
        self.bases = torch.tensor([w.data_ptr() for w in self.wins], dtype=torch.int64)
        for s in range(R):
            wl = make_workload(M, H, args.num_topk, E, s, R, seed=args.seed)
            N.ll_cast_messages(wl.x, self.wins[s][self.send_off:].view(M, self.mb), False, False)
            _, _, counts, slots = N.ll_route(wl.topk_idx, E, M)
            N.ll_dispatch_send(slots, M, L, s, self.bases, None, index_off, 4 * s * L, counts,
                               torch.zeros(R, dtype=torch.int64))
        self.sig = self.wins[0][:index_off].view(torch.int32).view(R, L)
        self.index = self.wins[0][index_off:self.send_off].view(torch.int32)
        self.stamp_words = torch.zeros(R, dtype=torch.int64)  # the sources' seqlock stamps (never moved here)
        self.stamps = torch.tensor([self.stamp_words.data_ptr() + 8 * s for s in range(R)], dtype=torch.int64)
        # one set of outputs, reused call after call as the pool reuses them
        RM = R * M
        self.out = (torch.zeros(L, RM, H, dtype=torch.uint8),
                    torch.zeros(L, sw, RM, dtype=torch.float32).transpose(1, 2),
                    torch.zeros(L, RM, dtype=torch.int32), torch.zeros(L, dtype=torch.int32),
                    torch.zeros(L, R, dtype=torch.int64))
        self.receive()
        self.rows = int(self.out[3].sum())
        # the received rows of every expert, [0, recv_count[e]) of block e
        self.read_index = torch.cat([torch.arange(c) + e * RM for e, c in enumerate(self.out[3].tolist())])
        self.decode = args.read == "decode"
        self.read_out = torch.empty(self.rows, H, dtype=torch.bfloat16 if self.decode else torch.uint8)
        self.read_scales = torch.full((L * RM, H // 32), 127, dtype=torch.uint8)  # UE8M0 1.0, for the decode

    def receive(self) -> None:
        """One receive into the outputs."""
        status, _ = N.ll_dispatch_recv(self.sig, None, self.index, self.bases, self.send_off, self.stamps, 0, self.M,
                                       self.mb, *self.out)
        if status:
            raise RuntimeError(f"ll_dispatch_recv returned status {status}")

    def read(self) -> None:
        """The experts' first read of the received rows: gathered, or gathered and decoded to BF16."""
        rows = self.out[0].view(-1, self.H)
        if self.decode:
            N.dequant_rows_e4m3(self.read_out, rows, self.read_scales, self.read_index)
        else:
            torch.index_select(rows, 0, self.read_index, out=self.read_out)


def run(args) -> int:
    """Time the receive and the read in both regimes and every mode (one process); exit 1 if outputs differ."""
    torch.set_num_threads(1)
    if not N.ll_available():
        print("[ll-receive] native kernels not available: nothing to time")
        if args.json:
            schema.write(args.json, schema.document(
                "ll-receive", argv=args._argv, params=cli.params_of(args, 1), results=[], baselines=[],
                checks=dict(ok=True, native=False), summary={}, mpi=False))
        return 0
    rc = _Receive(args)
    evict = torch.zeros(args.evict_mb << 18, dtype=torch.int32)
    before = N.ll_stream_rows()
    xb, threshold = rc.rows * args.hidden, N.ll_stream_min_bytes()
    print(f"[config] rank 0 of {args.sources}: {args.num_tokens} tokens per rank, hidden {args.hidden}, top-"
          f"{args.num_topk} of {args.num_experts} experts, FP8; {rc.rows} rows received ({xb / 1e6:.2f} MB of codes; "
          f"'large' streams from {threshold / 1e6:.2f} MB); read: {args.read}; cold: {args.evict_mb} MB written "
          f"before each call; 1 thread, median of {args.iters}, modes in turn, up to {BLOCK} calls each after "
          f"{BLOCK_WARMUP} untimed")
    times = {(m, r, p): [] for m in MODES for r in REGIMES for p in PARTS}
    got = {}
    try:
        for regime in REGIMES:
            while (left := args.iters - len(times["never", regime, "total"])) > 0:
                for mode in MODES:
                    N.ll_stream_rows(mode)
                    for it in range(BLOCK_WARMUP + min(BLOCK, left)):
                        if regime == "cold":
                            evict.add_(1)
                        t0 = time.perf_counter()
                        rc.receive()
                        t1 = time.perf_counter()
                        rc.read()
                        t2 = time.perf_counter()
                        if it >= BLOCK_WARMUP:
                            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t2 - t0)):
                                times[mode, regime, part].append(dt)
        for mode in MODES:  # each mode's outputs from a receive into a pattern none of them leaves
            N.ll_stream_rows(mode)
            for t in rc.out:  # (the scales are a transposed view of a dense tensor)
                (t if t.is_contiguous() else t.transpose(1, 2)).view(torch.uint8).fill_(0xA5)
            rc.receive()
            got[mode] = [t.clone() for t in rc.out]
    finally:
        N.ll_stream_rows(before)
    same = all(torch.equal(a, b) for mode in MODES for a, b in zip(got[mode], got["never"]))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    records = []
    for regime in REGIMES:
        for mode in MODES:
            cells = " | ".join(f"{part} {med[mode, regime, part] * 1e6:8.1f} us" for part in PARTS)
            ratio = med[mode, regime, "total"] / med["never", regime, "total"]
            print(f"[time]   {regime:4} {mode:6}: {cells} | total / never's {ratio:5.2f}x")
            for part in PARTS:
                name = f"{mode}/{regime}/{part}"
                records.append(schema.result(name, med[mode, regime, part], nbytes=xb, formula="FP8 codes received"))
                if mode != "never":
                    schema.add_ratios(records, name, [f"never/{regime}/{part}"])
    print(f"[check]  every mode's recv_x, scales, src_info, recv_count and layout_range equal never's: {same}")
    if args.json:
        schema.write(args.json, schema.document(
            "ll-receive", argv=args._argv, params=dict(cli.params_of(args, 1), stream_min_bytes=threshold),
            results=records,
            baselines=[f"never/{r}/{p}" for r in REGIMES for p in PARTS], checks=dict(ok=bool(same)), summary={},
            mpi=False))
    return 0 if same else 1


def main(argv=None) -> int:
    """``python -m bench ll-receive`` in-process (tests)."""
    from bench import commands

    return commands.call("ll-receive", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("ll-receive")
