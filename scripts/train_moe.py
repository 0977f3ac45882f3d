#!/usr/bin/env python
"""Train a small byte-level MoE language model with expert parallelism over ``deepep_ascend.Buffer``.

    mpiexec -n 4 python scripts/train_moe.py                      # ~2-4 min on a 2-core VM
    mpiexec -n 4 python scripts/train_moe.py --moe-mode expanded  # EPBuffer (DeepEP V2.5), expanded layout
    mpiexec -n 4 python scripts/train_moe.py --save-trace bench/traces/stdlib_moe_4r.npz
    mpiexec -n 4 python scripts/train_moe.py --steps 100 --save-dir ckpt   # checkpoint every --save-every
    mpiexec -n 4 python scripts/train_moe.py --steps 200 --resume ckpt     # continue from step 100

Data: the Python standard library's own ``.py`` files (``sysconfig.get_paths()['stdlib']``,
without ``site-packages`` and test directories), read in sorted path order up to ``--data-mb``
megabytes and used as one byte stream; the last 2 % is held out for a validation loss.
``--text synthetic`` trains on a generated toy grammar instead (no files; used by the tests).

Model: bytes → embedding (+ learned positions) → ``--layers`` × [RMSNorm → causal self-attention
→ RMSNorm → :class:`deepep_ascend.nn.moe.MoE`] → RMSNorm → byte logits. The MoE block is DeepSeek's:
gate (softmax or sigmoid, optional group-limited routing), ``--experts`` routed SwiGLU experts
(``--topk`` per token) spread over the EP group, one shared expert; tokens travel with
``deepep_ascend.nn.autograd.dispatch`` / ``combine`` (one ``Buffer`` for all layers), or with
``--moe-mode low_latency`` with ``low_latency_dispatch`` / ``low_latency_combine`` (a
``low_latency_mode`` Buffer; ``num_max_dispatch_tokens_per_rank`` = ``--batch`` x ``--seq``, at most 511), or
with ``--moe-mode expanded`` over an ``EPBuffer`` (DeepEP V2.5): ``ep_dispatch(do_expand=True,
do_zero_padding=True)`` / ``ep_combine``, the experts on the expanded layout.

Parallelism: every rank is one EP rank (``--ep``, default all ranks) and one data-parallel
replica: it draws its own batch (``--batch`` sequences of ``--seq`` bytes, from a generator
seeded by ``(seed, step, rank)``, so a resumed run sees the same batches). Dense (non-expert)
gradients are all-reduced over all ranks with gloo and averaged; expert gradients already hold
every rank's contribution (the backward combine brings them), summed over expert replicas when
``--ep`` is smaller than the world, and divided by the world size, so the update equals that of
one process training on the union of the batches.

Logging: a tqdm bar on rank 0 (loss, global tokens/s), a line every ``--log-every`` steps, the
validation loss at the end, and ``--log-json FILE`` (per-step loss and time).

Routing traces: ``--save-trace FILE.npz`` records every MoE layer's ``topk_idx`` at steps
``0, E, 2E, ...`` (``E`` = ``--trace-every``) and at the last step, gathered over ranks
(rank-major rows), as ``topk_idx [S·L, T, K]`` (int8 if ``E < 128`` else int16; entry ``i`` is
step ``trace_step[i]``, layer ``trace_layer[i]``) plus ``num_experts`` — the format of
``bench/routing.py``, so ``mpiexec -n 4 python -m bench normal --routing FILE [--routing-step i]``
replays it.

Checkpoints (``--save-dir DIR``, every ``--save-every`` steps and at the end) go to
``DIR/step{N:06d}/``: ``dense.pt`` written by rank 0 (non-expert weights, their AdamW state, the
step, the run's ``--steps``, the model arguments) and ``experts_ep{r}.pt`` per EP rank (its
experts and their AdamW state); ``DIR/latest`` names the newest. ``--resume DIR`` (or a step
directory) loads them (same model arguments and EP size; otherwise, or if a file is missing,
every rank exits with status 2 and the reason) and continues at the saved step; learning rate
and data depend only on the step, so the resumed losses equal those of an uninterrupted run
(bit for bit on the same rank count: every reduction here has a fixed order). ``--stop-at N``
ends the run after step ``N`` as an interruption would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from deepep_ascend import Buffer, EPBuffer
from deepep_ascend.nn import dist as ep_dist
from deepep_ascend.nn.moe import MoE, is_expert_param
from deepep_ascend.transports import Topology
from deepep_ascend.transports.process import abort_job, exit_job

# Arguments that define the model (checked on resume).
MODEL_ARGS = ("d_model", "layers", "heads", "seq", "experts", "topk", "expert_dim", "shared", "score_func",
              "n_group", "topk_group", "routed_scaling", "seed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="scripts/train_moe.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--steps", type=int, default=300, help="optimizer steps in total (default 300)")
    a("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    a("--seq", type=int, default=128, help="bytes per sequence (default 128)")
    a("--d-model", type=int, default=128)
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--experts", type=int, default=16, help="routed experts in total (multiple of --ep)")
    a("--topk", type=int, default=2)
    a("--expert-dim", type=int, default=128, help="intermediate width of each routed expert")
    a("--shared", type=int, default=1, help="shared experts (0 = none; width --shared x --expert-dim)")
    a("--score-func", choices=("softmax", "sigmoid"), default="softmax")
    a("--n-group", type=int, default=1, help="expert groups for group-limited routing (1 = off)")
    a("--topk-group", type=int, default=1, help="groups kept per token with --n-group > 1")
    a("--routed-scaling", type=float, default=1.0, help="routed_scaling_factor")
    a("--experts-impl", choices=("loop", "grouped"), default="loop",
      help="routed experts: float32 matmul per local expert (default; fastest on CPU) or the BF16 grouped GEMMs "
           "of deepep_ascend.gemm.grouped (slower on CPU ranks: bf16 matmuls)")
    a("--moe-mode", choices=("normal", "low_latency", "expanded"), default="normal",
      help="EP communication: normal dispatch/combine (default), the low-latency pair "
           "(--batch x --seq tokens per rank at most 511), or EPBuffer's expanded layout (DeepEP V2.5)")
    a("--aux-loss", type=float, default=0.01, help="balance-loss coefficient (0 = off)")
    a("--lr", type=float, default=3e-3)
    a("--warmup", type=int, default=20, help="linear warm-up steps; then cosine decay to 10%% at --steps")
    a("--weight-decay", type=float, default=0.01)
    a("--seed", type=int, default=0)
    a("--ep", type=int, default=None, help="EP group size (default: all ranks)")
    a("--text", choices=("stdlib", "synthetic"), default="stdlib")
    a("--data-mb", type=float, default=8.0, help="megabytes of stdlib source to read (default 8)")
    a("--log-every", type=int, default=25)
    a("--log-json", metavar="FILE", help="rank 0 writes per-step losses and times here")
    a("--save-trace", metavar="FILE", help="write the routing trace (.npz) here")
    a("--trace-every", type=int, default=25, help="record routing every N steps (and at the last step)")
    a("--save-dir", metavar="DIR", help="checkpoint directory")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    a("--resume", metavar="DIR", help="continue from a checkpoint: a step directory, or --save-dir (its latest)")
    a("--stop-at", type=int, default=None, help="stop after this step (as if interrupted; schedule still --steps)")
    a("--no-progress", action="store_true", help="no tqdm bar")
    if ep_dist.world_comm().Get_rank():  # every rank parses alike: one usage message, not one per rank
        p.error = lambda message: sys.exit(2)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        p.error("--steps, --batch >= 1 and --seq >= 2")
    for problem in model_problems(args):
        p.error(problem)
    if args.save_every and not args.save_dir:
        p.error("--save-every needs --save-dir (where the checkpoints go)")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        p.error(f"--stop-at {args.stop_at} must lie in [1, --steps={args.steps}]")
    if args.ep is not None and args.ep < 1:
        p.error(f"--ep {args.ep} must be a positive EP group size")
    if args.resume:
        try:
            checkpoint_dir(args.resume)
        except ValueError as e:
            p.error(str(e))
    return args


def model_problems(args) -> list[str]:
    """What is wrong with the model's options (the gate's and attention's constraints, checked before any rank
    builds anything), as usage messages."""
    problems = []
    if args.experts < 1 or not 1 <= args.topk <= args.experts:
        problems.append(f"--topk {args.topk} must lie in [1, --experts={args.experts}]")
    if args.n_group < 1 or args.experts % args.n_group or not 1 <= args.topk_group <= args.n_group:
        problems.append(f"--n-group {args.n_group} must divide --experts {args.experts}, and --topk-group "
                        f"{args.topk_group} lie in [1, --n-group]")
    elif args.n_group > 1 and args.topk > args.topk_group * (args.experts // args.n_group):
        problems.append(f"--topk {args.topk} exceeds the {args.topk_group * (args.experts // args.n_group)} experts "
                        f"of --topk-group {args.topk_group} groups")
    if args.heads < 1 or args.d_model % args.heads:
        problems.append(f"--heads {args.heads} must divide --d-model {args.d_model}")
    return problems


def checkpoint_dir(path: str) -> str:
    """The step directory ``--resume path`` names: ``path`` itself if it holds ``dense.pt``, else the
    one its ``latest`` file names. Raises ValueError (naming ``path``) if there is no checkpoint."""
    if not os.path.exists(path):
        raise ValueError(f"--resume {path}: no such file or directory")
    if not os.path.isdir(path):
        raise ValueError(f"--resume {path}: not a directory (give a step directory or a --save-dir)")
    if os.path.exists(os.path.join(path, "dense.pt")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.exists(latest):
        raise ValueError(f"--resume {path}: no checkpoint there (neither dense.pt nor latest)")
    with open(latest) as f:
        step_dir = os.path.join(path, f.read().strip())
    if not os.path.exists(os.path.join(step_dir, "dense.pt")):
        raise ValueError(f"--resume {path}: latest names {step_dir}, which has no dense.pt")
    return step_dir


def checkpoint_mismatch(directory: str, dense: dict, experts: dict, experts_file: str, model_args: dict,
                        ep_size: int) -> str | None:
    """Why this rank cannot resume from the loaded ``dense.pt`` / ``experts_file`` state, or None."""
    saved_args = dense["model_args"]
    if saved_args != model_args:
        diff = {k: (saved_args.get(k), model_args.get(k)) for k in sorted(set(saved_args) | set(model_args))
                if saved_args.get(k) != model_args.get(k)}
        return f"--resume {directory}: model arguments differ from the checkpoint's (saved, now): {diff}"
    if experts["step"] != dense["step"]:
        return (f"--resume {directory}: dense.pt was saved at step {dense['step']} but {experts_file} at step "
                f"{experts['step']}: files of different checkpoints")
    if experts["ep_size"] != ep_size:
        total = f" of a {dense['steps']}-step run" if "steps" in dense else ""
        return (f"--resume {directory}: checkpoint saved at step {dense['step']}{total} with EP size "
                f"{experts['ep_size']}; this run has EP size {ep_size} (each EP rank's experts are saved "
                f"separately: resume with the same EP size)")
    return None


# ----------------------------------------------------------------------------------------------
# data


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files in sorted order (no site-packages, no test directories)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out, key=lambda p: os.path.relpath(p, root).split(os.sep))


def load_stdlib_bytes(max_mb: float) -> torch.Tensor:
    limit = int(max_mb * 1e6)
    chunks, total = [], 0
    for path in stdlib_files():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 10_000:
        raise SystemExit(f"train_moe: found only {total} bytes of stdlib source under "
                         f"{sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).clone()


def synthetic_bytes(n: int = 200_000, seed: int = 1234) -> torch.Tensor:
    """A toy grammar: sentences of a few words from a small vocabulary (learnable in a few steps)."""
    import random

    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "True", "x", "y"]
    parts, size = [], 0
    while size < n:
        s = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6))) + ".\n"
        parts.append(s)
        size += len(s)
    return torch.frombuffer(bytearray("".join(parts)[:n].encode()), dtype=torch.uint8).clone()


def get_batch(data: torch.Tensor, batch: int, seq: int, seed: int, step: int, rank: int):
    """``(inputs, targets)`` ``[batch, seq]`` int64 at random offsets; depends only on (seed, step, rank)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    def __init__(self, args, buffer, layer: int):
        super().__init__()
        d = args.d_model
        self.heads = args.heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.moe = MoE(buffer, d, args.expert_dim, args.experts, args.topk, num_shared_experts=args.shared,
                       seed=args.seed * 1000 + layer, score_func=args.score_func, n_group=args.n_group,
                       topk_group=args.topk_group, routed_scaling_factor=args.routed_scaling,
                       aux_loss_alpha=args.aux_loss, experts_impl=args.experts_impl, mode=args.moe_mode,
                       num_max_dispatch_tokens_per_rank=(args.batch * args.seq if args.moe_mode == "low_latency"
                                                         else None))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.norm2(x))


