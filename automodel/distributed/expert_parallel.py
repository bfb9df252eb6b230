"""Expert parallelism: each expert of a mixture-of-experts layer lives on one ep rank.

The MoE mesh regroups the dp x cp ranks of each pipeline stage into ``ep_shard x ep``: the
``num_experts`` experts are split in ``ep`` contiguous groups, one per ep rank, and each
group's weights are FSDP-sharded over the ``ep_shard`` ranks holding the same group. Dense
parameters keep their normal mesh.

Which modules are experts comes from the model: its config's ``base_model_ep_plan`` (the
entries styled ``ep_dispatch_experts``; the ``grouped_gemm`` entries name the per-expert 3-D
weights, split on their first dimension). transformers keeps a layer's experts as fused 3-D
parameters ``[num_experts, ...]`` in one module called with the router's top-k expert indices
and weights; that call is replaced by:

1. dispatch: every (token, chosen expert) pair is sorted by expert and sent to the expert's
   ep rank (an all-to-all with uneven splits; the split sizes are exchanged first, which is
   one small host read per layer);
2. the model's own expert computation on the received tokens, with this rank's experts only
   (the module's own forward, or the experts implementation its config names);
3. combine: results return by the reverse all-to-all, are weighted by the router's weights
   and summed per token, as the unsplit module does.

Gradients: every ep rank's experts see the tokens of all ``ep_shard x ep`` ranks of the
stage, each rank's loss scaled like a data-parallel rank's (TP ranks send the same tokens,
and their duplicate contributions are counted like ranks). Their gradients must be divided
by ``ep_shard x ep``: FSDP2 over ``ep_shard`` divides by ``ep_shard``, and ``1 / ep`` scales
the gradient on its way into the local expert weights (a custom divide factor in FSDP2
needs a premultiplied-sum reduction, which gloo lacks).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from automodel.compat import direct_parameters, replace_parameter_table
from automodel.models.experts import DISPATCH_STYLE, expert_modules
from automodel.peft.experts import with_adapters


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list, in_splits: list, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@dataclass
class ExpertPlacement:
    """This rank's share of a layer's experts."""

    num_experts: int
    ep_size: int
    group: object
    grad_scale: float = 1.0  # applied to the local expert weights' gradients

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size


def check_layout(model: nn.Module, ep: int, pipeline, sequence_parallel: bool) -> None:
    """Raise ``ValueError`` for what a mixture-of-experts model cannot do in this layout (and
    for ``ep > 1`` on a model whose experts cannot be spread). ``pipeline``: the pipeline
    section, or None."""
    moe = bool(expert_modules(model))
    kind = f"{type(model).__name__} (a mixture-of-experts model)"
    if (moe and pipeline is not None and not pipeline.patch_causal_lm_model
            and getattr(model.config, "output_router_logits", False)):
        raise ValueError(
            f"{kind} with pipeline.patch_causal_lm_model=false: the router's load-balancing "
            "loss is carried from stage to stage by the patched stage forward; set "
            "pipeline.patch_causal_lm_model=true, or model.config.output_router_logits=false "
            "to train without the router loss")
    if moe and sequence_parallel:
        raise ValueError(f"{kind}: parallelism.sequence_parallel=true would give its "
                         "experts and router different tokens on each TP rank; set "
                         "parallelism.sequence_parallel=false")
    if ep > 1:
        check_model(model, ep)


def check_model(model: nn.Module, ep: int) -> None:
    """Raise ``ValueError`` when the model cannot spread its experts over ``ep`` ranks."""
    cfg = model.config
    found = expert_modules(model)
    if not found:
        raise ValueError(f"mesh.ep_size={ep}: {type(model).__name__} (model_type "
                         f"{cfg.model_type!r}) has no experts modules (no "
                         f"'{DISPATCH_STYLE}' entry of base_model_ep_plan matches); expert "
                         "parallelism needs a mixture-of-experts model; use mesh.ep_size=1")
    for name, module in found.items():
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or not hasattr(type(module).forward, "__wrapped__"):
            raise ValueError(f"mesh.ep_size={ep}: {name} ({type(module).__name__}) is not an "
                             "experts module with fused per-expert weights; use mesh.ep_size=1")
        if n % ep:
            raise ValueError(f"mesh.ep_size={ep} must divide the model's num_experts={n} "
                             f"({name}); choose an ep_size that divides {n}")
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() == 0 or p.shape[0] != n:
                raise ValueError(f"mesh.ep_size={ep}: {name}.{pname} (shape {tuple(p.shape)}) "
                                 "is not a per-expert weight; use mesh.ep_size=1")


def apply_ep(part: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every experts module's weights over ``ep_mesh`` (dim 0) and route its calls
    through the dispatch. Returns the experts modules (FSDP2 shards them on their own)."""
    modules = list(expert_modules(part).values())
    ep = ep_mesh.size()
    for module in modules:
        placement = ExpertPlacement(module.num_experts, ep, ep_mesh.get_group(),
                                    grad_scale=1.0 / ep)
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=p.requires_grad))
        module._ep = placement
        module.forward = types.MethodType(_dispatch_forward, module)
    return modules


