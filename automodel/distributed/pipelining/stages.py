"""Turn this rank's pipeline stages into torch PipelineStages and a schedule."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from automodel.distributed.pipelining.schedule import make_schedule, stage_layout
from automodel.distributed.pipelining.split import build_stage, contents_from_fqns, even_contents
from automodel.imports import load_object
from automodel.loss import summed_cross_entropy
from automodel.models.anatomy import find_anatomy
from automodel.models.multimodal import text_config


def stage_contents(model: nn.Module, anatomy, pipeline, pp_size: int) -> tuple:
    """(what each stage holds, the stage indices of each pp rank)."""
    num_layers = anatomy.num_layers
    num_stages, by_rank = stage_layout(pipeline, pp_size, num_layers)
    if pipeline.module_fqns_per_model_part is not None:
        return contents_from_fqns(model, anatomy, pipeline.module_fqns_per_model_part), by_rank
    # layers_per_stage fixes the split when it tiles the model exactly; after rounding the
    # stage count to a multiple of pp, the layers are spread evenly instead.
    per_stage = pipeline.layers_per_stage
    exact = per_stage if per_stage and per_stage * num_stages == num_layers else None
    return even_contents(num_layers, num_stages, exact), by_rank


def split_model(model: nn.Module, pipeline, pp_rank: int, pp_size: int):
    """(stage modules of this rank, their stage indices, total stage count)."""
    anatomy = find_anatomy(model)
    contents, by_rank = stage_contents(model, anatomy, pipeline, pp_size)
    num_stages, mine = len(contents), by_rank[pp_rank]
    parts = [build_stage(model, anatomy, contents[i], pipeline.patch_inner_model,
                         pipeline.patch_causal_lm_model) for i in mine]
    if pipeline.dtype is not None:  # the pipeline computes (and communicates) in this dtype
        parts = [part.to(getattr(torch, pipeline.dtype)) for part in parts]
    return parts, mine, num_stages


class PipelineLoss:
    """The last stage's loss per micro-batch times ``scale`` (set by the runner each step so
    gradients match the unpipelined step). ``fn(logits, labels)`` must return the loss summed
    over the micro-batch's tokens (``pipeline.loss_fn`` replaces the default).

    ``router`` (``recipes/router_loss.py``): the last stage returns (logits, the routing sums
    of all layers); ``router_scale * aux`` (the micro-batch's sum over sequences) joins the
    objective, and :meth:`micro_batch_aux` gives the micro-batches' aux sums."""

    def __init__(self, fn=summed_cross_entropy, router=None, router_group=None):
        self.fn = fn
        self.scale = 1.0
        self.router = router
        self.router_group = router_group  # context parallelism: a sequence's ranks
        self.router_scale = 0.0
        self._aux_sums: list = []  # of each call since the last micro_batch_aux

    def __call__(self, output, labels):
        if self.router is None:
            return self.fn(output, labels) * self.scale
        logits, sums = output
        aux = self.router.from_stats(sums, self.router_group).sum()
        self._aux_sums.append(aux.detach())
        term = aux * self.router_scale
        # the schedule reports what this returns as the loss: the router's term joins with its
        # gradient at a value of exactly zero, so the reported loss stays the token loss
        return self.fn(logits, labels) * self.scale + (term - term.detach())

    def micro_batch_aux(self, n: int) -> list:
        """The aux sums of the schedule step's ``n`` micro-batches: its last ``n`` calls (the
        schedule's first step also calls the loss on placeholders, to infer shapes)."""
        sums, self._aux_sums = self._aux_sums[len(self._aux_sums) - n:], []
        return sums


def load_loss_fn(path: str | None):
    if path is None:
        return summed_cross_entropy
    fn = load_object(path, "pipeline.loss_fn")
    if not callable(fn):
        raise ValueError(f"pipeline.loss_fn={path!r} is not callable")
    return fn


def example_args(part: nn.Module, stage_id: int, num_stages: int, microbatch: int,
                 seq_len: int, dtype: torch.dtype, device, fused_head: bool = False,
                 seq_shards: int = 1):
    """Input and output examples of a stage, so PipelineStage skips runtime shape inference.
    ``fused_head``: the last stage returns hidden states (its head joins the loss).
    ``seq_shards``: under sequence parallelism the TP degree: the hidden states passed
    between stages are each rank's ``seq_len // seq_shards`` tokens (``sequence_shards.py``)."""
    cfg = text_config(part.config)  # (an image-text model's: its language model's)
    between = seq_len // seq_shards

    def activation(*shape):  # activations carry gradients back: examples must say so
        return torch.empty(*shape, dtype=dtype, device=device, requires_grad=True)

    inputs = (torch.zeros(microbatch, seq_len, dtype=torch.long, device=device)
              if stage_id == 0 else activation(microbatch, between, cfg.hidden_size))
    if stage_id < num_stages - 1:
        outputs = activation(microbatch, between, cfg.hidden_size)
    else:
        outputs = activation(microbatch, seq_len, cfg.hidden_size if fused_head
                             else cfg.vocab_size)
    return inputs, outputs


def build_schedule(parts, stage_ids, num_stages, pipeline, device, pp_group, n_microbatches,
                   loss: PipelineLoss, shapes: tuple | None = None, fused_head: bool = False):
    """``shapes``: (seq_len, activation dtype[, seq_shards]) for static shapes (see
    ``example_args``); None = infer at run time."""
    stages = []
    for part, sid in zip(parts, stage_ids):
        examples = {}
        if shapes is not None:
            seq_len, dtype, *seq_shards = shapes
            inputs, outputs = example_args(part, sid, num_stages, pipeline.pp_microbatch_size,
                                           seq_len, dtype, device, fused_head, *seq_shards)
            if loss.router is not None:  # the routing sums travel with the activations
                sums = torch.empty(pipeline.pp_microbatch_size, loss.router.top_k + 1,
                                   loss.router.num_experts, device=device, requires_grad=True)
                inputs = inputs if sid == 0 else (inputs, sums)
                outputs = (outputs, sums)
            examples = {"input_args": inputs, "output_args": outputs}
        stages.append(PipelineStage(part, sid, num_stages, device, group=pp_group, **examples))
    return make_schedule(stages, pipeline, n_microbatches, loss_fn=loss)
