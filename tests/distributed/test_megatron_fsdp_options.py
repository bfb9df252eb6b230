"""parallelism=megatron_fsdp options that act before the wrap or around it (issue 23, items
5-8): tensor parallelism refused before launch, the step's loss scale under
``calculate_per_token_loss``, activation checkpointing of the MLP layers, meta-device
initialization up to the wrap, and the optimizer left as fresh as FSDP2's by the wrap's
warm-up step.

megatron-fsdp 0.6.1 cannot run on CPU (its constructor calls ``torch.cuda`` and its buffers
live on CUDA streams). What runs here is everything automodel does before handing the model
to ``megatron_fsdp.fully_shard``, on real gloo ranks, and the library's own pure code: its
choice of gradient scaling factor and reduce op. Where a test stands in for a CUDA-only part
of the library, it says so. The GPU check is ``benchmarks/megatron_fsdp_gpu.py``.
"""

import types

import pytest
import torch

from automodel.api import load_config
from automodel.config.build import ConfigError
from automodel.distributed.megatron_fsdp import checkpointed_mlps, grad_average_size
from tests.helpers import run_on_ranks


@pytest.mark.fast
def test_tensor_parallelism_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError, match=r"mesh.tp_size=2: parallelism=megatron_fsdp") as err:
        load_config(["parallelism=megatron_fsdp", "mesh.tp_size=2",
                     "distributed.nproc_per_node=4"], str(tmp_path))
    assert "mesh.tp_size=1" in str(err.value) and "parallelism=fsdp2" in str(err.value)


class _Captured(Exception):
    pass


def _library_divisor(monkeypatch, per_token: bool, average: bool, shard: int, outer: int):
    """What megatron-fsdp divides the gradient sum over ``shard`` x ``outer`` ranks by: its
    own ``_init_fsdp_param_and_grad_buffer`` chooses the scaling factor (the buffer it then
    builds is CUDA-only: replaced by a stand-in that stops there) and its own
    ``gradient_reduce_preprocessing`` the reduce op over the shard group. The outer (HSDP)
    reduction runs inside a CUDA stream: averaged with ``average_in_collective``, else
    summed, as ``param_and_grad_buffer`` reads. (``gradient_reduce_div_fusion`` off: the fused
    op is NCCL's premul-sum, the same arithmetic.)"""
    import megatron_fsdp.megatron_fsdp as library
    from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron_fsdp.param_and_grad_buffer import gradient_reduce_preprocessing

    def stand_in(*args, **kwargs):
        raise _Captured(kwargs["gradient_scaling_factor"])

    monkeypatch.setattr(library, "ParamAndGradBuffer", stand_in)
    config = DistributedDataParallelConfig(average_in_collective=average,
                                           gradient_reduce_div_fusion=False)
    group = types.SimpleNamespace(size=lambda: shard * outer)
    wrapper = types.SimpleNamespace(
        calculate_per_token_loss=per_token, ddp_config=config, bucket_size=None,
        fsdp_unit_modules=[], data_parallel_sharding_strategy="optim_grads_params",
        mp_policy=None, module=None, device=None, init_model_with_meta_device=False,
        dist_index=types.SimpleNamespace(get_dp_group=lambda is_expert_parallel=False: group))
    with pytest.raises(_Captured) as captured:
        library.MegatronFSDP._init_fsdp_param_and_grad_buffer(wrapper)
    grad = torch.ones(1, dtype=torch.float64)  # every rank's gradient: 1
    op = gradient_reduce_preprocessing(grad, captured.value.args[0], config)
    inner = grad * (1 if op == torch.distributed.ReduceOp.AVG else shard)
    reduced = inner * (1 if average else outer)
    return shard * outer / reduced.item()


