"""The unfused MegaMoE sequence from public ops, stage by stage (what ``python -m bench mega-moe``
times against the fused call), and the m-grouped contiguous psum layout it and ``grouped-gemm`` use."""
from __future__ import annotations

import torch

import deepep_ascend as dea
from bench import internals as M

BF16 = torch.bfloat16


def _layout_alignment(engine: str) -> int:
    """Row alignment of each expert's group: the grouped GEMM's (``bf16``) or 1 (``fp32``: no padding rows)."""
    return dea.get_mk_alignment_for_contiguous_layout() if engine == "bf16" else 1


def psum_layout(counts, align: int):
    """The m-grouped contiguous psum layout of groups of ``counts`` rows, each starting at a multiple of
    ``align``: ``(ends, end, pos)`` with ``ends[g]`` the end of group g's rows (what the grouped GEMM
    takes), ``end`` the layout's row count, ``pos`` int64 ``[sum(counts)]`` the layout row of each row
    taken group after group."""
    ends, spans, end = [], [], 0
    for c in counts:
        start = dea.align(end, align)
        end = start + c
        ends.append(end)
        spans.append(torch.arange(start, end))
    return ends, end, torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)


def _grouped_nt(engine: str, a: torch.Tensor, w: torch.Tensor, ends: list, ends_t: torch.Tensor) -> torch.Tensor:
    """``d [M, N]`` bf16 of the m-grouped contiguous psum layout (group g: rows from
    ``align(end[g-1], _layout_alignment(engine))`` to ``end[g]``) times ``w[g].T``: the public
    :func:`deepep_ascend.m_grouped_bf16_gemm_nt_contiguous` (``bf16`` engine), or one float32 matmul
    per group (``fp32``: alignment 1, no padding rows). Padding rows are unspecified."""
    if engine == "bf16":
        d = torch.empty(a.size(0), w.size(1), dtype=BF16)
        dea.m_grouped_bf16_gemm_nt_contiguous(a, w, d, ends_t, use_psum_layout=True, ensure_zero_padding=False)
        return d
    return M.expert_gemm(engine, a, w, [0] + list(ends))


