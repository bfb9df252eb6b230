"""TP plans given to tests by import path (parallelism.tp_plan=tests.distributed.plans.NAME)."""

MLP_ONLY = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def attention_only(model):
    """A function taking the model; patterns relative to the base model, as HF writes them.
    (The preflight's fake step calls it too, with the model cut to a layer.)"""
    assert model.config.model_type == "llama"
    return {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


def summed_ce_times_two(logits, labels):
    """A pipeline.loss_fn for tests: twice the summed token cross-entropy."""
    import torch.nn.functional as F

    return 2.0 * F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
