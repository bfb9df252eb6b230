"""parallelism=megatron_fsdp: the installed megatron-fsdp package, every option reaching its
``fully_shard``, and the refusal on a machine without CUDA.

megatron-fsdp runs on NVIDIA GPUs only; no GPU exists in CI. What is checked here: the package
imports; the keyword arguments automodel builds from a config with every option changed from
its default bind to the real signature of the installed ``megatron_fsdp.fully_shard`` and
carry each value; and a CPU run is refused before any process starts, saying why and what
to use instead. Training with it is checked on a GPU (``benchmarks/megatron_fsdp_gpu.py``).
"""

import inspect

import pytest
import torch

from automodel.api import load_config
from automodel.config.build import ConfigError
from automodel.distributed.megatron_fsdp import fully_shard_kwargs, refusal
from tests.cli.test_cli import NO_GPU, run
from tests.helpers import run_on_ranks

EVERY_OPTION = [
    "parallelism=megatron_fsdp", "parallelism.zero_dp_strategy=optim_grads",
    "parallelism.megatron_fsdp_unit_modules=[transformers.models.llama.modeling_llama."
    "LlamaDecoderLayer]",
    "parallelism.overlap_grad_reduce=false", "parallelism.overlap_param_gather=false",
    "parallelism.grad_reduce_in_fp32=true", "parallelism.preserve_fp32_weights=true",
    "parallelism.init_fsdp_with_meta_device=true", "parallelism.average_in_collective=true",
    "parallelism.calculate_per_token_loss=true", "parallelism.disable_bucketing=true",
    "parallelism.fsdp_double_buffer=true", "parallelism.nccl_ub=true",
    "parallelism.keep_fp8_transpose_cache=true", "parallelism.report_nan_in_param_grad=true",
]


def _kwargs_on_ranks(rank, world, opts, hsdp):
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.distributed.mesh import build_mesh

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=2 if hsdp else 1,
                      dp_shard=1 if hsdp else 2, cp=1, tp=1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1))
    kwargs = fully_shard_kwargs(opts, model, mesh.device_mesh, hsdp=hsdp, tp=False,
                                device=torch.device("cpu"))
    import megatron_fsdp

    optimizer = torch.optim.AdamW(model.parameters())
    bound = inspect.signature(megatron_fsdp.fully_shard).bind(model, optimizer, **kwargs)
    policy = kwargs["mixed_precision_policy"]
    return {"bound": sorted(bound.arguments), "units": [c.__name__ for c in
                                                         kwargs["fsdp_unit_modules"]],
            "zero": kwargs["zero_dp_strategy"], "outer": kwargs["dp_outer_dim"],
            "shard": kwargs["dp_shard_dim"], "tp": kwargs["tp_dim"],
            "hybrid": kwargs.get("hybrid_fsdp_group") is not None,
            "policy": (policy.main_params_dtype, policy.main_grads_dtype,
                       policy.grad_comm_dtype),
            **{k: kwargs[k] for k in ("overlap_grad_reduce", "overlap_param_gather",
                                      "average_in_collective", "calculate_per_token_loss",
                                      "disable_bucketing", "fsdp_double_buffer", "nccl_ub",
                                      "keep_fp8_transpose_cache", "report_nan_in_param_grad",
                                      "init_model_with_meta_device")}}


@pytest.mark.parametrize("hsdp", [False, True])
def test_every_option_reaches_the_installed_fully_shard(hsdp, tmp_path):
    overrides = EVERY_OPTION + (["mesh.dp_replicate_size=2"] if hsdp else [])
    opts = load_config(overrides + ["distributed.nproc_per_node=2"], str(tmp_path)).parallelism
    facts = run_on_ranks(_kwargs_on_ranks, 2, opts, hsdp, tmp_path=tmp_path)[0]
    assert {"module", "optimizer", "device_mesh", "fsdp_unit_modules",
            "mixed_precision_policy"} <= set(facts["bound"])
    assert facts["units"] == ["LlamaDecoderLayer"]
    assert facts["zero"] == "optim_grads"
    assert facts["shard"] == "dp_shard_cp" and facts["tp"] is None
    assert facts["outer"] == ("dp_replicate" if hsdp else None) and facts["hybrid"] == hsdp
    assert facts["policy"] == (torch.float32, torch.float32, torch.float32)
    # every switch changed from its default arrives changed
    assert not facts["overlap_grad_reduce"] and not facts["overlap_param_gather"]
    assert all(facts[k] for k in ("average_in_collective", "calculate_per_token_loss",
                                  "disable_bucketing", "fsdp_double_buffer", "nccl_ub",
                                  "keep_fp8_transpose_cache", "report_nan_in_param_grad",
                                  "init_model_with_meta_device"))


def test_defaults_use_the_models_blocks_and_its_own_dtypes(tmp_path):
    opts = load_config(["parallelism=megatron_fsdp", "distributed.nproc_per_node=2"],
                       str(tmp_path)).parallelism
    facts = run_on_ranks(_kwargs_on_ranks, 2, opts, False, tmp_path=tmp_path)[0]
    assert facts["units"] == ["LlamaDecoderLayer"]  # from the model's _no_split_modules
    assert facts["zero"] == "optim_grads_params"
    # preserve_fp32_weights defaults to false, grad_reduce_in_fp32 too
    assert facts["policy"] == (None, None, None)


@pytest.mark.fast
def test_refusal_names_the_reason_and_the_fix():
    assert "no visible GPU" in refusal(0, None) and "parallelism=fsdp2" in refusal(0, None)
    assert "distributed.backend=gloo" in refusal(1, "gloo")
    assert refusal(8, None) is None and refusal(8, "nccl") is None


@pytest.mark.fast
def test_cpu_run_is_refused_before_any_process_starts(tmp_path):
    out = run(["parallelism=megatron_fsdp"], tmp_path, NO_GPU)  # (on any machine)
    assert out.returncode == 2, out.stderr
    assert "runs on NVIDIA GPUs only" in out.stderr and "parallelism=fsdp2" in out.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.fast
def test_api_refuses_it_too(tmp_path):
    from automodel.api import run as api_run

    with pytest.raises(ConfigError, match="runs on NVIDIA GPUs only"):
        api_run(["parallelism=megatron_fsdp"], output_dir=str(tmp_path))
