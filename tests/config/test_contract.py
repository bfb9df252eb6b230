"""The config contract: names, types and defaults of shared/reference/options.md, as composed."""

import pytest

from automodel.api import compose

# fast: no process, no process group (pytest -m fast)
pytestmark = pytest.mark.fast

MISSING = object()

DDP = {"activation_checkpointing": False, "activation_checkpointing_scope": "all",
       "autocast_dtype": None, "broadcast_buffers": False, "bucket_cap_mb": None,
       "find_unused_parameters": False, "gradient_as_bucket_view": False, "static_graph": False}
FSDP2 = {"activation_checkpointing": False, "activation_checkpointing_scope": "all",
         "autocast_dtype": None, "sequence_parallel": False, "tp_plan": None,
         "enable_async_tensor_parallel": False, "enable_compile": False,
         "enable_fsdp2_prefetch": True, "fsdp2_forward_prefetch_depth": 1,
         "fsdp2_backward_prefetch_depth": 2, "reshard_after_forward": None,
         "defer_fsdp_grad_sync": True, "mp_policy": None, "offload_policy": None,
         "patch_is_packed_sequence": False}
MEGATRON = {"zero_dp_strategy": 3, "megatron_fsdp_unit_modules": None,
            "activation_checkpointing": False, "overlap_grad_reduce": True,
            "overlap_param_gather": True, "grad_reduce_in_fp32": False,
            "preserve_fp32_weights": False, "init_fsdp_with_meta_device": False,
            "average_in_collective": False, "calculate_per_token_loss": False,
            "disable_bucketing": False, "fsdp_double_buffer": False, "nccl_ub": False,
            "keep_fp8_transpose_cache": False, "check_for_nan_in_grad": True,
            "report_nan_in_param_grad": False}
PIPELINE = {"pp_schedule": "1f1b", "pp_schedule_csv": None, "pp_microbatch_size": 1,
            "layers_per_stage": None, "round_virtual_stages_to_pp_multiple": None,
            "module_fqns_per_model_part": None, "pp_seq_len": None, "dtype": None,
            "scale_grads_in_schedule": False, "patch_causal_lm_model": True,
            "patch_inner_model": True, "patch_stage_backward_maybe_with_nosync": False,
            "pp_recv_buffer_pool": False, "pp_recv_buffer_pool_slack": 2,
            "pp_batch_size": None, "loss_fn": None}
MESH = {"dp_size": None, "dp_replicate_size": None, "tp_size": 1, "cp_size": 1,
        "cp_ulysses_size": None, "pp_size": None, "ep_size": 1}
DISTRIBUTED = {"backend": None, "timeout_minutes": 1, "nproc_per_node": None,
               "stop_grace_seconds": 120, "startup_timeout_minutes": 30,
               "preflight_step": True, "max_restarts": 0}
TRAINER = ("max_steps", "global_batch_size", "local_batch_size", "seq_len", "seed", "log_every",
           "stop_at_step", "on_nonfinite")
CHECKPOINT = {"every_steps": None, "dir": None, "keep_last": 3, "resume": None,
              "export_hf": "never", "export_dtype": None, "export_max_shard_size": "5GB",
              "last_save_model_only": False,
              "exclude_from_loading": [], "initial_load_path": None, "async_mode": "none",
              "pinned_memory": False, "save_timeout_minutes": 30.0}


@pytest.mark.parametrize("choice,expected", [("ddp", DDP), ("fsdp2", FSDP2), ("hsdp", FSDP2),
                                             ("megatron_fsdp", MEGATRON)])
def test_parallelism_fields_and_defaults(choice, expected):
    node = compose([f"parallelism={choice}"]).parallelism
    for name, default in expected.items():
        assert name in node, f"parallelism={choice} lacks {name}"
        assert node[name] == default, f"parallelism.{name}: {node[name]!r} != {default!r}"
    if choice in ("fsdp2", "hsdp"):
        assert node.multimodal.frozen_sharding == "root"


@pytest.mark.parametrize("choice,schedule", [
    ("1f1b", "1f1b"), ("gpipe", "gpipe"), ("interleaved", "interleaved_1f1b"),
    ("looped_bfs", "looped_bfs"), ("dfs", "dfs"), ("v_schedule", "v_schedule"),
    ("zero_bubble", "zero_bubble"), ("csv", "csv")])
def test_pipeline_files(choice, schedule):
    node = compose(["parallelism=fsdp2", f"pipeline={choice}"]).pipeline
    assert node.pp_schedule == schedule
    for name, default in PIPELINE.items():
        if name != "pp_schedule":
            assert node[name] == default, name


def test_pipeline_none_is_empty():
    assert not compose([]).pipeline


def test_mesh_distributed_trainer_nodes():
    cfg = compose([])
    assert dict(cfg.mesh) == MESH
    assert dict(cfg.distributed) == DISTRIBUTED
    assert all(name in cfg.trainer for name in TRAINER)
    assert dict(cfg.checkpoint) == CHECKPOINT
    assert cfg.model.name == "llama_tiny" and cfg.model.config.model_type == "llama"
    assert cfg.model.pretrained_path is None


def test_every_field_settable_from_the_command_line():
    cfg = compose(["parallelism=ddp", "parallelism.bucket_cap_mb=12.5", "mesh.tp_size=1",
                   "distributed.timeout_minutes=3", "trainer.seq_len=32"])
    assert cfg.parallelism.bucket_cap_mb == 12.5 and cfg.distributed.timeout_minutes == 3
