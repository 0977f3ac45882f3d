"""``deepep_ascend.nn.hf.expert_parallel`` on real ``transformers`` models against the unmodified model.

Two model classes, each built from a small config with random weights (nothing downloaded):
Qwen3-MoE (softmax top-2 over 8 experts, ``norm_topk_prob``) and DeepSeek-V3 (MLA attention, sigmoid
router with group-limited top-2 and routed scaling, a shared expert, a dense first layer). float32
models; the library moves bf16 rows (the EP forward rounds the dispatched rows and each rank's
partial to bf16, so the tolerance is bf16's).

Every rank builds the same model from one seed, keeps an untouched copy as the reference and
swaps the copy under test to EP over all ranks; each rank feeds its own sequences of the Zen of
Python (the ``this`` module, byte-level tokens), the reference all ranks' sequences at once.
Checked at 2 and 4 ranks:

* logits and every MoE layer's router logits equal the reference's rows of this rank;
* the gradients of the summed cross-entropy (divided by the global token count): dense parameters
  summed over ranks (the data-parallel all-reduce) equal the reference's; each expert parameter
  equals the reference's rows of this rank's experts;
* three AdamW steps: the global loss before each step equals the reference's;
* one experts module called with every token routed to rank 0's experts, with ``transformers``'
  ``grouped_mm`` and ``eager`` implementations: the output and rank 0's expert gradients equal the
  reference module's, so do the input's gradients (dispatch's backward runs on every rank), and the other
  ranks' expert gradients are zeros, not ``None``;
* refusals, the model left untouched: an already expert-parallel model, ``E`` not a multiple of the
  rank count, a model without fused experts modules (``ValueError``), a non-Buffer (``TypeError``),
  ``transformers`` missing or older than 5.18 (``ImportError`` naming the ``hf`` extra).

Tolerance: ``|got - want| <= 1e-2 · max|want| + 1e-2 · |want|`` (bf16 keeps 8 significant bits; the
largest errors seen are about 0.25 % of ``max|want|``, in the expert and router gradients); the
router weights are scaled up so that no token's top-k choice lies within bf16 noise of a tie (a
flipped choice is not a rounding difference and would fail the test, as it should).
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import io
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.support.buffer_helpers import all_ranks_ok
from tests.support.mpi_utils import only_sizes, world

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.watchdog(240)]

SEQ, SEQS_PER_RANK, STEPS = 24, 2, 3
TOL = 1e-2


def zen_bytes() -> torch.Tensor:
    """The Zen of Python (``this`` module, stored ROT13-encoded) as int64 byte values."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the text
        import this
    return torch.tensor(list(codecs.decode(this.s, "rot13").encode()), dtype=torch.int64)


def batch(text: torch.Tensor, step: int, num_seqs: int) -> torch.Tensor:
    """``[num_seqs, SEQ + 1]`` windows of ``text`` for ``step`` (all ranks' sequences, rank-major)."""
    starts = (torch.arange(num_seqs) + step * num_seqs) * 37 % (text.numel() - SEQ - 1)
    return torch.stack([text[s:s + SEQ + 1] for s in starts.tolist()])


def make_models(transformers):
    """name -> a tiny causal LM with random weights (seeded; the same on every rank)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, num_experts_per_tok=2, norm_topk_prob=True,
                  tie_word_embeddings=False)
    configs = {
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM,
                      transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=8, **common)),
        "deepseek_v3": (transformers.DeepseekV3ForCausalLM,
                        transformers.DeepseekV3Config(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                                      n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                                      first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                                      **common)),
    }
    models = {}
    for name, (cls, cfg) in configs.items():
        torch.manual_seed(1234)
        model = cls(cfg)
        with torch.no_grad():  # peaked routing: top-k margins far above bf16 noise
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.mul_(25.0)
        models[name] = model
    return models


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    """(within the bf16 tolerance, the largest error relative to ``max|want|``)."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs()
    return bool((err <= TOL * scale + TOL * want.abs()).all()), err.max().item() / scale


