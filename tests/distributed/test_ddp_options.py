"""DDP options take effect on a real 2-rank gloo group."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from automodel.config.schema import DDPConfig
from automodel.distributed.ddp import apply_ddp
from automodel.distributed.init import DistInfo
from automodel.distributed.mesh import MeshAxis, build_mesh
from automodel.distributed.setup import DistributedSetup
from automodel.parallelize import parallelize
from automodel.recipes.step import train_step
from tests.distributed.test_parity import assert_matches
from tests.helpers import run_on_ranks, train


@dataclass
class _Out:  # a dataclass, like HF's ModelOutput, so DDP can find the output tensors
    logits: torch.Tensor


class BranchyLM(nn.Module):
    """A tiny LM with a branch the forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.unused = nn.Linear(8, 8)
        self.register_buffer("counter", torch.zeros(1))

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return _Out(self.head(self.embed(input_ids)))


def _mesh(world):
    return build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1)


def _branchy_batch(rank):
    """Rank ``rank``'s micro-batch: each rank its own tokens, as data parallelism gives."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [tuple(torch.randint(0, 16, (2, 5), generator=gen) for _ in range(2))]


def _train_branchy(rank, world, find_unused):
    mesh = _mesh(world)
    opts = DDPConfig(find_unused_parameters=find_unused)
    model = apply_ddp(BranchyLM(), mesh[MeshAxis.DP], opts, torch.device("cpu"))
    setup = DistributedSetup("ddp", opts,
                             DistInfo("gloo", torch.device("cpu"), rank, world, rank), mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _branchy_batch(rank)
    try:
        steps = []
        for _ in range(3):
            stats = train_step(model, setup, batch, None)
            steps.append((float(stats.loss), float(stats.grad_norm)))
            optim.step()
            optim.zero_grad()
        return ("ok", steps)
    except RuntimeError as err:
        return ("error", str(err))


def _branchy_one_process(world):
    """The same 3 SGD steps in one process, in plain torch: the mean token cross-entropy over
    every rank's tokens, and the norm of the gradients the loss reaches."""
    model = BranchyLM()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = (torch.cat(t) for t in zip(*[_branchy_batch(r)[0] for r in range(world)]))
    steps = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        steps.append((loss.item(), torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()))
        optim.step()
        optim.zero_grad()
    return steps


def test_find_unused_parameters_lets_an_unused_branch_train(tmp_path):
    # DDP with an unused branch on 2 ranks: the losses and gradient norms of one process
    # training on both ranks' tokens (losses moving: the steps really updated the model)
    results = run_on_ranks(_train_branchy, 2, True, tmp_path=tmp_path)
    assert all(kind == "ok" for kind, _ in results)
    assert results[0][1] == results[1][1]  # (every rank reports the global values)
    ref = _branchy_one_process(2)
    np.testing.assert_allclose([s[0] for s in results[0][1]], [s[0] for s in ref], rtol=1e-5)
    np.testing.assert_allclose([s[1] for s in results[0][1]], [s[1] for s in ref], rtol=1e-5)
    assert ref[0][0] - ref[-1][0] > 0.05, ref


def test_without_find_unused_parameters_the_error_names_the_option(tmp_path):
    results = run_on_ranks(_train_branchy, 2, False, tmp_path=tmp_path)
    kinds = [kind for kind, _ in results]
    assert kinds == ["error", "error"]
    assert "parallelism.find_unused_parameters=true" in results[0][1]


def _tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


CAP_MB = 0.01  # the tiny model's 29 KB of gradients: three buckets, against one by default
KNOBS = {
    "defaults": DDPConfig(),
    "static_graph": DDPConfig(static_graph=True, gradient_as_bucket_view=True,
                              bucket_cap_mb=CAP_MB, broadcast_buffers=True),
    "find_unused_parameters": DDPConfig(find_unused_parameters=True, gradient_as_bucket_view=True,
                                        bucket_cap_mb=CAP_MB, broadcast_buffers=True),
}


def _step_facts(model, stats) -> dict:
    grads = [p.grad for p in model.parameters()]
    return {"loss": float(stats.loss), "grad_norm": float(stats.grad_norm),
            "all_have_grads": all(g is not None for g in grads),
            # gradient_as_bucket_view: each gradient is a view into its bucket's flat tensor
            "grad_storages": {None if g._base is None else g._base.data_ptr() for g in grads}}


