"""Local head counts for attention modules that reshape with the model's global ones.

A tensor-parallel plan that splits q/k/v column-wise leaves each TP rank ``heads / tp`` heads.
Attention written as ``q.view(bsz, q_len, -1, head_dim)`` adapts by itself; attention written
as ``q.view(bsz, q_len, self.num_heads, self.head_dim)`` (StableLM and several older families)
crashes with the global count. On each TP rank, such a module's head counts, and the width of
its heads together (``hidden_size`` where its forward reshapes the attention output with it),
are set to their local values. Only attributes the module's own forward reads are changed, and
only those with the names below: the modules keep what they do not use in their forward.
"""

from __future__ import annotations

import inspect
import logging
import re

from torch import nn

log = logging.getLogger(__name__)

# counts of heads, and widths of all heads together, as attention modules name them
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads",
               "num_kv_heads", "n_kv_heads", "num_heads_kv", "kv_heads")
HEAD_WIDTHS = ("hidden_size", "embed_dim", "all_head_size", "inner_dim", "head_size_all")


def _read_in_forward(module: nn.Module) -> set[str]:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.([A-Za-z_][A-Za-z0-9_]*)\b", source))


def localize_head_counts(model: nn.Module, attention_fqns: list[str], tp: int) -> dict:
    """Divide the head counts (and heads' widths) that each attention module's forward reads
    by ``tp``. Returns ``{fqn: {attribute: (global, local)}}`` of what changed."""
    changed: dict = {}
    for fqn in attention_fqns:
        module = model.get_submodule(fqn)
        read = _read_in_forward(module)
        counts = {a for a in HEAD_COUNTS if a in read}
        if not counts:  # (a forward that never reads a count reshapes with -1)
            continue
        heads = {getattr(module, a) for a in counts}
        widths = {a for a in HEAD_WIDTHS if a in read}
        head_dim = getattr(module, "head_dim", None)
        for name in sorted(counts | widths):
            value = getattr(module, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value % tp:
                continue
            if name in widths and not (isinstance(head_dim, int)
                                       and value in {h * head_dim for h in heads}):
                continue  # a width that is not the heads' together: leave it
            setattr(module, name, value // tp)
            changed.setdefault(fqn, {})[name] = (value, value // tp)
    if changed:
        sample = next(iter(changed.values()))
        log.info("tensor parallel: %d attention modules reshape with their own head counts; "
                 "set to this rank's (e.g. %s)", len(changed),
                 ", ".join(f"{k} {g} -> {v}" for k, (g, v) in sample.items()))
    return changed