@pytest.mark.fast
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("hsdp", [False, True])
def test_loss_scale_matches_the_library_reduction(per_token, average, hsdp, monkeypatch,
                                                  tmp_path):
    """The step scales each micro-batch loss by ``grad_average_size / global tokens``; the
    reduced gradient is the global token mean's only if that size is what the library
    divides the gradient sum by."""
    cfg = load_config(["parallelism=megatron_fsdp", "distributed.nproc_per_node=4",
                       f"parallelism.calculate_per_token_loss={str(per_token).lower()}",
                       f"parallelism.average_in_collective={str(average).lower()}",
                       f"mesh.dp_replicate_size={2 if hsdp else 1}"], str(tmp_path))
    m = cfg.mesh
    size = grad_average_size(cfg.parallelism, m.dp_size * m.cp_size, m.dp_replicate_size)
    shard = m.dp_size // m.dp_replicate_size * m.cp_size
    assert size == _library_divisor(monkeypatch, per_token, average, shard,
                                    m.dp_replicate_size)
    assert size == (1 if per_token and not (average and hsdp) else 2 if per_token else 4)


@pytest.mark.fast
@pytest.mark.parametrize("name", ["gpt_neox_tiny", "mixtral_tiny", "qwen2_vl_tiny",
                                  "llava_tiny"])
def test_mlps_are_found_from_the_model_structure(name, tmp_path):
    """Dense and mixture-of-experts MLPs, text and vision blocks; a vision embedding unit
    (LLaVA's, a ``_no_split_modules`` class) has none."""
    from automodel.models.builder import build_meta_model
    from automodel.models.parts import block_fqns

    model = build_meta_model(load_config([f"model={name}"], str(tmp_path)).model)
    blocks = block_fqns(model)
    with_attention = [b for b in blocks if "embeddings" not in b]
    assert checkpointed_mlps(model, blocks) == [f"{b}.mlp" for b in with_attention]


def _up_to_the_wrap(rank, world, cfg):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from automodel.distributed.init import DistInfo
    from automodel.distributed.materialize import full_initial_state
    from automodel.parallelize import parallelize
    from automodel.recipes.components import initial_model
    from automodel.recipes.train import build_setup

    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    setup = build_setup(cfg, info)
    model, fill = initial_model(cfg, info)
    part = parallelize(model, setup, fill).parts[0]
    # what fully_shard receives
    facts = {"meta": all(p.is_meta for p in part.parameters()),
             "allocated_bytes": sum(p.numel() * p.element_size() for p in part.parameters()
                                    if not p.is_meta),
             "buffers_on_device": all(b.device.type == "cpu" for b in part.buffers()),
             "checkpointed": [n.replace("_checkpoint_wrapped_module.", "")
                              for n, m in part.named_modules()
                              if isinstance(m, CheckpointWrapper)],
             "setup_grad_average_size": setup.grad_average_size}
    # megatron-fsdp's meta-device initialization (ParamAndGradBuffer: CUDA only, so its
    # protocol is followed here): each parameter's module, the last one named_modules() lists
    # holding it directly, must have reset_parameters; it is given real storage with
    # to_empty(recurse=False), then reset, once, in parameter order
    direct = {}
    for name, m in part.named_modules():
        for p in m.parameters(recurse=False):
            direct[p] = (name, m)
    facts["resettable"] = all(hasattr(m, "reset_parameters") for _, m in direct.values())
    done = set()
    for p in list(part.parameters()):
        name, m = direct[p]
        if p.is_meta and name not in done:
            m.to_empty(device=torch.device("cpu"), recurse=False)
            m.reset_parameters()
            done.add(name)
    reference = full_initial_state(cfg.model, cfg.trainer.seed)  # one process's weights
    got = {n.replace("_checkpoint_wrapped_module.", ""): p
           for n, p in part.named_parameters(remove_duplicate=False)}
    facts["equal"] = sorted(n for n, p in got.items() if torch.equal(p, reference[n]))
    facts["names"] = sorted(got)
    facts["tied"] = part.lm_head.weight is part.model.embed_tokens.weight
    facts["rng"] = torch.get_rng_state()
    return facts


