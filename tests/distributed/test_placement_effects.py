"""What ``parallelism.offload_policy`` and ``parallelism.multimodal.*`` do to the sharded model.

Parity (``test_parity.py``, ``test_image_text.py``) shows these options keep the numbers; a
no-op option would keep them too. These tests observe the layout each option promises, on
models built and parallelized as the recipe does (``load_config`` -> ``build_setup`` ->
``parallelize``) on two real gloo ranks, so an option dropped anywhere on that path fails:

- ``offload_policy``: every FSDP2 unit holds its parameters under torch's CPU offload
  (``FSDPParam.offload_to_cpu``: the sharded parameters, the reduced gradients and so the
  optimizer state are kept on the host, gathered to the device for compute), unpinned without
  an accelerator. On a CPU-only machine the host is the device, so the flags FSDP2 acts on are
  what changes; the tensors are checked to be on the host after a step all the same.
- ``multimodal.frozen_sharding`` and ``multimodal.vision.*``: which parameters are sharded
  (DTensor) and on which mesh, which FSDP2 unit holds them, and whether a unit is still
  gathered between forward and backward.
"""

import pytest
import torch

from tests.helpers import BASE, FP32, run_on_ranks

OFFLOAD = "parallelism.offload_policy={_target_:torch.distributed.fsdp.CPUOffloadPolicy}"


def parallel_model(rank, world, overrides):
    """(cfg, setup, parallel) of FSDP2 on ``world`` ranks, built as the recipe builds it."""
    from automodel.api import load_config
    from automodel.distributed.init import DistInfo
    from automodel.parallelize import parallelize
    from automodel.recipes import components
    from automodel.recipes import train as runner

    cfg = load_config(BASE + ["parallelism=fsdp2", FP32, f"distributed.nproc_per_node={world}",
                              f"mesh.dp_size={world}", "trainer.local_batch_size=1"]
                      + overrides)
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    setup = runner.build_setup(cfg, info)
    model, fill = components.initial_model(cfg, info)
    return cfg, setup, parallelize(model, setup, fill)


def fsdp_units(model) -> dict:
    """{FQN of an FSDP2 unit ("" the root): its parameter group}."""
    found = {}
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        if state is not None and state._fsdp_param_group is not None:
            found[name] = state._fsdp_param_group
    return found


def _placement(p) -> str:
    """"R" replicated, "S<d>" sharded on dim d (plain or strided: FSDP2 over another split)."""
    return "R" if p.is_replicate() else f"S{p.dim}" if hasattr(p, "dim") else str(p)


def layout(model) -> dict:
    """{parameter name: (its FSDP2 unit or None, its mesh as ((dim name, size), ...) or None,
    its placements, local shape, global shape)} while the model is sharded (before a
    forward). Not a DTensor: no mesh, no placements."""
    from torch.distributed.tensor import DTensor

    owner = {id(fp.sharded_param): unit for unit, group in fsdp_units(model).items()
             for fp in group.fsdp_params}
    out = {}
    for name, p in model.named_parameters():
        dt = isinstance(p, DTensor)
        mesh = tuple(zip(p.device_mesh.mesh_dim_names, p.device_mesh.shape)) if dt else None
        out[name] = (owner.get(id(p)), mesh, tuple(map(_placement, p.placements)) if dt else None,
                     tuple((p.to_local() if dt else p).shape), tuple(p.shape))
    return out


def micro_batches(cfg, setup) -> list:
    """This rank's micro-batches of the run's first step (on the host)."""
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data

    t = cfg.trainer
    rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
    return BatchPlan(rows, t.global_batch_size, t.seed).micro_batches(
        0, setup.dp_rank, setup.dp_size, t.local_batch_size)


