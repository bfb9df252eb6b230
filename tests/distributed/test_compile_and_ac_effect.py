"""``enable_compile`` and ``activation_checkpointing`` do what they say (issue 24): loss parity
alone cannot tell them from a no-op, so these tests observe their effect.

- compile: each decoder block's forward and backward run inductor-compiled code (compiled
  regions counted by the profiler), under AC and FSDP2 as parallelize() applies them.
- activation checkpointing: which activations a forward leaves alive for backward. none keeps
  what autograd saves; full keeps only each block's output (the next block's input);
  selective keeps exactly the outputs of its policy's ops (matmuls, attention) besides.
"""

import collections
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from automodel.api import load_config
from automodel.distributed.activation_checkpointing import SAVED_OPS
from automodel.distributed.init import DistInfo
from automodel.models.builder import build_model
from automodel.models.parts import block_fqns
from automodel.parallelize import parallelize
from automodel.recipes.train import build_setup
from tests.helpers import FP32, run_on_ranks

LAYERS = 2
# (vocab_size stays 256: the byte-level corpus needs it)
TINY = ["trainer.loss=plain", f"model.config.num_hidden_layers={LAYERS}",
        "model.config.hidden_size=16", "model.config.intermediate_size=32",
        "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2"]
COMPILED_FORWARD = "Torch-Compiled Region"  # dynamo's profiler annotation of a compiled frame
COMPILED_BACKWARD = "CompiledFunctionBackward"  # aot_autograd's compiled backward


def _parallelized(overrides, rank=0, world=1):
    """The tiny model as the recipe builds it: composed config, its setup, parallelize()."""
    cfg = load_config(TINY + overrides, env={})
    setup = build_setup(cfg, DistInfo("gloo", torch.device("cpu"), rank, world, rank))
    model = build_model(cfg.model, seed=0)
    fqns = block_fqns(model)
    blocks = [model.get_submodule(fqn) for fqn in fqns]
    [part] = parallelize(model, setup).parts
    return part, blocks, fqns


def _step(model):
    model(input_ids=torch.arange(16)[None]).logits.sum().backward()


# ------------------------------------------------------------------------------------ compile
def _compiled_steps(rank, world):
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    torch._dynamo.reset()
    counters.clear()
    model, _, fqns = _parallelized(["parallelism=fsdp2", "mesh.dp_size=1", FP32,
                                    "parallelism.activation_checkpointing=full",
                                    "parallelism.enable_compile=true"], rank, world)
    blocks = [model.get_submodule(fqn) for fqn in fqns]  # (what took the blocks' places)
    facts = {"wrappers": [type(b).__name__ for b in blocks],
             "compiled_call": [b._compiled_call_impl is not None for b in blocks],
             "steps": []}
    for _ in range(2):
        with profile() as prof:
            _step(model)
        names = [e.name for e in prof.events()]
        facts["steps"].append({
            "forward_regions": sum(n.startswith(COMPILED_FORWARD) for n in names),
            "backward_regions": sum(n == COMPILED_BACKWARD for n in names),
            "frames": counters["frames"]["total"], "graph_breaks": sum(
                counters["graph_break"].values())})
    return facts


def test_compile_runs_every_block_compiled_under_ac_and_fsdp2(tmp_path):
    # Slow-ish: inductor compiles one (tiny) block; the others reuse its code.
    facts = run_on_ranks(_compiled_steps, 1, tmp_path=tmp_path)[0]
    # AC wrapped each block, FSDP2 sharded the wrapper; compile sits between (parallelize.py)
    assert facts["wrappers"] == ["FSDPCheckpointWrapper"] * LAYERS
    assert facts["compiled_call"] == [True] * LAYERS
    first, second = facts["steps"]
    for step in (first, second):
        # each block's forward enters one compiled region, and its backward runs the
        # compiled backward graph: every step, not only the first
        assert step["forward_regions"] == LAYERS, step
        assert step["backward_regions"] == LAYERS, step
        assert step["graph_breaks"] == 0, step
    assert first["frames"] > 0
    assert second["frames"] == first["frames"], "the second step must not compile again"


# ------------------------------------------------------------------- activation checkpointing
class _NewStorages(TorchDispatchMode):
    """Storages that ops allocate inside the blocks (views and in-place results, which share
    an input's storage, are not new): op, weak reference, bytes."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            inputs = {t.untyped_storage().data_ptr()
                      for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    storage = t.untyped_storage()
                    self.made.append((func, weakref.ref(storage), storage.nbytes()))
        return out


def _kept_for_backward(mode):
    """``mode``: parallelism.activation_checkpointing's value (false, full, selective).
    Storages made inside the blocks during forward that are still alive when forward
    returns (kept by autograd or by checkpointing for backward), by op; besides each block's
    output, which the next block (or the final norm) keeps in every mode."""
    model, blocks, _ = _parallelized(["parallelism=none",
                                      f"parallelism.activation_checkpointing={mode}"])
    tracker, outputs = _NewStorages(), []

    def enter(module, args):
        tracker.inside = True

    def leave(module, args, out):
        tracker.inside = False
        outputs.append((out[0] if isinstance(out, tuple) else out).untyped_storage().data_ptr())

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                         b.register_forward_hook(leave))]
    with tracker:
        loss = model(input_ids=torch.arange(16)[None]).logits.sum()
    for h in hooks:
        h.remove()
    gc.collect()
    made, kept, kept_bytes = collections.Counter(), collections.Counter(), 0
    for op, ref, nbytes in tracker.made:
        made[op] += 1
        storage = ref()
        if storage is not None and storage.data_ptr() not in outputs:
            kept[op] += 1
            kept_bytes += nbytes
    loss.backward()  # (the graph was a real one)
    assert len(outputs) == LAYERS
    return made, kept, kept_bytes


@pytest.mark.fast
def test_selective_ac_keeps_exactly_the_policy_ops_outputs():
    none_made, none_kept, none_bytes = _kept_for_backward("false")  # none
    full_made, full_kept, full_bytes = _kept_for_backward("full")
    made, kept, kept_bytes = _kept_for_backward("selective")
    policy_outputs = collections.Counter({op: n for op, n in made.items() if op in SAVED_OPS})
    # every projection of every block is a matmul the policy saves (q, k, v, o, gate, up, down)
    assert policy_outputs[torch.ops.aten.mm.default] == 7 * LAYERS, made
    # selective: exactly the policy's outputs, all of them: the matmuls and the attention
    # (docs/options.md); norms, activations, element-wise ops are recomputed in backward
    assert kept == policy_outputs, kept
    attention = {op for op in made if "scaled_dot_product" in op.name()}
    assert attention and set(kept) == {torch.ops.aten.mm.default} | attention, kept
    # full: nothing inside a block but its output
    assert full_kept == collections.Counter(), full_kept
    # none: autograd's own choice, which includes ops selective recomputes (not a policy op)
    recomputed_by_selective = {op for op in none_kept if op not in SAVED_OPS}
    assert recomputed_by_selective, none_kept
    assert none_made == full_made == made  # the same forward in each mode
    assert full_bytes == 0 < kept_bytes < none_bytes, (full_bytes, kept_bytes, none_bytes)