class ByteMoELM(nn.Module):
    """Byte-level decoder with MoE feed-forward blocks (expert parallel through ``buffer``)."""

    def __init__(self, args, buffer):
        super().__init__()
        torch.manual_seed(args.seed)  # dense weights identical on every rank
        self.embed = nn.Embedding(256, args.d_model)
        self.pos = nn.Parameter(torch.randn(args.seq, args.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(args, buffer, i) for i in range(args.layers))
        self.norm = nn.RMSNorm(args.d_model)
        self.head = nn.Linear(args.d_model, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    def moe_layers(self):
        return [blk.moe for blk in self.blocks]

    def aux_loss(self):
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return sum(losses) if losses else None


class AdamW:
    """Plain AdamW (decoupled weight decay), the update of ``torch.optim.AdamW(foreach=False)``.

    Written out because constructing a ``torch.optim`` optimizer imports ``torch._dynamo``
    (about 4 s per process on the development VM, 8 processes on 2 cores in the tests).
    ``state_dict()`` / ``load_state_dict()`` hold ``step``, ``exp_avg``, ``exp_avg_sq`` per parameter.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            if p.grad is None:
                continue
            p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(c2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / c1)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return dict(step=self.step_count, exp_avg=[t.clone() for t in self.exp_avg],
                    exp_avg_sq=[t.clone() for t in self.exp_avg_sq])

    def load_state_dict(self, state: dict):
        if len(state["exp_avg"]) != len(self.params):
            raise ValueError(f"AdamW state for {len(state['exp_avg'])} parameters, have {len(self.params)}")
        self.step_count = int(state["step"])
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            dst.copy_(src)


def split_params(model):
    """``(dense [(name, p)], expert [(name, p)])``."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        (expert if is_expert_param(name) else dense).append((name, p))
    return dense, expert


# ----------------------------------------------------------------------------------------------
# training


class Trainer:
    """Model, optimizers and one training step; collective over the world (and the EP group)."""

    def __init__(self, args, data: torch.Tensor, comm=None):
        self.args = args
        self.comm = comm or ep_dist.world_comm()
        self.rank, self.world = ep_dist.init_distributed(comm=self.comm)
        try:
            self.groups = ep_dist.build_groups(args.ep)
        except ValueError as exc:  # on every rank (build_groups agrees first): a usage error
            raise SystemExit(f"--ep: {exc}") from None
        if args.experts % self.groups.ep_size:
            raise SystemExit(f"--experts {args.experts} must be a multiple of the EP size {self.groups.ep_size}")
        tokens = args.batch * args.seq
        if args.moe_mode == "low_latency":
            if tokens > 511:
                raise SystemExit(f"--moe-mode low_latency: --batch x --seq = {tokens} tokens per rank exceeds the "
                                 f"low-latency limit num_max_dispatch_tokens_per_rank <= 511")
            nbytes = MoE.get_low_latency_rdma_size_hint(tokens, args.d_model, self.groups.ep_size, args.experts,
                                                        args.topk)
            self.buffer = Buffer(self.groups.ep_group, 0, nbytes, low_latency_mode=True, explicitly_destroy=True)
        elif args.moe_mode == "expanded":
            self.buffer = EPBuffer(self.groups.ep_group, num_max_tokens_per_rank=tokens, hidden=args.d_model,
                                   num_topk=args.topk, explicitly_destroy=True)
        else:
            # across nodes (real hosts, or $DEEPEP_ASCEND_RANKS_PER_NODE) the internode path also needs the URMA window
            topo = Topology.from_comm(ep_dist.mpi_comm_of(self.groups.ep_group))
            rpn = topo.ranks_per_node if topo.num_nodes > 1 else None
            hint = dict(num_topk=args.topk, num_experts=args.experts)
            nvl = Buffer.get_normal_buffer_size_hint(tokens, args.d_model, self.groups.ep_size, ranks_per_node=rpn,
                                                     **hint)
            rdma = (Buffer.get_normal_rdma_buffer_size_hint(tokens, args.d_model, self.groups.ep_size, rpn, **hint)
                    if rpn else 0)
            self.buffer = Buffer(self.groups.ep_group, nvl, rdma, explicitly_destroy=True)
        self.data = data
        n_val = max(args.seq + 2, data.numel() // 50)
        self.train_data, self.val_data = data[:-n_val], data[-n_val:]
        self.model = ByteMoELM(args, self.buffer)
        dense, expert = split_params(self.model)
        self.dense = [p for _, p in dense]
        self.expert = [p for _, p in expert]
        kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.opt_dense = AdamW(self.dense, **kw)
        self.opt_expert = AdamW(self.expert, **kw)
        self.step = 0
        self.trace = {}  # (step, layer) -> [T, K] numpy (rank 0)

    def lr_at(self, step: int) -> float:
        a = self.args
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def train_step(self) -> float:
        """One step; returns the loss averaged over all ranks (cross-entropy, nats per byte)."""
        a = self.args
        self.model.train()
        x, y = get_batch(self.train_data, a.batch, a.seq, a.seed, self.step, self.rank)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        aux = self.model.aux_loss()
        (loss + aux if aux is not None else loss).backward()
        self._record_trace()
        self._sync_grads(loss.detach())
        lr = self.lr_at(self.step)
        for opt in (self.opt_dense, self.opt_expert):
            opt.lr = lr
            opt.step()
            opt.zero_grad()
        self.step += 1
        return self._mean_loss

    def _sync_grads(self, loss):
        world = self.world
        # Dense grads (+ the loss, for the log) in one all-reduce over every rank.
        flat = torch.cat([p.grad.reshape(-1) for p in self.dense] + [loss.reshape(1).float()])
        tdist.all_reduce(flat, group=self.groups.dp_group)
        flat /= world
        self._mean_loss = float(flat[-1])
        off = 0
        for p in self.dense:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        # Expert grads already sum every rank's contribution of this EP group (backward combine).
        if self.groups.expert_dp_size > 1:
            eflat = torch.cat([p.grad.reshape(-1) for p in self.expert])
            tdist.all_reduce(eflat, group=self.groups.expert_dp_group)
            off = 0
            for p in self.expert:
                p.grad.copy_(eflat[off:off + p.numel()].view_as(p))
                off += p.numel()
        for p in self.expert:
            p.grad /= world

    @torch.no_grad()
    def val_loss(self, batches: int = 4) -> float:
        """Mean validation loss over ``batches`` fixed batches per rank, averaged over ranks (collective)."""
        a = self.args
        self.model.eval()
        total = 0.0
        for i in range(batches):
            x, y = get_batch(self.val_data, a.batch, a.seq, a.seed + 7, i, self.rank)
            total += float(F.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1)))
        t = torch.tensor([total / batches])
        tdist.all_reduce(t)
        return float(t) / self.world

    # -- routing trace ---------------------------------------------------------------------
    def _trace_this_step(self) -> bool:
        a = self.args
        return bool(a.save_trace) and (self.step % max(1, a.trace_every) == 0 or self.step == a.steps - 1)

    def _record_trace(self):
        if not self._trace_this_step():
            return
        dtype = np.int8 if self.args.experts < 128 else np.int16
        for layer, moe in enumerate(self.model.moe_layers()):
            parts = self.comm.gather(moe.last_topk_idx.numpy().astype(dtype), root=0)
            if self.rank == 0:
                self.trace[(self.step, layer)] = np.concatenate(parts)

    def save_trace(self, path: str):
        if self.rank != 0 or not self.trace:
            return None
        keys = sorted(self.trace)
        d = dict(topk_idx=np.stack([self.trace[k] for k in keys]),
                 trace_step=np.array([k[0] for k in keys], dtype=np.int32),
                 trace_layer=np.array([k[1] for k in keys], dtype=np.int16),
                 num_experts=np.int64(self.args.experts), num_ranks=np.int64(self.world),
                 tokens_per_rank=np.int64(self.args.batch * self.args.seq),
                 source=np.array("scripts/train_moe.py " + " ".join(f"{k}={getattr(self.args, k)}"
                                                                   for k in MODEL_ARGS)))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        np.savez_compressed(path, **d)
        return d["topk_idx"].shape

    # -- checkpoints -----------------------------------------------------------------------
    def _model_args(self):
        return {k: getattr(self.args, k) for k in MODEL_ARGS}

    def save(self, root: str):
        """Collective: into ``root/step{N:06d}``, rank 0 writes ``dense.pt``, the first replica of each EP
        rank ``experts_ep{r}.pt``; then rank 0 points ``root/latest`` at it. Returns the step directory."""
        directory = os.path.join(root, f"step{self.step:06d}")
        os.makedirs(directory, exist_ok=True)
        state = self.model.state_dict()
        if self.rank == 0:
            dense = {k: v for k, v in state.items() if not is_expert_param(k)}
            _atomic_save(dict(model=dense, opt=self.opt_dense.state_dict(), step=self.step, steps=self.args.steps,
                              model_args=self._model_args(), ep_size=self.groups.ep_size, world=self.world),
                         os.path.join(directory, "dense.pt"))
        if self.groups.expert_dp_rank == 0:
            experts = {k: v for k, v in state.items() if is_expert_param(k)}
            _atomic_save(dict(model=experts, opt=self.opt_expert.state_dict(), step=self.step,
                              ep_rank=self.groups.ep_rank, ep_size=self.groups.ep_size),
                         os.path.join(directory, f"experts_ep{self.groups.ep_rank}.pt"))
        tdist.barrier()
        if self.rank == 0:
            with open(os.path.join(root, "latest.tmp"), "w") as f:
                f.write(os.path.basename(directory) + "\n")
            os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        tdist.barrier()
        return directory

    def load(self, path: str):
        """Collective: load the checkpoint ``path`` names (:func:`checkpoint_dir`). If any rank cannot
        (missing or unreadable file, other model arguments, EP size or step), every rank raises
        ``SystemExit`` with the first such rank's reason."""
        err = None
        try:
            directory = checkpoint_dir(path)
            experts_file = f"experts_ep{self.groups.ep_rank}.pt"
            state = {}
            for name in ("dense.pt", experts_file):
                try:
                    state[name] = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
                except OSError as e:
                    raise ValueError(f"--resume {path}: cannot read {os.path.join(directory, name)}: "
                                     f"{e.strerror or e}") from None
                except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
                    raise ValueError(f"--resume {path}: cannot load {os.path.join(directory, name)}: "
                                     f"{type(e).__name__}: {e}") from None
            dense, experts = state["dense.pt"], state[experts_file]
            err = checkpoint_mismatch(directory, dense, experts, experts_file, self._model_args(),
                                      self.groups.ep_size)
        except ValueError as e:
            err = str(e)
        errors = self.comm.allgather(err)  # every rank refuses, or none
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            r, e = bad[0]
            raise SystemExit(e + (f" (on rank {r})" if any(x != e for x in errors) else ""))
        self.model.load_state_dict({**dense["model"], **experts["model"]}, strict=True)
        self.opt_dense.load_state_dict(dense["opt"])
        self.opt_expert.load_state_dict(experts["opt"])
        self.step = int(dense["step"])

    def close(self):
        self.buffer.destroy()


def _atomic_save(obj, path: str):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(args, comm=None, data: torch.Tensor | None = None) -> dict:
    """Train as ``args`` say; returns ``{losses, steps, first_step, val_loss, tokens_per_s, trace_shape}``
    (same on every rank). Leaves torch.distributed initialised."""
    torch.set_num_threads(1)
    if data is None:
        data = synthetic_bytes() if args.text == "synthetic" else load_stdlib_bytes(args.data_mb)
    tr = Trainer(args, data, comm)
    root = tr.rank == 0
    try:
        if args.resume:
            tr.load(args.resume)
        first = tr.step
        if root:
            dense_n = sum(p.numel() for p in tr.dense)
            print(f"[train_moe] {tr.world} ranks, EP {tr.groups.ep_size} x expert-DP {tr.groups.expert_dp_size}; "
                  f"data {args.text} {data.numel() / 1e6:.2f} MB; dense params {dense_n / 1e6:.3f} M, experts "
                  f"{args.experts} x {3 * args.d_model * args.expert_dim / 1e3:.1f} K "
                  f"({sum(p.numel() for p in tr.expert) / 1e3:.1f} K params on this rank, all layers); "
                  f"steps {first}..{args.steps}, {tr.world * args.batch * args.seq} tokens/step", flush=True)
        bar = None
        if root and not args.no_progress:
            try:
                from tqdm import tqdm

                bar = tqdm(total=args.steps, initial=first, desc="train_moe", unit="step", dynamic_ncols=True)
            except ImportError:
                bar = None
        tokens_per_step = tr.world * args.batch * args.seq
        losses, times = [], []
        stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
        while tr.step < stop:
            t0 = time.perf_counter()
            loss = tr.train_step()
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            if args.save_dir and args.save_every and tr.step % args.save_every == 0 and tr.step < stop:
                tr.save(args.save_dir)
            if root:
                tps = tokens_per_step / dt
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
                    bar.update(1)
                if args.log_every and (tr.step % args.log_every == 0 or tr.step == stop):
                    recent = times[-args.log_every:]
                    msg = (f"step {tr.step:5d}  loss {loss:.4f}  "
                           f"tokens/s {tokens_per_step * len(recent) / sum(recent):,.0f}")
                    (bar.write if bar is not None else print)(msg)
        if bar is not None:
            bar.close()
        if args.save_dir:
            tr.save(args.save_dir)
        val = tr.val_loss()
        trace_shape = tr.save_trace(args.save_trace) if args.save_trace else None
        steady = times[min(2, len(times) - 1):]  # without the first (warm-up) steps
        result = dict(losses=losses, first_step=first, steps=args.steps, val_loss=val,
                      tokens_per_s=tokens_per_step * len(steady) / sum(steady) if steady else 0.0,
                      step_times=times, trace_shape=trace_shape)
        if root and losses:
            head = losses[:min(5, len(losses) // 2 or 1)]  # the two windows never overlap
            tail = losses[len(head):][-10:] or head
            print(f"[train_moe] loss {losses[0]:.4f} (step {first + 1}) -> {losses[-1]:.4f} (step {tr.step}); "
                  f"mean of first {len(head)} {sum(head) / len(head):.4f}, last {len(tail)} "
                  f"{sum(tail) / len(tail):.4f}; validation {val:.4f}; "
                  f"{result['tokens_per_s']:,.0f} tokens/s ({tr.world} ranks)", flush=True)
            if trace_shape is not None:
                print(f"[train_moe] routing trace {args.save_trace}: topk_idx {trace_shape} "
                      f"({os.path.getsize(args.save_trace) / 1e3:.0f} KB)", flush=True)
            if args.log_json:
                with open(args.log_json, "w") as f:
                    json.dump(dict(result, args=vars(args)), f, indent=1)
        return result
    finally:
        tr.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    comm = ep_dist.world_comm()
    code = 0
    try:
        run(args, comm)
    except SystemExit as e:
        if comm.Get_rank() == 0 and e.code not in (None, 0):
            print(e.code, file=sys.stderr)
        code = 2
    except BaseException:
        import traceback

        traceback.print_exc()
        abort_job(comm, 1)
    if tdist.is_initialized():
        tdist.destroy_process_group()
    # The project's exit path: barrier, MPI_Finalize, C exit (transports.process).
    exit_job(code, comm)


if __name__ == "__main__":
    main()