class Unfused:
    """The stage-by-stage sequence from public ops (``bench.mega_moe``'s docstring); ``stages`` in order."""

    def __init__(self, args, buf, w_nat, shared):
        self.args, self.buf, self.ep = args, buf, buf.ep_buffer
        self.kind = args.mma
        h, i = args.hidden, args.inter
        if self.kind == "bf16":
            self.w1, self.w2 = w_nat
        else:
            (d1, s1), (d2, s2) = w_nat
            self.w1 = dea.dequantize_weights(d1, s1, 1, 32).to(BF16)
            self.w2 = dea.dequantize_weights(d2, s2, 1, 32).to(BF16)
        self.shared = None
        if shared is not None:
            if self.kind == "bf16":
                self.shared = shared
            else:
                self.shared = tuple(dea.dequantize_weights(d, s, 1, 32).to(BF16) for d, s in shared)
        self.engine = M.gemm_engine()
        if self.engine == "fp32":
            self.w1, self.w2 = self.w1.float(), self.w2.float()
        self.h, self.i = h, i
        self.clamp = None if args.clamp < 0 else args.clamp
        # swigluoai's (alpha, up_bias) as the library takes them (float32 values), or None: plain SwiGLU
        self.oai = None if args.activation == "swiglu" else tuple(
            float(torch.tensor(v, dtype=torch.float32)) for v in (args.activation_alpha, args.activation_up_bias))
        self.st = {}

    def _act(self, hh, w):
        i = hh.size(1) // 2
        g, u = hh[:, :i], hh[:, i:]
        if self.clamp is not None:
            c = torch.tensor(self.clamp, dtype=BF16)
            g, u = torch.minimum(g, c), torch.maximum(torch.minimum(u, c), -c)
        if self.oai is None:
            a = torch.nn.functional.silu(g.float()) * u.float() * w.unsqueeze(1)
        else:  # gpt-oss's clamped SwiGLU, as a user writes it
            alpha, up_bias = self.oai
            gf = g.float()
            a = gf * torch.sigmoid(alpha * gf) * (u.float() + up_bias) * w.unsqueeze(1)
        if self.kind == "bf16":
            return a.to(BF16)
        n = a.size(0)
        grp = a.view(n, i // 32, 32)
        s = dea.ceil_to_ue8m0(grp.abs().amax(-1).clamp(min=1e-4) / 448.0).unsqueeze(-1)
        return (dea.e4m3_to_float(dea.cast_to_e4m3(grp / s)) * s).view(n, i).to(BF16)

    def dispatch(self):
        b, t = self.buf, self.args.num_tokens
        idx, wts = b.topk_idx[:t], b.topk_weights[:t]
        if self.kind == "bf16":
            x = b.x[:t]
        else:
            x = torch.cat([b.x[:t].view(torch.uint8), b.x_sf[:t].view(torch.uint8)], 1)
        ntpr, ntprr, ntpe, itr, _ = self.ep.get_dispatch_layout(idx, b.num_experts)
        rx, ridx, rw, _lst, handle, _ev = self.ep.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                                           is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                           topk_idx=idx, topk_weights=wts)
        self.st.update(rx=rx, ridx=ridx, rw=rw, handle=handle)

    def l1(self):
        st, h = self.st, self.h
        ridx = st["ridx"]
        flat = ridx.reshape(-1)
        k = ridx.size(1)
        el = self.buf.num_local_experts
        cnt = torch.bincount(flat[flat >= 0], minlength=el).tolist()
        order = torch.argsort(flat, stable=True)[flat.numel() - sum(cnt):]
        rows = torch.div(order, k, rounding_mode="floor")
        # the grouped GEMM's alignment, or 1 for the fp32 engine
        ends, end, pos = psum_layout(cnt, _layout_alignment(self.engine))
        rx = st["rx"].index_select(0, rows)
        if self.kind != "bf16":  # e4m3 data, then one UE8M0 byte per 32 channels
            rx = dea.per_token_cast_back(rx[:, :h].view(torch.float8_e4m3fn), rx[:, h:], gran_k=32)
        padded = end != rx.size(0)
        if padded:
            a = torch.zeros(end, h, dtype=BF16)
            a.index_copy_(0, pos, rx)
        else:
            a = rx
        ends_t = torch.tensor(ends, dtype=torch.int32)
        hh = _grouped_nt(self.engine, a, self.w1, ends, ends_t)
        st.update(order=order, rows=rows, pos=pos, end=end, ends=ends, ends_t=ends_t, padded=padded, a1=a, cnt=cnt,
                  hh=hh.index_select(0, pos) if padded else hh,
                  w=st["rw"].reshape(-1).index_select(0, order))

    def act(self):
        self.st["a"] = self._act(self.st["hh"], self.st["w"])

    def act_library(self):
        """The SwiGLU stage as the fused call computes it (``deepep_ascend.mega_moe.experts.activation``: the native
        kernel where it was built), on the same rows: timed as an alternative ``act``, not part of ``Σ stages``."""
        M.activation(self.kind, self.st["hh"], self.i, self.st["w"], self.clamp, True, M.operand_dtype(self.engine),
                     oai=self.oai)

    def l2(self):
        st = self.st
        if st["padded"]:
            a2 = torch.zeros(st["end"], self.i, dtype=BF16)
            a2.index_copy_(0, st["pos"], st["a"])
        else:
            a2 = st["a"]
        st["a2"] = a2
        o = _grouped_nt(self.engine, a2, self.w2, st["ends"], st["ends_t"])
        o = o.index_select(0, st["pos"]) if st["padded"] else o
        part = torch.zeros(st["rx"].size(0), self.h, dtype=torch.float32).index_add_(0, st["rows"], o.float())
        st["part"] = part.to(BF16)

    def combine(self):
        self.st["y"], _w, _ev = self.ep.combine(self.st["part"], self.st["handle"])

    def shared_expert(self):
        if self.shared is None:
            return
        b, t = self.buf, self.args.num_tokens
        if self.kind == "bf16":
            x = b.x[:t]
        else:
            x = dea.per_token_cast_back(b.x[:t], b.x_sf[:t], gran_k=32)
        w1s, w2s = self.shared
        a = self._act(M.dense_nt(self.engine, x, w1s), torch.ones(t))
        self.st["y"] = (self.st["y"].float() + M.dense_nt(self.engine, a, w2s).float()).to(BF16)

    stages = ("dispatch", "l1", "act", "l2", "combine", "shared")

    def gemm_fns(self):
        """The grouped GEMM calls alone, on the layouts of the last run (operands in the engine's dtype)."""
        st, dt = self.st, M.operand_dtype(self.engine)
        a1, a2 = st["a1"].to(dt), st["a2"].to(dt)
        return {"gemm_l1": lambda: _grouped_nt(self.engine, a1, self.w1, st["ends"], st["ends_t"]),
                "gemm_l2": lambda: _grouped_nt(self.engine, a2, self.w2, st["ends"], st["ends_t"])}

    def fused_gemm_fns(self, cached):
        """MegaMoE's own per-expert GEMMs (:func:`deepep_ascend.mega_moe.experts.expert_gemm`) on its cached weights
        ``cached`` (``_untransformed``: fp8, the FP4 copies the AMX kernel decodes) and the last run's rows,
        sorted by expert without padding (the fused call's layout)."""
        st, dt = self.st, M.operand_dtype(self.engine)
        bounds = [0] + torch.tensor(st["cnt"]).cumsum(0).tolist()
        a1 = (st["a1"].index_select(0, st["pos"]) if st["padded"] else st["a1"]).to(dt)
        a2 = (st["a2"].index_select(0, st["pos"]) if st["padded"] else st["a2"]).to(dt)
        return {"fused_gemm_l1": lambda: M.expert_gemm(self.engine, a1, cached[0], bounds),
                "fused_gemm_l2": lambda: M.expert_gemm(self.engine, a2, cached[1], bounds)}

    def stage_fns(self):
        return {"dispatch": self.dispatch, "l1": self.l1, "act": self.act, "l2": self.l2, "combine": self.combine,
                "shared": self.shared_expert}

    def run(self):
        for fn in self.stage_fns().values():
            fn()
        return self.st["y"]
