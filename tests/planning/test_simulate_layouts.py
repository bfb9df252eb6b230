"""Layouts the planner simulates through a planning stand-in (DDP's reducer, expert
parallelism's balanced dispatch), image-text models, and the strategies it refuses.

Each simulation initializes a (fake) process group, so each runs in its own process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from automodel.api import load_config

_SIMULATE = """
import json, sys
from automodel.api import load_config
from automodel.planning.simulate import simulate_rank, as_dict
cfg = load_config(json.loads(sys.argv[1]))
print("RESULT" + json.dumps(as_dict(simulate_rank(cfg, int(sys.argv[2])))))
"""


def _run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1][6:])


def simulate(overrides: list, rank: int = 1) -> dict:
    return _run(_SIMULATE, json.dumps([*overrides, "data=synthetic"]), str(rank))


def _meta_model(overrides: list):
    from automodel.models.builder import build_meta_model

    cfg = load_config(overrides)
    return cfg, build_meta_model(cfg.model)


# ------------------------------------------------------------------------------------ DDP
_COMPARE_DDP = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from automodel.config.schema import DDPConfig
from automodel.planning.ddp import PlannedDDP
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
opts = DDPConfig(**json.loads(sys.argv[1]))
def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(40 + 8 * max(i - 1, 0) if i else 40, 40 + 8 * i)
                           for i in range(6)])
real = nn.parallel.DistributedDataParallel(
    model(), bucket_cap_mb=opts.bucket_cap_mb, find_unused_parameters=opts.find_unused_parameters,
    gradient_as_bucket_view=opts.gradient_as_bucket_view)
planned = PlannedDDP(model(), dist.group.WORLD, opts)
sizes = lambda: ([b.buffer().numel() for b in real.reducer._get_zeros_like_grad_buckets()],
                 [b.flat.numel() for b in planned.buckets])
out = {"at_wrap": sizes()}
for step in range(2):
    x = torch.randn(3, 40)
    for ddp in (real, planned):
        ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
    out[f"step{step}"] = sizes()
storage = next(iter(planned._storage.values())).untyped_storage()
out["equal_grads"] = all(torch.equal(a.grad, b.grad) for a, b in
                         zip(real.parameters(), planned.parameters()))
out["grads_in_buckets"] = all(p.grad.untyped_storage()._cdata == storage._cdata
                              for p in planned.parameters())
print("RESULT" + json.dumps(out), flush=True)
# (torch's DDP reducer can abort the process in gloo's destructor when the group goes first at
# exit: free the wrappers, then the group)
del real, planned
import gc; gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("opts,buckets", [
    ({"bucket_cap_mb": 0.02}, 3),  # (one bucket at the wrap, 3 rebuilt in gradient order)
    # (no rebuild: 0.02 MiB buckets in reverse parameter order from the wrap on)
    ({"bucket_cap_mb": 0.02, "find_unused_parameters": True, "gradient_as_bucket_view": True},
     4),
])
def test_planned_ddp_buckets_are_torch_ddps(opts, buckets):
    """The stand-in's buckets are those of torch's DDP on the same module (its own reducer,
    real tensors, one gloo rank): at the wrap, and after the rebuild in the order the
    gradients became ready; the gradients are the same, views of the buckets when asked."""
    out = _run(_COMPARE_DDP, json.dumps(opts))
    for when in ("at_wrap", "step0", "step1"):
        real, planned = out[when]
        assert planned == real, when
    assert len(out["step1"][0]) == buckets
    assert out["equal_grads"]
    assert out["grads_in_buckets"] == opts.get("gradient_as_bucket_view", False)


def test_ddp_simulation_reduces_each_gradient_once_per_step():
    """parallelism=ddp on 4 ranks with 4 micro-batches per rank (no_sync on the first 3): the
    data-parallel all-reduce carries every gradient once (plus the step's 3 float64 loss and
    token sums), in DDP's first-iteration bucket (one per dtype); the buckets live from the
    wrap on, beside the accumulated gradients (no gradient_as_bucket_view)."""
    overrides = ["parallelism=ddp", "mesh.dp_size=4", "trainer.local_batch_size=1"]
    _, model = _meta_model(overrides)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    sim = simulate(overrides)
    assert sim["comm"] == {"dp_shard": {"all_reduce": grad_bytes + 3 * 8}}
    assert sim["comm_calls"]["dp_shard"]["all_reduce"] == 1 + 2
    assert sim["memory"]["gradients"] == grad_bytes
    assert sim["detail"]["Buffer"] == grad_bytes + buffer_bytes  # (the bucket)


# ------------------------------------------------------------------------------------ EP
def test_expert_parallel_simulation_sends_balanced_tokens():
    """qwen3_moe_tiny with mesh.ep_size=2 (the routing is data-dependent: simulated
    balanced): per layer and step, the ep all-to-alls carry the count exchange (num_experts
    int64) and each rank's tokens * top_k hidden states out and back, in forward and
    backward."""
    overrides = ["model=qwen3_moe_tiny", "parallelism=fsdp2", "mesh.dp_size=4",
                 "mesh.ep_size=2"]
    cfg, model = _meta_model(overrides)
    c, t = model.config, cfg.trainer
    assert t.local_batch_size * 4 == t.global_batch_size  # (one micro-batch per step)
    pairs = t.local_batch_size * t.seq_len * c.num_experts_per_tok
    # (hidden states in bf16: FSDP2's default mixed precision computes in bf16)
    per_layer = c.num_experts * 8 + 4 * pairs * c.hidden_size * 2
    sim = simulate(overrides)
    assert sim["comm"]["ep"]["all_to_all"] == c.num_hidden_layers * per_layer
    assert sim["comm_calls"]["ep"]["all_to_all"] == 5 * c.num_hidden_layers
    assert sim["flops"] > 0


@pytest.mark.fast  # one process, no process group
def test_balanced_counts():
    from automodel.planning.moe import balanced_counts

    assert balanced_counts(256, 8) == [32] * 8
    assert balanced_counts(10, 4) == [3, 3, 2, 2]


# ------------------------------------------------------------------------ image-text models
def test_image_text_model_simulates():
    """llava_tiny (its placeholder check reads the image-token count, a value fake tensors
    lack) is simulated: FSDP2 reduce-scatters every gradient (fp32), each padded at most to
    a multiple of the 4 shards on dim 0."""
    overrides = ["model=llava_tiny", "parallelism=fsdp2", "mesh.dp_size=4"]
    _, model = _meta_model(overrides)
    trainable = [p for p in model.parameters() if p.requires_grad]
    exact = sum(p.numel() * 4 for p in trainable)
    padded = sum(-(-p.shape[0] // 4) * 4 * p[0].numel() * 4 for p in trainable)
    sim = simulate(overrides)
    assert exact <= sim["comm"]["dp_shard"]["reduce_scatter"] <= padded


def test_a_tower_that_reads_image_sizes_on_the_host_simulates(tmp_path):
    """LLaVA-NeXT picks each image's crops from its ``image_sizes`` on the host (``tolist``):
    the simulated step keeps the batch's integer tensors real (planning/fake.py
    ``IndicesStayReal``; without it the fake tensors have no values to give), so its
    pipeline x TP layout plans: the first stage, which runs the tower."""
    from tests.data.processors import save_llava_next

    save_llava_next(tmp_path / "model")
    overrides = ["model=pretrained", f"model.pretrained_path={tmp_path / 'model'}",
                 "parallelism=fsdp2", "pipeline=1f1b", "mesh.pp_size=2", "mesh.tp_size=2",
                 "pipeline.pp_microbatch_size=1", "trainer.global_batch_size=4"]
    first = simulate(overrides, rank=0)
    assert first["stages"] == [0] and first["comm"]["tp"] and first["peak_bytes"] > 0


# --------------------------------------------------------------------------- refusals
@pytest.mark.fast
def test_strategies_without_a_planning_path_are_refused_by_name():
    import dataclasses

    from automodel.config.build import ConfigError
    from automodel.config.strategies import strategy
    from automodel.planning.strategies import planning_strategy

    with pytest.raises(ConfigError, match="parallelism=megatron_fsdp cannot be planned.*CUDA"):
        planning_strategy(strategy("megatron_fsdp"))
    toy = dataclasses.replace(strategy("fsdp2"), name="toy")
    with pytest.raises(ConfigError, match="parallelism=toy has no planning path"):
        planning_strategy(toy)
    assert planning_strategy(strategy("ddp")).wrap == "automodel.planning.ddp.wrap_planned_ddp"
    assert planning_strategy(strategy("fsdp2")) is strategy("fsdp2")


# ------------------------------------------------------------------ one process, many jobs
def test_simulations_sharing_a_process_equal_fresh_ones():
    """Probes run many simulations in one process (``simulate_configs(..., together=)``). A
    mesh equals any earlier mesh of its shape, so DTensor's caches would hand a later job an
    earlier job's mesh, with destroyed process groups (the second pipeline rank and the
    second expert layout failed so), unless ``forget_meshes`` empties them: every result
    equals the same simulation's in a fresh process."""
    from automodel.planning.plan import simulate_configs

    jobs = [(["model=llama_tiny", "pipeline=1f1b", "mesh.pp_size=2", "mesh.dp_size=2"], 0),
            (["model=llama_tiny", "pipeline=1f1b", "mesh.pp_size=2", "mesh.dp_size=2"], 2),
            (["model=qwen3_moe_tiny", "mesh.dp_size=4", "mesh.ep_size=4"], 0),
            (["model=qwen3_moe_tiny", "mesh.dp_size=2", "mesh.tp_size=2",
              "parallelism.sequence_parallel=false", "mesh.ep_size=4"], 0),
            (["model=llama_tiny", "parallelism=hsdp", "mesh.dp_replicate_size=2",
              "mesh.dp_size=4"], 0)]
    configs = [load_config([*o, "data=synthetic", "trainer.global_batch_size=8"])
               for o, _ in jobs]
    ranks = [r for _, r in jobs]
    shared = simulate_configs(configs, ranks, workers=1, together=len(jobs))
    fresh = simulate_configs(configs, ranks, workers=2)
    assert shared == fresh
    assert shared[1]["stages"] == [1] and "ep" in shared[3]["comm"]
