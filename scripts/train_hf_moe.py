#!/usr/bin/env python
"""Train a small Hugging Face ``transformers`` MoE model with expert parallelism (``deepep_ascend.nn.hf``).

    mpiexec -n 4 python scripts/train_hf_moe.py                          # Qwen3-MoE, 50 steps
    mpiexec -n 2 python scripts/train_hf_moe.py --model deepseek_v3 --steps 20

Needs the ``hf`` extra (``pip install -e ".[hf]"``). The model is built from a small config with random
weights (nothing downloaded; the same seed on every rank), then :func:`deepep_ascend.nn.hf.expert_parallel`
spreads each MoE layer's experts over the ranks. Data: the bytes of the Python standard library's
``.py`` files (``sysconfig.get_paths()['stdlib']``, sorted, the first ``--data-kb`` kilobytes), byte
tokens (vocabulary 256). Each rank draws its own ``--batch`` windows of ``--seq + 1`` bytes per step
(seeded by step and rank); the loss is the mean cross-entropy over every rank's tokens, so the dense
gradients are summed over the ranks (MPI all-reduce) and the expert gradients are complete already.
Rank 0 prints the global loss every ``--log-every`` steps and the first and last loss at the end.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

from deepep_ascend import Buffer
from deepep_ascend.nn import hf


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("qwen3_moe", "deepseek_v3"), default="qwen3_moe")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16, help="routed experts (a multiple of the rank count)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--data-kb", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def stdlib_bytes(max_kb: int) -> torch.Tensor:
    """The first ``max_kb`` KB of the standard library's ``.py`` files (sorted paths, no tests)."""
    root, chunks, total = sysconfig.get_paths()["stdlib"], [], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py") and total < max_kb * 1024:
                with open(os.path.join(folder, f), "rb") as fh:
                    chunks.append(fh.read())
                total += len(chunks[-1])
    data = b"".join(chunks)[:max_kb * 1024]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def build_model(args):
    import transformers

    common = dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=4,
                  max_position_embeddings=args.seq, num_experts_per_tok=args.topk, tie_word_embeddings=False)
    if args.model == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=args.hidden // 4,
                                          num_experts=args.experts, norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(num_key_value_heads=4, n_routed_experts=args.experts, n_shared_experts=1,
                                            n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=64,
                                            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                            v_head_dim=32, **common)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(args.seed)  # the same weights on every rank
    return cls(cfg)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    data = stdlib_bytes(args.data_kb)
    model = build_model(args)
    tokens = args.batch * args.seq
    buffer = Buffer(None, *hf.buffer_sizes(model, tokens, comm), comm=comm, explicitly_destroy=True)
    hf.expert_parallel(model, buffer)
    expert_params = {id(p) for _, m in hf.find_experts_modules(model) for p in m.parameters(recurse=False)}
    dense = [p for p in model.parameters() if id(p) not in expert_params]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
        seqs = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
        logits = model(input_ids=seqs[:, :-1]).logits
        ce = F.cross_entropy(logits.reshape(-1, 256), seqs[:, 1:].reshape(-1), reduction="sum")
        loss = ce / (tokens * size)  # this rank's share of the global mean
        opt.zero_grad()
        loss.backward()
        for p in dense:  # data parallelism: the global loss's gradient is the sum of the ranks'
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        opt.step()
        losses.append(comm.allreduce(loss.item(), op=MPI.SUM))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {time.perf_counter() - t0:.1f} s", flush=True)
    if rank == 0:
        print(f"{args.model}, {size} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    buffer.destroy()


if __name__ == "__main__":
    main()
