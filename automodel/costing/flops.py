"""FLOPs of the ops a rank runs, counted as they run (``counters.StepCounters`` shows each).

torch's formulas (``torch.utils.flop_counter``: matmuls, convolutions, the GPU attention
kernels) plus the CPU attention kernel the planner runs in their place (counted as the GPU's
flash attention would be) and grouped matmuls (mixtures of experts). Causal attention counts
half of the full score matrix, as the kernels skip the masked half.

A DTensor op reaches the counter as the ops DTensor runs on this rank's shards: those are
counted.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from automodel.compat.planning import op_packet

aten = torch.ops.aten


def _cpu_attention(query, key, value, dropout_p=0.0, is_causal=False, **_):
    n = sdpa_flop_count(query.shape, key.shape, value.shape)
    return n // 2 if is_causal else n


def _cpu_attention_backward(grad_out, query, key, value, out, lse, dropout_p=0.0,
                            is_causal=False, **_):
    n = sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    return n // 2 if is_causal else n


def _grouped_mm(a, b, *args, **_):
    """[tokens, k] x [experts, k, n] (offsets split the tokens): 2 * tokens * k * n."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:  # (weight gradients: [k, tokens] x [tokens, n])
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.numel() * b.shape[-1]


_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
if hasattr(aten, "_grouped_mm"):
    _EXTRA[aten._grouped_mm] = _grouped_mm


class FlopCounter:
    def __init__(self):
        self.total = 0

    def observe(self, func, args, kwargs, out) -> None:
        packet = op_packet(func)
        if packet in _EXTRA:
            self.total += int(_EXTRA[packet](*args, **kwargs))
        elif packet in flop_registry:
            self.total += int(flop_registry[packet](*args, **kwargs, out_val=out))