def gathered_after_forward(cfg, setup, parallel) -> dict:
    """{unit: whether its parameters are gathered (unsharded) between forward and backward};
    the step then finishes its backward."""
    from automodel.recipes.step import device_batches, forward_loss

    model = parallel.parts[0]
    batch = device_batches(micro_batches(cfg, setup)[:1], setup)[0]
    _, loss = forward_loss(model, setup, batch, head_loss=parallel.head_loss)
    gathered = {unit: {fp.sharded_state.name for fp in group.fsdp_params}
                for unit, group in fsdp_units(model).items()}
    loss.backward()
    assert all(len(s) == 1 for s in gathered.values()), gathered
    return {unit: states == {"UNSHARDED"} for unit, states in gathered.items()}


def _offload_facts(rank, world):
    from automodel.optim import Optimizers
    from automodel.recipes.step import train_step

    facts = {}
    for name, extra in (("none", []), ("cpu", [OFFLOAD])):
        cfg, setup, parallel = parallel_model(rank, world, extra)
        model = parallel.parts[0]
        units = fsdp_units(model)
        optimizer = Optimizers(parallel.parts, cfg.optim)
        stats = train_step(model, setup, micro_batches(cfg, setup)[:1], cfg.optim.max_grad_norm,
                           head_loss=parallel.head_loss)
        optimizer.step()
        state = [t for opt in optimizer.optimizers for s in opt.state.values()
                 for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        facts[name] = dict(
            units=sorted(units),
            policy={type(g.offload_policy).__name__ for g in units.values()},
            offload={fp.offload_to_cpu for g in units.values() for fp in g.fsdp_params},
            pinned={fp.pin_memory for g in units.values() for fp in g.fsdp_params},
            params={p.to_local().device.type for p in model.parameters()},
            grads={p.grad.to_local().device.type for p in model.parameters()},
            opt_state={t.to_local().device.type for t in state},
            n_params=sum(1 for _ in model.parameters()), n_state=len(state),
            grad_norm=float(stats.grad_norm))
    return facts


def _facts(rank, world):
    return {"offload": _offload_facts(rank, world),
            "multimodal": _multimodal_facts(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both tests' facts from one spawn of two ranks (per rank)."""
    return run_on_ranks(_facts, 2, tmp_path=tmp_path_factory.mktemp("ranks"))


def test_offload_policy_reaches_every_fsdp_unit(two_ranks):
    facts = two_ranks[0]["offload"]
    none, cpu = facts["none"], facts["cpu"]
    assert cpu["units"] == none["units"] and len(cpu["units"]) == 5  # 4 blocks and the root
    assert none["policy"] == {"OffloadPolicy"} and none["offload"] == {False}
    # every unit's parameters held by FSDP2 under CPU offload; pinned memory needs an
    # accelerator, so it is off here (options.md)
    assert cpu["policy"] == {"CPUOffloadPolicy"} and cpu["offload"] == {True}
    assert cpu["pinned"] == {False}
    # between steps: sharded parameters, their reduced gradients and the optimizer state
    # (Adam's two moments per parameter) on the host
    assert cpu["params"] == cpu["grads"] == cpu["opt_state"] == {"cpu"}
    assert cpu["n_state"] == 2 * cpu["n_params"]
    assert cpu["grad_norm"] == pytest.approx(none["grad_norm"], rel=1e-6)


TOWER = "model.vision_tower"
LANGUAGE = [f"model.language_model.layers.{i}" for i in range(4)]
# (CLIP declares its embeddings a block too: _no_split_modules)
VISION = [f"{TOWER}.embeddings"] + [f"{TOWER}.encoder.layers.{i}" for i in range(2)]
_MM = "parallelism.multimodal."
PER_LAYER = f"{_MM}frozen_sharding=per_layer"
MULTIMODAL = {  # llava_tiny with its tower frozen unless said
    "root": [f"{_MM}frozen_sharding=root"],
    "per_layer": [PER_LAYER],
    "per_layer_kept": [PER_LAYER, f"{_MM}vision.reshard_after_forward=false"],
    "per_layer_freed": [PER_LAYER, "parallelism.reshard_after_forward=false",
                        f"{_MM}vision.reshard_after_forward=true"],
    "tower_unit_kept": [PER_LAYER, f"{_MM}vision.unit=tower",
                        f"{_MM}vision.reshard_after_forward=false"],
    "replicate": [f"{_MM}frozen_sharding=replicate"],
    "replicate_trainable_tower": [f"{_MM}frozen_sharding=replicate", "model.freeze=[]"],
}


def _multimodal_facts(rank, world):
    facts = {}
    for name, extra in MULTIMODAL.items():
        cfg, setup, parallel = parallel_model(rank, world, ["model=llava_tiny",
                                                            "model.freeze=[vision]"] + extra)
        model = parallel.parts[0]
        placed = layout(model)
        tower = {n: v for n, v in placed.items() if n.startswith(TOWER + ".")}
        facts[name] = dict(
            units=sorted(fsdp_units(model)),
            tower_owners={o for o, *_ in tower.values()},
            tower_mesh={(dims, pl) for _, dims, pl, *_ in tower.values()},
            tower_local={"whole" if local == full else "part" for *_, local, full in
                         tower.values()},
            other_mesh={(dims, pl) for n, (_, dims, pl, *_) in placed.items()
                        if not n.startswith(TOWER + ".")},
            tower_sum=float(sum(p.detach().sum() for n, p in model.named_parameters()
                                if n.startswith(TOWER + ".") and not hasattr(p, "to_local"))),
            gathered=gathered_after_forward(cfg, setup, parallel))
    return facts


def test_frozen_sharding_and_vision_options_place_the_tower(two_ranks):
    ranks = [r["multimodal"] for r in two_ranks]
    f = ranks[0]
    shard = {((("dp_shard_cp", 2),), ("S0",))}  # dim 0 over both ranks
    lang_default = {b: i == 3 for i, b in enumerate(LANGUAGE)}  # all but the last reshard
    # root: the frozen tower is no unit; its weights are sharded in the root unit, which is
    # still gathered after forward
    r = f["root"]
    assert r["units"] == ["", *LANGUAGE]
    assert r["tower_owners"] == {""} and r["tower_mesh"] == shard
    assert r["tower_local"] == {"part"}
    assert r["gathered"] == {"": True, **lang_default}
    # per_layer: each frozen tower block a unit of its own (the rest of the tower in the
    # root); its reshard follows the language blocks' rule unless vision.reshard_after_forward
    p = f["per_layer"]
    assert p["units"] == sorted(["", *VISION, *LANGUAGE])
    assert p["tower_owners"] == {"", *VISION} and p["tower_mesh"] == shard  # ("": its norm)
    assert p["gathered"] == {"": True, **dict.fromkeys(VISION, False), **lang_default}
    assert f["per_layer_kept"]["gathered"] == {"": True, **dict.fromkeys(VISION, True),
                                               **lang_default}
    assert f["per_layer_freed"]["gathered"] == {"": True, **dict.fromkeys(VISION, False),
                                                **dict.fromkeys(LANGUAGE, True)}
    # vision.unit=tower: the whole tower one unit, kept gathered after forward
    t = f["tower_unit_kept"]
    assert t["units"] == sorted(["", TOWER, *LANGUAGE])
    assert t["tower_owners"] == {TOWER} and t["tower_mesh"] == shard
    assert t["gathered"] == {"": True, TOWER: True, **lang_default}
    # replicate: the frozen tower outside FSDP2, whole and equal on every rank
    rep = f["replicate"]
    assert rep["units"] == sorted(["", *LANGUAGE])
    assert rep["tower_owners"] == {None} and rep["tower_mesh"] == {(None, None)}
    assert rep["tower_local"] == {"whole"} and rep["other_mesh"] == shard
    assert ranks[1]["replicate"]["tower_sum"] == rep["tower_sum"] != 0
    # a tower that trains is sharded per block under every policy
    tr = f["replicate_trainable_tower"]
    assert tr["units"] == sorted(["", *VISION, *LANGUAGE]) and tr["tower_mesh"] == shard
