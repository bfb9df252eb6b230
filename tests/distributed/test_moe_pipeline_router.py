"""The router's load-balancing loss under a pipeline (issue 23, item 14).

Each stage adds its layers' routing sums (per sequence: expert counts of each top-k slot and
summed router probabilities) to those it receives and passes them on with its hidden states;
the last stage computes the family's ``aux`` from the sums of all layers. Here, in one
process, two split stages chained by hand must give the whole model's logits, the same
``aux`` per sequence and the same gradients in every router (the first stage's routers get
theirs only through the carried sums). The whole jobs (1F1B and EP2 x PP2 against one
process, with ``aux_loss`` logged) are in ``test_moe.py``.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.distributed.pipelining.split import build_stage, even_contents
from automodel.models.anatomy import find_anatomy
from automodel.recipes.router_loss import RouterLoss, carry_routing_sums

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_experts_per_tok=2,
            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            output_router_logits=True, router_aux_loss_coef=0.01)
FAMILIES = {"qwen3_moe": dict(num_experts=8, moe_intermediate_size=16),
            "mixtral": dict(num_local_experts=8),
            "olmoe": dict(num_experts=8)}


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routing_sums_carried_through_stages_give_the_whole_models_aux(family):
    cfg = AutoConfig.for_model(family, **TINY, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    router = RouterLoss.of(model)
    ids = torch.randint(0, 64, (3, 10))
    whole = model(input_ids=ids, use_cache=False)
    aux = router.per_sequence(whole.router_logits, batch=3)
    anatomy = find_anatomy(model)
    stages = [build_stage(model, anatomy, c) for c in even_contents(4, 2, None)]
    carry_routing_sums(stages, router)

    hidden, sums = stages[0](ids)
    assert sums.shape == (3, 3, 8)  # [batch, top_k counts + probabilities, experts]
    # a stage boundary, as the schedule makes it: received tensors are fresh leaves
    hidden_in, sums_in = (t.detach().requires_grad_() for t in (hidden, sums))
    logits, total = stages[1](hidden_in, sums_in)
    torch.testing.assert_close(logits, whole.logits)
    torch.testing.assert_close(router.from_stats(total), aux, rtol=1e-6, atol=1e-7)

    # the gradient of the aux alone reaches every router, across the boundary
    aux.sum().backward()
    router.from_stats(total).sum().backward()
    assert sums_in.grad is not None  # the carried sums take the gradient back to stage 0
    torch.autograd.backward([hidden, sums], [hidden_in.grad, sums_in.grad])
    gates = {n: p for n, p in model.named_parameters() if n.endswith(".mlp.gate.weight")}
    assert len(gates) == 4
    split = {n: p for s in stages for n, p in s.named_parameters() if n in gates}
    assert set(split) == set(gates)
    for name, p in gates.items():
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(split[name].grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)
