"""The torch-free ``Layout``: every degree (the inferred ones too), the flattened axes, the MoE
regrouping, the flags and the divisors, for representative meshes composed as the CLI does."""

import dataclasses
import pickle
import subprocess
import sys

import pytest

from automodel.config.build import ConfigError
from automodel.config.layout import Layout, MeshRequest
from automodel.config.schema import FSDP2Config, MeshConfig
from automodel.config.validate import resolve_sequence_parallel
from tests.config.test_resolve import cfg

pytestmark = pytest.mark.fast  # no process, no process group

AXES = ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp",
        "dp", "cp", "dp_shard_cp", "dp_cp", "ep_shard", "ep")
FLAGS = ("dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "fsdp_enabled", "cp_enabled",
         "tp_enabled", "pp_enabled", "ep_enabled")


def _axes(layout: Layout) -> dict:
    return {a: layout.size(a) for a in AXES if layout.size(a) != 1}


def _flags(layout: Layout) -> set:
    return {f for f in FLAGS if getattr(layout, f)}


# overrides -> (sizes other than 1, flags on, world size)
MESHES = {
    "fsdp2_dp2": (["parallelism=fsdp2"],
                  {"dp_shard": 2, "dp": 2, "dp_shard_cp": 2, "dp_cp": 2, "ep_shard": 2},
                  {"dp_enabled", "dp_shard_enabled", "fsdp_enabled"}, 2),
    "hsdp_2x2": (["parallelism=hsdp"],
                 {"dp_replicate": 2, "dp_shard": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4,
                  "ep_shard": 4},
                 {"dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "fsdp_enabled"}, 4),
    "tp2_sp": (["parallelism=fsdp2", "mesh.tp_size=2", "parallelism.sequence_parallel=true"],
               {"tp": 2, "ep_shard": 2}, {"tp_enabled"}, 2),
    "cp2": (["parallelism=fsdp2", "mesh.cp_size=2", "distributed.nproc_per_node=4"],
            {"dp_shard": 2, "dp": 2, "cp_ring": 2, "cp": 2, "dp_shard_cp": 4, "dp_cp": 4,
             "ep_shard": 4},
            {"dp_enabled", "dp_shard_enabled", "fsdp_enabled", "cp_enabled"}, 4),
    "pp2_dp2": (["parallelism=fsdp2", "pipeline=1f1b", "distributed.nproc_per_node=4"],
                {"pp": 2, "dp_shard": 2, "dp": 2, "dp_shard_cp": 2, "dp_cp": 2, "ep_shard": 2},
                {"dp_enabled", "dp_shard_enabled", "fsdp_enabled", "pp_enabled"}, 4),
    "ep2_on_4": (["parallelism=fsdp2", "model=mixtral_tiny", "mesh.ep_size=2",
                  "distributed.nproc_per_node=4"],
                 {"dp_shard": 4, "dp": 4, "dp_shard_cp": 4, "dp_cp": 4, "ep_shard": 2, "ep": 2},
                 {"dp_enabled", "dp_shard_enabled", "fsdp_enabled", "ep_enabled"}, 4),
    "megatron_hsdp": (["parallelism=megatron_fsdp", "mesh.dp_replicate_size=2"],
                      {"dp_replicate": 2, "dp_shard": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4,
                       "ep_shard": 4},
                      {"dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "fsdp_enabled"},
                      4),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_resolved_config_carries_the_layout(name):
    overrides, sizes, flags, world = MESHES[name]
    c = cfg(*overrides)
    layout = c.layout
    assert _axes(layout) == sizes and _flags(layout) == flags
    assert layout.world_size == c.world_size == c.distributed.nproc_per_node == world
    # the resolved mesh config rebuilds the same layout (and the runtime needs nothing else)
    assert Layout.of(c.mesh) == layout
    assert (c.mesh.dp_size, c.mesh.pp_size) == (layout.dp, layout.pp)
    assert pickle.loads(pickle.dumps(c)).layout == layout
    # the device mesh's shape and the MoE regrouping
    assert layout.shape == tuple(layout.size(a) for a in
                                 ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp"))
    assert layout.moe_shape == (layout.pp, layout.ep_shard, 1, layout.ep)
    assert layout.ep_shard * layout.ep * layout.pp == world


def test_batch_divisors():
    c = cfg("parallelism=hsdp", "trainer.global_batch_size=16", "trainer.local_batch_size=2")
    layout = c.layout
    assert layout.per_rank_batch(16) == 4 and c.trainer.local_batch_size == 2
    assert c.grad_accum_steps == layout.grad_accum_steps(16, 2) == 2
    assert layout.local_batch_size(16) == 4  # null: the whole per-rank batch
    pp = cfg("parallelism=fsdp2", "pipeline=1f1b", "distributed.nproc_per_node=4",
             "trainer.global_batch_size=8", "pipeline.pp_microbatch_size=2").layout
    assert pp.pipeline_batch(8, None) == 4 and pp.pipeline_microbatches(8, None, 2) == 2
    assert pp.pipeline_microbatches(8, 2, 1) == 2
    with pytest.raises(ConfigError, match=r"global_batch_size=6 must be divisible by the "
                                          r"data-parallel size dp=4"):
        layout.local_batch_size(6)
    with pytest.raises(ConfigError, match=r"local_batch_size \* dp = 3\*4 = 12"):
        layout.local_batch_size(16, 3)


def test_sequence_divisors():
    assert Layout().seq_len_divisor() == 1
    assert Layout(tp=2).seq_len_divisor() == 1 and Layout(tp=2).seq_len_divisor(True) == 2
    assert Layout(cp=2).seq_len_divisor() == 4 and Layout(cp=2).local_seq_len(32) == 16
    assert Layout(cp=2, tp=8).seq_len_divisor(True) == 16  # 2*cp chunks, cp*tp shards
    assert Layout(cp=4, cp_ulysses=2).cp_ring == 2
    Layout(cp=2, tp=8).check_seq_len(24)  # divisible by 2 * cp
    with pytest.raises(ConfigError, match="24 / mesh.cp_size=2 = 12 per cp rank"):
        Layout(cp=2, tp=8).check_sequence_parallel_seq_len(24)
    with pytest.raises(ConfigError, match=r"use trainer.seq_len=28 or 32"):
        Layout(cp=2).check_seq_len(30)
    # through the config: the divisor the checks enforce
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.sequence_parallel=true",
            "trainer.seq_len=6")
    assert c.trainer.seq_len % c.layout.seq_len_divisor(True) == 0


def _request(**sizes) -> MeshRequest:
    return MeshRequest.of(MeshConfig(**sizes), pipeline_chosen=sizes.get("pp_size", 1) > 1)


@pytest.mark.parametrize("sizes, world, message", [
    ({"tp_size": 2}, 3, "NPROC is not divisible by mesh.tp_size * mesh.cp_size * mesh.pp_size "
                        "= 2*1*1 = 2"),
    ({"dp_size": 3}, 4, "mesh.dp_size*tp*cp*pp = 3*1*1*1 = 3, but NPROC; set mesh.dp_size=4"),
    ({"dp_replicate_size": 2}, 3, "mesh.dp_replicate_size=2 must divide the data-parallel "
                                  "size dp=3 (NOTE)"),
    ({"cp_size": 2, "cp_ulysses_size": 3}, 2, "mesh.cp_ulysses_size=3 must divide "
                                              "mesh.cp_size=2"),
    ({"ep_size": 3}, 2, "mesh.ep_size=3 must divide dp*cp*tp = 2"),
])
def test_impossible_sizes_name_the_key_the_value_and_the_fix(sizes, world, message):
    with pytest.raises(ConfigError) as info:
        _request(**sizes).layout(world, "NPROC", "NOTE")
    assert message in str(info.value)


def test_request_checks_and_infers_pp():
    with pytest.raises(ConfigError, match="mesh.tp_size=0: must be >= 1"):
        _request(tp_size=0)
    assert MeshRequest.of(MeshConfig(), pipeline_chosen=True).pp == 2
    with pytest.raises(ConfigError, match="a pipeline needs mesh.pp_size >= 2"):
        MeshRequest.of(MeshConfig(pp_size=1), pipeline_chosen=True)
    with pytest.raises(ConfigError, match="mesh.pp_size=2 needs a pipeline schedule"):
        MeshRequest.of(MeshConfig(pp_size=2), pipeline_chosen=False)
    with pytest.raises(ValueError, match="ep=3 must divide dp\\*cp\\*tp=2"):
        Layout(dp_shard=2, ep=3)


def test_validators_return_copies():
    """Sequence parallelism turned on by async TP or compiled TP: a copy, the input as it was."""
    par = FSDP2Config(enable_compile=True, sequence_parallel=False)
    before = dataclasses.asdict(par)
    got = resolve_sequence_parallel("fsdp2", par, Layout(tp=2))
    assert got.sequence_parallel and got is not par and dataclasses.asdict(par) == before
    assert resolve_sequence_parallel("fsdp2", par, Layout()) is par  # tp=1: nothing to do
    assert cfg("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.enable_compile=true",
               "parallelism.sequence_parallel=false").parallelism.sequence_parallel


def test_layout_imports_no_torch():
    code = ("import sys; import automodel.config.layout; "
            "import automodel.config.validate_layout; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