def sum_over_ranks(comm, t: torch.Tensor) -> None:
    from mpi4py import MPI

    comm.Allreduce(MPI.IN_PLACE, t.detach().numpy(), op=MPI.SUM)


def loss_of(model, seqs: torch.Tensor, num_tokens_global: int):
    """``(logits, router logits per MoE layer, Σ cross-entropy / num_tokens_global)``."""
    out = model(input_ids=seqs[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), seqs[:, 1:].reshape(-1), reduction="sum")
    return out.logits, getattr(out, "router_logits", None) or (), ce / num_tokens_global


@only_sizes(2, reason="the EP wrapping does not depend on the rank count (22 s at 4 ranks on 2 cores); "
                      "the data paths under it run at 4 and 8 ranks in tests/ep")
def test_hf_models_expert_parallel(comm, buffers, monkeypatch):
    transformers = pytest.importorskip("transformers", minversion="5.18")
    from deepep_ascend.nn import hf
    from deepep_ascend.nn.hf import ExpertParallelExperts

    rank, R = comm.Get_rank(), comm.Get_size()
    text = zen_bytes()
    n_global = R * SEQS_PER_RANK * SEQ
    mine = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    errors = []

    def check(what, got, want):
        ok, rel = close(got, want)
        if not ok:
            errors.append(f"{what}: max error {rel:.3g} of max|want|")

    for name, model in make_models(transformers).items():
        ref = copy.deepcopy(model)
        buffer = buffers(hf.buffer_size_hint(model, SEQS_PER_RANK * SEQ, R), key="hf")
        hf.expert_parallel(model, buffer)
        swapped = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]
        assert len(swapped) == len(hf.find_experts_modules(ref)) > 0
        ref_params = dict(ref.named_parameters())

        # -- forward and gradients --------------------------------------------------------------
        seqs = batch(text, 0, R * SEQS_PER_RANK)
        logits, router, loss = loss_of(model, seqs[mine], n_global)
        loss.backward()
        ref_logits, ref_router, ref_loss = loss_of(ref, seqs, n_global)
        ref_loss.backward()
        check(f"{name} logits", logits, ref_logits[mine])
        rows = slice(rank * SEQS_PER_RANK * SEQ, (rank + 1) * SEQS_PER_RANK * SEQ)
        if not len(router) == len(ref_router) == len(swapped):
            errors.append(f"{name}: {len(router)} / {len(ref_router)} router logits for {len(swapped)} MoE layers")
        for layer, (got, want) in enumerate(zip(router, ref_router, strict=True)):
            check(f"{name} router logits of MoE layer {layer}", got, want[rows])
        expert_params = {f"{n}.{p}" for n, m in swapped for p, _ in m.named_parameters(recurse=False)}
        for pname, p in model.named_parameters():
            want = ref_params[pname].grad
            if p.grad is None:
                errors.append(f"{name} {pname}: no gradient")
                continue
            if pname in expert_params:
                m = model.get_submodule(pname.rpartition(".")[0])
                want = want[m.first_expert:m.first_expert + m.num_experts]
            else:
                sum_over_ranks(comm, p.grad)
            check(f"{name} grad {pname}", p.grad, want)

        # -- no tokens for some ranks' experts: exact-zero gradients there, with transformers' grouped_mm
        # (which reads every expert's weights) and eager (which reads only the experts it finds) -------------
        exp, (ename, _) = swapped[0][1], swapped[0]
        ref_exp = ref.get_submodule(ename)
        torch.manual_seed(99)
        x = torch.randn(R * 6, model.config.hidden_size, requires_grad=True)  # dispatch's backward runs too
        idx = torch.tensor([[0, 1]] * (R * 6))  # experts 0 and 1: rank 0's
        w = torch.rand(R * 6, 2)
        mine6 = slice(rank * 6, (rank + 1) * 6)
        default_impl = model.config._experts_implementation
        for impl in ("grouped_mm", "eager"):
            what = f"{name} experts module alone ({impl})"
            for m in (model, ref):
                m.config._experts_implementation = impl
            for m in (exp, ref_exp):
                m.zero_grad(set_to_none=True)
            x.grad = None
            y = exp(x[mine6], idx[mine6], w[mine6])
            y.pow(2).sum().backward()
            grad_x = x.grad[mine6].clone()
            x.grad = None
            ref_y = ref_exp(x, idx, w)
            ref_y.pow(2).sum().backward()
            check(what, y, ref_y[mine6])
            check(f"{what}, grad of the input", grad_x, x.grad[mine6])
            for pname, p in exp.named_parameters(recurse=False):
                if p.grad is None:
                    errors.append(f"{what}: {pname} has no gradient")
                elif exp.first_expert >= 2 and not torch.equal(p.grad, torch.zeros_like(p.grad)):
                    errors.append(f"{what}: {pname} gradient not zero on a rank without tokens")
                elif exp.first_expert < 2:
                    check(f"{what}, grad {pname}", p.grad,
                          getattr(ref_exp, pname).grad[exp.first_expert:exp.first_expert + exp.num_experts])
        for m in (model, ref):
            m.config._experts_implementation = default_impl

        # -- three AdamW steps ----------------------------------------------------------------------
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(STEPS):
            opt.zero_grad()
            ref_opt.zero_grad()
            seqs = batch(text, 1 + step, R * SEQS_PER_RANK)
            loss = loss_of(model, seqs[mine], n_global)[2]
            loss.backward()
            for pname, p in model.named_parameters():
                if pname not in expert_params:
                    sum_over_ranks(comm, p.grad)
            global_loss = loss.detach().clone()
            sum_over_ranks(comm, global_loss)
            ref_loss = loss_of(ref, seqs, n_global)[2]
            ref_loss.backward()
            check(f"{name} loss before AdamW step {step}", global_loss, ref_loss)
            opt.step()
            ref_opt.step()

        # -- a second swap is refused ----------------------------------------------------------------
        with pytest.raises(ValueError, match="already expert-parallel"):
            hf.expert_parallel(model, buffer)

    # -- refusals, before anything changes (local checks) ------------------------------------------------
    fresh = make_models(transformers)["qwen3_moe"]
    cases = [
        (TypeError, "must be a deepep_ascend.Buffer", lambda: hf.expert_parallel(fresh, object())),
        (ValueError, "no fused experts module", lambda: hf.expert_parallel(torch.nn.Linear(4, 4), buffer)),
        (ValueError, "must be a multiple of the EP size", lambda: hf.expert_parallel(
            transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                vocab_size=16, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2 * R + 1,
                num_experts_per_tok=2)), buffer)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    with monkeypatch.context() as mp:
        # the module `import transformers` finds now (transformers may swap its sys.modules entry on import)
        mp.setattr(sys.modules["transformers"], "__version__", "5.17.0")
        with pytest.raises(ImportError, match=r"transformers>=5\.18.*found 5\.17\.0.*deepep_ascend\[hf\]"):
            hf.expert_parallel(fresh, buffer)
        mp.setitem(sys.modules, "transformers", None)  # as if not installed
        with pytest.raises(ImportError, match=r"not installed.*deepep_ascend\[hf\]"):
            hf.expert_parallel(fresh, buffer)
    if any(isinstance(m, ExpertParallelExperts) for m in fresh.modules()):
        errors.append("a refused expert_parallel call changed the model")

    all_ranks_ok(world(), not errors, "; ".join(errors[:6]))


