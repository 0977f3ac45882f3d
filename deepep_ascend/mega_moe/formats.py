"""Element types, granularities and row sizes that MegaMoE's modules share (docs/semantics/mega-moe.md §1)."""

from __future__ import annotations

import torch

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
INTERLEAVE = 8  # rows per gate/up block of upstream's L1 interleave (docs/semantics/mega-moe.md §1.2)
SF_GRAN = 32  # channels per UE8M0 scale of activations and FP4 weights (recipe (1, 1, 32))
# DeepGEMM's activation names (docs/semantics/mega-moe.md §1.3); 'swigluoai' is DeepGEMM PR #445's
ACTIVATIONS = ("swiglu", "swigluoai")


def dispatch_row_bytes(hidden: int, is_fp8: bool) -> int:
    """Bytes of one dispatched pair row: e4m3 data then one UE8M0 byte per 32 channels, or bf16."""
    return hidden + hidden // SF_GRAN if is_fp8 else 2 * hidden