def test_checkpointed_mlps_and_meta_init_up_to_the_wrap(tmp_path):
    """``activation_checkpointing=true`` wraps each block's MLP, not the block; under
    ``init_fsdp_with_meta_device=true`` the model reaches the wrap with every parameter on
    the meta device (no bytes allocated), and the library's per-module initialization then
    gives each rank the weights of a one-process run, bit for bit, tied embeddings still
    tied. Also: the runner's loss scale (per-token loss: a sum over the ranks)."""
    cfg = load_config(["parallelism=megatron_fsdp", "distributed.nproc_per_node=2",
                       "parallelism.activation_checkpointing=true",
                       "parallelism.init_fsdp_with_meta_device=true",
                       "parallelism.calculate_per_token_loss=true",
                       "model.config.tie_word_embeddings=true"], str(tmp_path))
    facts = run_on_ranks(_up_to_the_wrap, 2, cfg, tmp_path=tmp_path)
    for f in facts:
        assert f["meta"] and f["allocated_bytes"] == 0 and f["buffers_on_device"]
        assert f["checkpointed"] == [f"model.layers.{i}.mlp" for i in range(4)]
        assert f["setup_grad_average_size"] == 1
        assert f["resettable"]
        assert f["equal"] == f["names"] and "lm_head.weight" in f["names"] and f["tied"]
    assert torch.equal(facts[0]["rng"], facts[1]["rng"])


@pytest.mark.fast
def test_gpu_benchmark_configurations_are_valid():
    """The GPU check's CPU part: every run it would train validates, and TP is refused."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_fsdp_gpu.py"
    spec = importlib.util.spec_from_file_location("megatron_fsdp_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--steps", "2"]) == 0
    assert set(bench.RUNS) >= {"per_token", "mlp_checkpointing", "meta_init"}


def _library_warmup(params, replace_groups: bool):
    """What megatron-fsdp 0.6.1's ``fully_shard`` does to the optimizer (its wrap needs CUDA,
    so this sequence is copied from it): give it one group of the wrapped parameters (from
    the defaults; ``fully_shard``), then pre-allocate the state with one step on zero
    gradients (``fully_shard_optimizer``). ``replace_groups=False``: the step alone."""
    def warmup(optimizer):
        if replace_groups:
            optimizer.param_groups.clear()
            optimizer.state.clear()
            optimizer.add_param_group({"params": params})
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
        return optimizer
    return warmup


def _three_steps(kind: str, replace_groups: bool | None):
    """Weights, optimizer and schedule after 3 steps; ``replace_groups`` None: no warm-up.
    The schedule is built before the warm-up when the groups survive it, after when the
    library replaces them (as the recipe builds it after the wrap)."""
    from automodel.config.schema import OptimConfig
    from automodel.distributed.megatron_fsdp import fresh_after_warmup
    from automodel.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    cfg = OptimConfig(lr=0.05, weight_decay=0.1, warmup_steps=2)
    params = list(model.parameters())
    opt = (build_optimizer(params, cfg) if kind == "adamw" else  # Adam: L2 weight decay
           torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, amsgrad=True))
    sched = build_scheduler(opt, cfg, 3) if not replace_groups else None
    if replace_groups is not None:
        opt = fresh_after_warmup(opt, _library_warmup(params, replace_groups))
    sched = sched or build_scheduler(opt, cfg, 3)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    x = torch.randn(4, 6)
    for _ in range(3):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model.state_dict(), opt, groups


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["adamw", "adam_l2"])
@pytest.mark.parametrize("replace_groups", [False, True])
def test_optimizer_is_fresh_after_the_library_warmup(kind, replace_groups):
    """megatron-fsdp's wrap steps the optimizer once on zero gradients; under
    ``fresh_after_warmup`` the next 3 real steps give the weights of an optimizer that never
    had that step, bit for bit (without it: one weight decay and a step count ahead), with
    the same learning rates (the schedule's lr and initial_lr kept) and step counts."""
    want, fresh, fresh_groups = _three_steps(kind, None)
    got, opt, groups = _three_steps(kind, replace_groups)
    assert groups == fresh_groups
    assert all(torch.equal(got[k], want[k]) for k in want)
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        state, fresh_state = opt.state[p], fresh.state[q]
        assert state["step"].dtype == fresh_state["step"].dtype and state["step"] == 3
        assert state["step"].device == fresh_state["step"].device
