"""Split a Hugging Face causal LM into pipeline stages.

Each stage is a pruned copy of the whole model: the decoder layers it does not own are
dropped (the rest keep their original indices, so parameter names map 1:1 to the unsplit
model's), the embedding lives on the first stage, the final norm and LM head on the last.
The forwards of the inner model and of the causal-LM wrapper are patched to pass hidden
states between stages.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn


def stage_layer_ranges(num_layers: int, num_stages: int,
                       layers_per_stage: int | None = None) -> list[range]:
    """Even split, remainder to the first stages; or a fixed number per stage."""
    if layers_per_stage is not None:
        if layers_per_stage * num_stages != num_layers:
            raise ValueError(f"pipeline.layers_per_stage={layers_per_stage} x {num_stages} "
                             f"stages != the model's {num_layers} layers")
        sizes = [layers_per_stage] * num_stages
    else:
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the "
                             f"model has {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _inner_forward(self, hidden_or_ids: torch.Tensor) -> torch.Tensor:
    """Pipeline forward of the inner model: ids (first stage) or hidden states in, hidden out."""
    from transformers.masking_utils import create_causal_mask

    if self.embed_tokens is not None:
        hidden = self.embed_tokens(hidden_or_ids)
    else:
        hidden = hidden_or_ids
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                              cache=None, position_ids=positions)
    position_embeddings = self.rotary_emb(hidden, position_ids=positions)
    for layer in self.layers.values():
        hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                       position_ids=positions, use_cache=False)
    if self.norm is not None:
        hidden = self.norm(hidden)
    return hidden


def _causal_lm_forward(self, hidden_or_ids: torch.Tensor) -> torch.Tensor:
    hidden = getattr(self, self.base_model_prefix)(hidden_or_ids)
    if self.lm_head is not None:
        return self.lm_head(hidden)
    # a stage must return a fresh tensor, never a view of its input (zero-bubble schedules
    # detach outputs in place)
    return hidden if hidden._base is None and hidden is not hidden_or_ids else hidden.clone()


def build_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool,
                patch_inner: bool = True, patch_causal_lm: bool = True) -> nn.Module:
    """A pruned deep copy of ``model`` owning ``layers``."""
    stage = copy.deepcopy(model)
    inner = getattr(stage, stage.base_model_prefix)
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
    if not is_first:
        inner.embed_tokens = None
    if not is_last:
        inner.norm = None
        stage.lm_head = None
    if patch_inner:
        inner.forward = types.MethodType(_inner_forward, inner)
    if patch_causal_lm:
        stage.forward = types.MethodType(_causal_lm_forward, stage)
    return stage


def count_stages(num_layers: int, pp_size: int, multi_stage: bool, v_placement: bool,
                 layers_per_stage: int | None, rounding: str | None) -> int:
    """How many stages in total: one per rank, two per rank for V schedules, otherwise
    ``num_layers / layers_per_stage`` (optionally rounded to a multiple of pp) or 2 per rank."""
    if not multi_stage:
        return pp_size
    if v_placement:
        return 2 * pp_size
    if layers_per_stage is None:
        return 2 * pp_size
    stages = max(1, num_layers // layers_per_stage)
    if stages % pp_size:
        if rounding == "up":
            stages = -(-stages // pp_size) * pp_size
        elif rounding == "down":
            stages = max(pp_size, stages // pp_size * pp_size)
        else:
            raise ValueError(f"{stages} virtual stages (from pipeline.layers_per_stage="
                             f"{layers_per_stage}) is not a multiple of mesh.pp_size={pp_size}; "
                             "set pipeline.round_virtual_stages_to_pp_multiple=up or down")
    return stages