def _train_with_knobs(rank, world):
    """Each set of knobs: two steps of the real step code on a real LM under the default loss
    (its head fused with the loss), two micro-batches per rank; what the knobs changed."""
    mesh = _mesh(world)
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    facts = {}
    for name, opts in KNOBS.items():
        setup = DistributedSetup("ddp", opts, info, mesh)
        parts = parallelize(_tiny_lm(), setup)
        model = parts.parts[0]
        rotary = model.module.model.rotary_emb
        rotary.inv_freq.mul_(1.0 + rank)  # after wrapping: rank 1's buffer now differs
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(2):
            batches = [tuple(torch.randint(0, 64, (2, 8), generator=gen) for _ in range(2))
                       for _ in range(2)]
            steps.append(_step_facts(model, train_step(model, setup, batches, None,
                                                       head_loss=parts.head_loss)))
            optim.step()
            optim.zero_grad()
        logged = model._get_ddp_logging_data()
        facts[name] = {"fused": parts.head_loss is not None, "steps": steps,
                       "inv_freq": rotary.inv_freq.clone(), "logged": logged,
                       "buckets": logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"],
                       "delayed_first_reduce": getattr(
                           model, "_static_graph_delay_allreduce_enqueued", False)}
    return facts


def test_every_ddp_knob_takes_effect_under_the_default_loss_with_accumulation(tmp_path):
    """static_graph, find_unused_parameters, gradient_as_bucket_view, bucket_cap_mb and
    broadcast_buffers, each observed against DDP's defaults; the whole jobs' parity with one
    process is test_ddp_knobs_with_accumulation_match_one_process."""
    ranks = run_on_ranks(_train_with_knobs, 2, tmp_path=tmp_path)
    reference_inv_freq = _tiny_lm().model.rotary_emb.inv_freq
    for rank, facts in enumerate(ranks):
        for name, f in facts.items():
            assert f["fused"], "the default loss fuses this model's head"
            assert all(s["all_have_grads"] for s in f["steps"]), name
            knobs = name != "defaults"
            # bucket_cap_mb: several buckets (one by default); gradient_as_bucket_view: every
            # gradient lives in one of them (by default none does)
            buckets = len(f["buckets"].split(","))
            assert (buckets >= 3) if knobs else (buckets == 1), (name, f["buckets"])
            storages = f["steps"][-1]["grad_storages"]
            assert (None not in storages and len(storages) == buckets) if knobs else \
                storages == {None}, name
            assert f["logged"]["bucket_cap_bytes"] == (int(CAP_MB * 2**20) if knobs
                                                       else 25 * 2**20)
            # broadcast_buffers: rank 0's buffer overwrote rank 1's at the forward
            synced = reference_inv_freq * (1.0 if knobs else 1.0 + rank)
            torch.testing.assert_close(f["inv_freq"], synced, rtol=0, atol=0)
        # static_graph: torch's reducer knows it, and delayed the first step's reduction
        static = facts["static_graph"]
        assert static["logged"]["static_graph"] == 1 and static["delayed_first_reduce"]
        assert not facts["defaults"]["logged"].get("static_graph")
        # find_unused_parameters: DDP searched the graph, and found the fused head used
        unused = facts["find_unused_parameters"]["logged"]
        assert unused["find_unused_parameters"] == 1 and unused["unused_parameter_size"] == 0
        assert facts["defaults"]["logged"]["find_unused_parameters"] == 0
    for name in KNOBS:  # ranks agree on the global loss and gradient norm
        steps = [facts[name]["steps"] for facts in ranks]
        assert [(s["loss"], s["grad_norm"]) for s in steps[0]] == \
            [(s["loss"], s["grad_norm"]) for s in steps[1]], name


STATIC_GRAPH_ACCUM = ["parallelism.static_graph=true", "parallelism.gradient_as_bucket_view=true",
                      "parallelism.bucket_cap_mb=0.01", "parallelism.broadcast_buffers=true",
                      "parallelism.activation_checkpointing=selective"]
FIND_UNUSED_ACCUM = ["parallelism.find_unused_parameters=true",
                     "parallelism.gradient_as_bucket_view=true", "parallelism.bucket_cap_mb=0.01",
                     "parallelism.broadcast_buffers=true"]


@pytest.mark.parametrize("knobs", [STATIC_GRAPH_ACCUM, FIND_UNUSED_ACCUM],
                         ids=["static_graph", "find_unused_parameters"])
def test_ddp_knobs_with_accumulation_match_one_process(knobs, reference, tmp_path):
    # the default loss (the LM head fused with it), two micro-batches per rank; the two knobs
    # apart, since under a static graph DDP does not search for unused parameters
    records = train(["parallelism=ddp", "trainer.local_batch_size=2", *knobs], tmp_path)
    assert_matches(records, reference())


if __name__ == "__main__":
    pytest.main([__file__])