def _local_view(module: nn.Module) -> nn.Module:
    """The module as seen by this rank's experts only: local weight slices (autograd views of
    the DTensors), ``num_experts`` = the local count."""
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    scale = module._ep.grad_scale
    local = {n: p.to_local() if isinstance(p, DTensor) else p
             for n, p in direct_parameters(module)}
    replace_parameter_table(view, {n: _ScaleGrad.apply(t, scale) if scale != 1.0 else t
                                   for n, t in local.items()})
    view.num_experts = module._ep.num_local
    return view


def _expert_compute(module: nn.Module):
    """The model's own expert computation: the experts implementation its config names
    (transformers' experts interface), else the module's original forward."""
    original = type(module).forward.__wrapped__
    name = getattr(module.config, "_experts_implementation", None)
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original) if name else original


def _dispatch_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden], [tokens, k] expert ids and weights -> [tokens, hidden]."""
    ep: ExpertPlacement = self._ep
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
    per_expert = torch.bincount(flat, minlength=ep.num_experts)
    send = per_expert.view(ep.ep_size, ep.num_local)
    recv = torch.empty_like(send)  # [source rank, local expert]
    dist.all_to_all_single(recv, send, group=ep.group)
    in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # host read
    local_ids = torch.arange(ep.num_local, device=flat.device).repeat(ep.ep_size)
    local_ids = local_ids.repeat_interleave(recv.reshape(-1))
    return exchange_and_combine(self, hidden_states, top_k_weights, order, k,
                                (in_splits, out_splits), local_ids)


def exchange_and_combine(module: nn.Module, hidden_states: torch.Tensor,
                         top_k_weights: torch.Tensor, order: torch.Tensor, k: int,
                         splits: tuple, local_ids: torch.Tensor) -> torch.Tensor:
    """Send each (token, slot) pair, in expert ``order``, to the rank of its expert
    (``splits``: rows this rank sends to and receives from each rank), run this rank's
    experts on what it received (``local_ids``: the local expert of each received row), send
    the results back and add them up per token, weighted."""
    ep: ExpertPlacement = module._ep
    in_splits, out_splits = splits
    source_row = order // k
    received = _AllToAllV.apply(hidden_states[source_row], out_splits, in_splits, ep.group)
    ones = torch.ones(received.shape[0], 1, dtype=received.dtype, device=received.device)
    view = with_adapters(_local_view(module))  # (expert adapters, if any, merged per expert)
    computed = _expert_compute(module)(view, received, local_ids[:, None], ones)
    back = _AllToAllV.apply(computed, in_splits, out_splits, ep.group)
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, source_row, (back * weights[:, None]).to(out.dtype))