@only_sizes(2, reason="two simulated nodes of one rank take the internode path the 2x2 and 2x4 reference tests "
                     "cover (tests/ep/test_internode.py)")
def test_hf_across_simulated_nodes(comm, buffers):
    """Two simulated nodes: expert_parallel refuses a Buffer without the URMA window the internode path needs,
    naming it, before any change; with both windows sized by buffer_sizes, logits and the gradients of the
    experts equal the one-process model's."""
    transformers = pytest.importorskip("transformers", minversion="5.18")
    from deepep_ascend.nn import hf
    from deepep_ascend.nn.hf import ExpertParallelExperts

    rank, R = comm.Get_rank(), comm.Get_size()
    rpn = R // 2
    model = make_models(transformers)["qwen3_moe"]
    ref = copy.deepcopy(model)
    nvl, rdma = hf.buffer_sizes(model, SEQS_PER_RANK * SEQ, comm, ranks_per_node=rpn)
    errors = []
    if rdma <= 0 or nvl <= 0:
        errors.append(f"buffer_sizes gave ({nvl}, {rdma}) on two nodes")
    one_window = buffers(nvl, 0, ranks_per_node=rpn, key="hf nodes nvl only")
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        hf.expert_parallel(model, one_window)
    if any(isinstance(m, ExpertParallelExperts) for m in model.modules()):
        errors.append("a refused expert_parallel call changed the model")
    buffer = buffers(nvl, rdma, ranks_per_node=rpn, key="hf nodes")
    hf.expert_parallel(model, buffer)
    n_global = R * SEQS_PER_RANK * SEQ
    mine = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    seqs = batch(zen_bytes(), 0, R * SEQS_PER_RANK)
    logits, _, loss = loss_of(model, seqs[mine], n_global)
    loss.backward()
    ref_logits, _, ref_loss = loss_of(ref, seqs, n_global)
    ref_loss.backward()
    ok, rel = close(logits, ref_logits[mine])
    if not ok:
        errors.append(f"logits: max error {rel:.3g}")
    ref_params = dict(ref.named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for pname, p in m.named_parameters(recurse=False):
                want = ref_params[f"{name}.{pname}"].grad[m.first_expert:m.first_expert + m.num_experts]
                ok, rel = close(p.grad, want)
                if not ok:
                    errors.append(f"grad {name}.{pname}: max error {rel:.3g}")
    all_ranks_ok(world(), not errors, "; ".join(errors[:6]))


@only_sizes(2, reason="the refusal and the grouped_mm loss do not depend on the rank count; loading "
                      "transformers' GPT-OSS takes most of the test's time at 4 and 8 ranks on 2 cores")
def test_hf_refuses_experts_that_fail_on_the_ep_id(comm, buffers):
    """GPT-OSS's ``eager`` experts one-hot the ids over ``num_experts`` classes, so transformers' expert-parallel
    "no expert here" id fails in them at the first forward of every rank: expert_parallel refuses that module by
    name, the model untouched; with ``grouped_mm`` the same model is taken and its loss equals the one-process
    model's."""
    transformers = pytest.importorskip("transformers", minversion="5.18")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GPT-OSS")
    from deepep_ascend.nn import hf
    from deepep_ascend.nn.hf import ExpertParallelExperts

    R = comm.Get_size()
    errors = []
    for impl in ("eager", "grouped_mm"):
        cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_local_experts=2 * R, num_experts_per_tok=2, max_position_embeddings=64)
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(cfg)
        ref = copy.deepcopy(model)
        buffer = buffers(hf.buffer_size_hint(model, 32, R), key="hf gpt-oss")
        if impl == "eager":
            try:
                hf.expert_parallel(model, buffer)
                errors.append("eager GPT-OSS experts were accepted")
            except ValueError as exc:
                if "'eager'" not in str(exc) or "GptOssExperts" not in str(exc):
                    errors.append(f"refusal does not name the module and implementation: {exc}")
            if any(isinstance(m, ExpertParallelExperts) for m in model.modules()) or any(
                    not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())):
                errors.append("a refused expert_parallel call changed the model")
            continue
        hf.expert_parallel(model, buffer)
        ids = torch.arange(2 * 16).view(2, 16) * 7 % 256
        loss = model(input_ids=ids, labels=ids).loss
        ok, rel = close(loss, ref(input_ids=ids, labels=ids).loss)
        if not ok:
            errors.append(f"grouped_mm GPT-OSS loss: max error {rel:.3g}")
    all_ranks_ok(world(), not errors, "; ".join(errors[:6]))
