"""FSDP2 options take effect: reshard heuristic, prefetch chains, deferred gradient sync."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.config.schema import FSDP2Config, ModelConfig
from automodel.distributed.fsdp2 import apply_fsdp2
from automodel.distributed.mesh import MeshAxis, build_mesh
from automodel.models.builder import build_model
from automodel.models.parts import block_fqns
from tests.helpers import run_on_ranks

TINY = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                           "intermediate_size": 64, "num_hidden_layers": 4,
                           "num_attention_heads": 2, "num_key_value_heads": 2})


def _sharded(world, opts, pp_enabled=False):
    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1)
    model = build_model(TINY, seed=0)
    fqns = block_fqns(model)
    blocks = apply_fsdp2(model, fqns, mesh[MeshAxis.DP_SHARD_CP], opts, MixedPrecisionPolicy(),
                         None, pp_enabled)
    return model, blocks


def _reshards(block):
    return block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


def _prefetch_targets(blocks):
    index = {id(b._get_fsdp_state()): i for i, b in enumerate(blocks)}
    fwd = [[index[id(s)] for s in b._get_fsdp_state()._states_to_forward_prefetch] for b in blocks]
    bwd = [[index[id(s)] for s in b._get_fsdp_state()._states_to_backward_prefetch] for b in blocks]
    return fwd, bwd


def _inspect(rank, world):
    facts = {}
    _, blocks = _sharded(world, FSDP2Config())
    facts["heuristic"] = [_reshards(b) for b in blocks]
    facts["prefetch_default"] = _prefetch_targets(blocks)
    _, blocks = _sharded(world, FSDP2Config(), pp_enabled=True)
    facts["heuristic_pp"] = [_reshards(b) for b in blocks]
    _, blocks = _sharded(world, FSDP2Config(reshard_after_forward=True,
                                            fsdp2_forward_prefetch_depth=2,
                                            fsdp2_backward_prefetch_depth=1))
    facts["forced"] = [_reshards(b) for b in blocks]
    facts["prefetch_2_1"] = _prefetch_targets(blocks)
    _, blocks = _sharded(world, FSDP2Config(enable_fsdp2_prefetch=False))
    facts["prefetch_off"] = _prefetch_targets(blocks)
    return facts


def test_reshard_heuristic_and_prefetch_chains(tmp_path):
    facts = run_on_ranks(_inspect, 2, tmp_path=tmp_path)[0]
    assert facts["heuristic"] == [True, True, True, False]  # all blocks but the last
    assert facts["heuristic_pp"] == [False] * 4  # no reshard under pipeline parallelism
    assert facts["forced"] == [True] * 4
    assert facts["prefetch_default"] == ([[1], [2], [3], []], [[], [0], [1, 0], [2, 1]])
    assert facts["prefetch_2_1"] == ([[1, 2], [2, 3], [3], []], [[], [0], [1], [2]])
    assert facts["prefetch_off"] == ([[], [], [], []], [[], [], [], []])


def _accumulate(rank, world):
    model, _ = _sharded(world, FSDP2Config())
    torch.manual_seed(rank)
    inputs = torch.randint(0, 64, (2, 8))
    model.set_requires_gradient_sync(False)
    model(input_ids=inputs).logits.sum().backward()
    skipped = all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    model(input_ids=inputs).logits.sum().backward()
    reduced = all(p.grad is not None for p in model.parameters())
    return skipped, reduced


def test_deferred_grad_sync_skips_the_reduce_until_the_last_micro_batch(tmp_path):
    for skipped, reduced in run_on_ranks(_accumulate, 2, tmp_path=tmp_path):
        assert skipped, "no sharded gradient may exist before the synced micro-batch"
        assert reduced
