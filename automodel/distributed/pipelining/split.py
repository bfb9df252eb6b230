"""Split a Hugging Face causal LM into pipeline stages.

Each stage is a pruned copy of the whole model: the decoder layers it does not own are
dropped (the rest keep their original indices, so parameter names map 1:1 to the unsplit
model's), the embedding lives on the first stage, the final norm and LM head on the last.
The forwards of the inner model and of the causal-LM wrapper are patched to pass hidden
states between stages.
"""

from __future__ import annotations

import copy
import re
import types
from dataclasses import dataclass

import torch
from torch import nn

from automodel.distributed.pipelining.layout import stage_layer_ranges


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


@dataclass
class StageContents:
    layers: list  # original decoder-layer indices, in order
    embed: bool  # the token embedding (first stage)
    head: bool  # the final norm and LM head (last stage)


def even_contents(num_layers: int, num_stages: int, layers_per_stage: int | None) -> list:
    ranges = stage_layer_ranges(num_layers, num_stages, layers_per_stage)
    return [StageContents(list(r), i == 0, i == num_stages - 1) for i, r in enumerate(ranges)]


def contents_from_fqns(model: nn.Module, fqns_per_part: list) -> list:
    """``pipeline.module_fqns_per_model_part`` -> stage contents, checked against the model."""
    prefix = model.base_model_prefix
    inner = getattr(model, prefix)
    num_layers = len(inner.layers)
    head_fqn = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    embed, norm = f"{prefix}.embed_tokens", f"{prefix}.norm"
    layer_fqn = re.compile(rf"^{re.escape(prefix)}\.layers\.(\d+)$")
    contents, seen = [], []
    for i, fqns in enumerate(fqns_per_part):
        stage = StageContents([], False, False)
        for fqn in fqns:
            m = layer_fqn.match(fqn)
            if m and int(m.group(1)) < num_layers:
                stage.layers.append(int(m.group(1)))
            elif fqn == embed:
                stage.embed = True
            elif fqn in (norm, head_fqn):
                stage.head = True
            elif fqn != f"{prefix}.rotary_emb":
                raise ValueError(f"pipeline.module_fqns_per_model_part[{i}] names {fqn!r}, which "
                                 f"is not a part of {type(model).__name__} that can be placed "
                                 f"(allowed: {embed}, {prefix}.layers.<0..{num_layers - 1}>, "
                                 f"{norm}, {head_fqn})")
        seen += stage.layers
        contents.append(stage)
    if sorted(seen) != list(range(num_layers)) or seen != sorted(seen):
        raise ValueError("pipeline.module_fqns_per_model_part must place every decoder layer "
                         f"exactly once and in order; it places {seen}")
    if not contents[0].embed or any(c.embed for c in contents[1:]):
        raise ValueError(f"pipeline.module_fqns_per_model_part: {embed} belongs to the first part")
    if not contents[-1].head or any(c.head for c in contents[:-1]):
        raise ValueError(f"pipeline.module_fqns_per_model_part: {norm} and {head_fqn} belong to "
                         "the last part")
    return contents


def build_stage(model: nn.Module, contents: StageContents, patch_inner: bool = True,
                patch_causal_lm: bool = True) -> nn.Module:
    """A pruned deep copy of ``model`` holding only ``contents``."""
    stage = copy.deepcopy(model)
    inner = getattr(stage, stage.base_model_prefix)
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in contents.layers})
    if not contents.embed:
        inner.embed_tokens = None
    if not contents.head:
        inner.norm = None
        stage.lm_head = None
    if patch_inner:
        inner.forward = types.MethodType(_inner_forward, inner)
    if patch_causal_lm:
        stage.forward = types.MethodType(_causal_lm_forward, stage)
    return stage
