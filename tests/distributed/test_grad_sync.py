"""grad_sync_context (recipes/step.py), what gradient accumulation runs under, really defers the
gradient reduction: on 2 real gloo ranks with different inputs, after a backward with
is_last=False each rank still holds its own local gradient (nothing averaged yet); after the
backward with is_last=True both hold the average over ranks of their accumulated gradients.

(The final average alone cannot show the deferral: reducing every micro-batch gives the same
sum. Only the state between the micro-batches can.)
"""

import pytest
import torch
from torch import nn

from automodel.config.schema import DDPConfig, FSDP2Config
from automodel.distributed.ddp import apply_ddp
from automodel.distributed.init import DistInfo
from automodel.distributed.mesh import MeshAxis, build_mesh
from automodel.distributed.setup import DistributedSetup
from automodel.recipes.step import grad_sync_context
from tests.helpers import run_on_ranks


def _mlp():
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, x):
    return model(x).pow(2).sum()


def _local_grads(x1, x2):
    """This rank's own gradients, unwrapped: after micro-batch 1, and after 1 + 2."""
    model = _mlp()
    _loss(model, x1).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    _loss(model, x2).backward()
    return first, {n: p.grad.clone() for n, p in model.named_parameters()}


def _fsdp_unsharded_grads(model):
    """FSDP2 keeps a deferred gradient unsharded on its parameter group: read it by name."""
    names = {(id(mod), pname): f"{mname}.{pname}" if mname else pname
             for mname, mod in model.named_modules()
             for pname, _ in mod.named_parameters(recurse=False)}
    state = model._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    out = {}
    for group in groups:
        for fp in group.fsdp_params:
            grad = fp.unsharded_accumulated_grad
            if grad is None:
                grad = fp._unsharded_param.grad
            key = (id(fp._module_info.module), fp._module_info.param_name)
            out[names[key]] = None if grad is None else grad.detach().clone()
    return out


def _accumulate(rank, world, strategy, defer):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1)
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    torch.manual_seed(100 + rank)  # different data on each rank
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    local_first, local_both = _local_grads(x1, x2)

    if strategy == "ddp":
        opts = DDPConfig()
        model = apply_ddp(_mlp(), mesh[MeshAxis.DP], opts, torch.device("cpu"))
    else:
        opts = FSDP2Config(defer_fsdp_grad_sync=defer)
        model = fully_shard(_mlp(), mesh=mesh[MeshAxis.DP_SHARD_CP])
    setup = DistributedSetup(strategy, opts, info, mesh)
    inner = model.module if strategy == "ddp" else model

    with grad_sync_context(model, setup, is_last=False):
        _loss(model, x1).backward()
    sharded = {n: p.grad for n, p in inner.named_parameters()}
    if strategy == "ddp":
        after_first = {n: g.clone() for n, g in sharded.items()}
        sharded_grads_exist = None
    else:
        sharded_grads_exist = any(g is not None for g in sharded.values())
        if sharded_grads_exist:  # reduced already: the (averaged) full gradient
            after_first = {n: g.full_tensor() for n, g in sharded.items()}
        else:
            after_first = _fsdp_unsharded_grads(model)

    with grad_sync_context(model, setup, is_last=True):
        _loss(model, x2).backward()
    after_last = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                  for n, p in inner.named_parameters()}
    return {"local_first": local_first, "local_both": local_both, "after_first": after_first,
            "after_last": after_last, "sharded_grads_exist": sharded_grads_exist}


def _assert_close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _differ(a, b):
    return not torch.allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_reduction_waits_for_the_last_micro_batch(strategy, tmp_path):
    r0, r1 = run_on_ranks(_accumulate, 2, strategy, True, tmp_path=tmp_path)
    if strategy == "fsdp2":
        assert r0["sharded_grads_exist"] is False and r1["sharded_grads_exist"] is False, \
            "no reduce-scattered gradient may exist before the last micro-batch"
    names = list(r0["local_both"])
    assert names and set(r0["after_first"]) == set(names) == set(r1["after_first"])
    for n in names:
        # after micro-batch 1: each rank holds exactly its own gradient, not an average ...
        _assert_close(r0["after_first"][n], r0["local_first"][n], f"rank 0, {n}, deferred")
        _assert_close(r1["after_first"][n], r1["local_first"][n], f"rank 1, {n}, deferred")
        assert _differ(r0["after_first"][n], r1["after_first"][n]), \
            f"{n}: the ranks agree before the last micro-batch: it was reduced already"
        # ... after the last: the average over the ranks of both micro-batches' gradients
        mean = (r0["local_both"][n] + r1["local_both"][n]) / 2
        _assert_close(r0["after_last"][n], mean, f"rank 0, {n}, final")
        _assert_close(r1["after_last"][n], mean, f"rank 1, {n}, final")
        assert _differ(mean, r0["local_both"][n]), f"{n}: the ranks' data must differ"


def test_fsdp2_without_deferral_reduces_every_micro_batch(tmp_path):
    # The contrast: parallelism.defer_fsdp_grad_sync=false reduce-scatters at once, so the
    # state between micro-batches is what tells the two apart.
    r0, r1 = run_on_ranks(_accumulate, 2, "fsdp2", False, tmp_path=tmp_path)
    assert r0["sharded_grads_exist"] and r1["sharded_grads_exist"]
    for n in r0["local_both"]:
        first_mean = (r0["local_first"][n] + r1["local_first"][n]) / 2
        _assert_close(r0["after_first"][n], first_mean, f"rank 0, {n}, not deferred")
        _assert_close(r1["after_first"][n], first_mean, f"rank 1, {n}, not deferred")
        mean = (r0["local_both"][n] + r1["local_both"][n]) / 2
        _assert_close(r0["after_last"][n], mean, f"rank 0, {n}, final")
