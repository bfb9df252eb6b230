"""Every validation rule of the resolve boundary, through real Hydra composition."""

import dataclasses
import logging

import pytest

from automodel.api import load_config
from automodel.config.build import ConfigError

# fast: no process, no process group (pytest -m fast)
pytestmark = pytest.mark.fast

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")


def cfg(*overrides, env=None):
    return load_config(list(overrides), env=env or {})


def error(*overrides, env=None) -> str:
    with pytest.raises(ConfigError) as info:
        cfg(*overrides, env=env)
    return str(info.value)


# ----------------------------------------------------------------------------- mesh and world
def test_default_world_is_two_ranks_for_data_parallel_strategies():
    for strategy in ("ddp", "fsdp2"):
        c = cfg(f"parallelism={strategy}")
        assert (c.mesh.dp_size, c.world_size, c.distributed.nproc_per_node) == (2, 2, 2)
    c = cfg("parallelism=none")
    assert c.world_size == 1 and c.distributed.nproc_per_node == 1


def test_hsdp_defaults_to_a_2x2_mesh():
    c = cfg("parallelism=hsdp")
    from automodel.config.strategies import strategy

    # its own entry (config/strategies.py), FSDP2's wrap and options
    assert c.strategy.name == "hsdp" and c.strategy.wrap == strategy("fsdp2").wrap
    assert dataclasses.asdict(c.parallelism) == dataclasses.asdict(cfg().parallelism)
    assert (c.mesh.dp_replicate_size, c.mesh.dp_size, c.world_size) == (2, 4, 4)


def test_dp_inferred_from_nproc_per_node():
    c = cfg("parallelism=fsdp2", "distributed.nproc_per_node=4")
    assert c.mesh.dp_size == 4 and c.grad_accum_steps == 1


def test_dp_inferred_from_torchrun_world():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "x",
           "TORCHELASTIC_RUN_ID": "r"}
    c = cfg("parallelism=ddp", env=env)
    assert c.launch.kind == "torchrun" and c.mesh.dp_size == 4


def test_size_product_must_match_world():
    msg = error("parallelism=fsdp2", "mesh.dp_size=3", "distributed.nproc_per_node=4")
    assert "mesh.dp_size=3" in msg or "3*1*1*1" in msg
    assert "distributed.nproc_per_node=4" in msg and "mesh.dp_size=4" in msg


def test_world_not_divisible_by_model_parallel_sizes():
    msg = error("parallelism=fsdp2", "mesh.tp_size=2", "distributed.nproc_per_node=3")
    assert "not divisible" in msg and "mesh.tp_size" in msg


def test_sizes_must_be_positive():
    assert "mesh.tp_size=0" in error("mesh.tp_size=0")


def test_dp_replicate_only_with_fsdp2():
    msg = error("parallelism=ddp", "mesh.dp_replicate_size=2")
    assert "mesh.dp_replicate_size=2" in msg and "fsdp2" in msg


def test_dp_replicate_must_divide_dp():
    msg = error("parallelism=fsdp2", "mesh.dp_replicate_size=2", "mesh.dp_size=3")
    assert "must divide" in msg and "dp=3" in msg


@pytest.mark.parametrize("axis", ["tp_size", "cp_size", "ep_size"])
def test_ddp_rejects_model_parallel_axes(axis):
    msg = error("parallelism=ddp", f"mesh.{axis}=2")
    assert f"mesh.{axis}=2" in msg and "parallelism=ddp" in msg


def test_ddp_rejects_pipeline():
    msg = error("parallelism=ddp", "pipeline=1f1b")
    assert "mesh.pp_size=2" in msg and "parallelism=ddp" in msg


@pytest.mark.parametrize("override", ["pipeline=gpipe", "mesh.ep_size=2"])
def test_megatron_fsdp_rejects_pp_and_ep(override):
    msg = error("parallelism=megatron_fsdp", override)
    assert "megatron_fsdp" in msg and ("pp_size" in msg or "ep_size" in msg)


def test_none_strategy_is_single_process():
    msg = error("parallelism=none", "distributed.nproc_per_node=2")
    assert "parallelism=none" in msg


def test_cp_ulysses_must_divide_cp():
    msg = error("parallelism=fsdp2", "mesh.cp_size=2", "mesh.cp_ulysses_size=3")
    assert "mesh.cp_ulysses_size=3" in msg


@pytest.mark.parametrize("cp,seq_len,fits", [(2, 30, "28 or 32"), (4, 36, "32 or 40"),
                                             (4, 6, "8")])
def test_context_parallel_needs_two_equal_chunks_per_rank(cp, seq_len, fits):
    msg = error("parallelism=fsdp2", f"mesh.cp_size={cp}", f"trainer.seq_len={seq_len}")
    assert (f"trainer.seq_len={seq_len} must be divisible by 2 * mesh.cp_size = {2 * cp}" in msg
            and f"use trainer.seq_len={fits}" in msg)


def test_context_parallel_with_sequence_parallel_splits_each_ranks_tokens_by_tp():
    # 24 tokens: 12 per cp rank, not divisible by tp=8 (24 itself is divisible by 2*cp)
    msg = error("parallelism=fsdp2", "mesh.cp_size=2", "mesh.tp_size=8", "trainer.seq_len=24",
                "parallelism.sequence_parallel=true")
    assert "trainer.seq_len=24 / mesh.cp_size=2 = 12 per cp rank" in msg and "tp_size=8" in msg


def test_ep_must_divide_dp_cp_tp():
    msg = error("parallelism=fsdp2", "mesh.ep_size=3", "distributed.nproc_per_node=2")
    assert "mesh.ep_size=3" in msg


def test_pipeline_implies_pp2_and_pp_without_schedule_fails():
    c = cfg("parallelism=fsdp2", "pipeline=interleaved")
    assert c.mesh.pp_size == 2 and c.pipeline.pp_schedule == "interleaved_1f1b"
    assert c.world_size == 2 and c.mesh.dp_size == 1
    assert "needs a pipeline schedule" in error("mesh.pp_size=2")
    assert "pipeline needs" in error("pipeline=1f1b", "mesh.pp_size=1")


# ----------------------------------------------------------------------------- batches
def test_global_batch_divisible_by_local_times_dp():
    msg = error("parallelism=ddp", "trainer.global_batch_size=10", "trainer.local_batch_size=3")
    assert "trainer.global_batch_size=10" in msg and "3*2" in msg


def test_local_batch_defaults_to_global_over_dp_and_accumulation():
    c = cfg("parallelism=ddp", "trainer.global_batch_size=16", "trainer.local_batch_size=2")
    assert c.grad_accum_steps == 4
    c = cfg("parallelism=ddp", "trainer.global_batch_size=16")
    assert c.trainer.local_batch_size == 8 and c.grad_accum_steps == 1


def test_global_batch_must_divide_by_dp():
    assert "divisible by the data-parallel size" in error("parallelism=ddp",
                                                          "trainer.global_batch_size=7")


def test_pipeline_batch_divisible_by_microbatch():
    msg = error("parallelism=fsdp2", "pipeline=1f1b", "pipeline.pp_batch_size=8",
                "pipeline.pp_microbatch_size=3")
    assert "pipeline.pp_microbatch_size=3" in msg
    msg = error("parallelism=fsdp2", "pipeline=1f1b", "pipeline.pp_batch_size=6")
    assert "pipeline.pp_batch_size=6 must divide" in msg


def test_pipeline_takes_sequence_parallel_tp_and_compile():
    # stages pass each TP rank's sequence shard (tests/distributed/
    # test_pipeline_sequence_parallel.py); compile with TP turns sequence parallelism on
    for extra in ("parallelism.sequence_parallel=true", "parallelism.enable_compile=true"):
        c = cfg("parallelism=fsdp2", "pipeline=1f1b", "mesh.tp_size=2", extra)
        assert c.pipeline is not None and c.parallelism.sequence_parallel is True
    msg = error("parallelism=fsdp2", "pipeline=1f1b", "mesh.tp_size=2", "trainer.seq_len=63",
                "parallelism.sequence_parallel=true")
    assert "trainer.seq_len=63 must be divisible by mesh.tp_size=2" in msg


def test_pipeline_stages_against_the_model():
    msg = error("parallelism=fsdp2", "pipeline=interleaved", "mesh.pp_size=4",
                "distributed.nproc_per_node=4")
    assert "needs 8 stages" in msg and "num_hidden_layers=4" in msg
    # tied embeddings are fine: the first and last stages keep their copies equal
    assert cfg("parallelism=fsdp2", "pipeline=1f1b", "model.config.tie_word_embeddings=true")
    assert "layers_per_stage=9" in error("parallelism=fsdp2", "pipeline=interleaved",
                                         "pipeline.layers_per_stage=9")
    assert "one stage per rank" in error("parallelism=fsdp2", "pipeline=1f1b",
                                         "pipeline.layers_per_stage=1")
    assert cfg("parallelism=fsdp2", "pipeline=1f1b", "pipeline.layers_per_stage=2")


# ----------------------------------------------------------------------------- strategy options
@pytest.mark.parametrize("value,mode", [("false", "none"), ("true", "full"), ("full", "full"),
                                        ("selective", "selective")])
def test_activation_checkpointing_values(value, mode):
    assert cfg("parallelism=ddp", f"parallelism.activation_checkpointing={value}"
               ).activation_checkpointing == mode


def test_activation_checkpointing_bad_value():
    msg = error("parallelism=fsdp2", "parallelism.activation_checkpointing=partial")
    assert "'partial'" in msg and "selective" in msg


def test_selective_ac_not_for_megatron():
    # Megatron-FSDP's schema types the field as bool (MLP checkpointing on/off).
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="activation_checkpointing=selective"):
        cfg("parallelism=megatron_fsdp", "parallelism.activation_checkpointing=selective")


def test_ac_scope_values():
    assert cfg("parallelism.activation_checkpointing_scope=[language]"
               ).activation_checkpointing_scope == ["language"]
    assert cfg().activation_checkpointing_scope == ["all"]
    msg = error("parallelism.activation_checkpointing_scope=[language,text]")
    assert "'text'" in msg and "vision" in msg


def test_async_tp_forces_sequence_parallel_with_warning(caplog):
    with caplog.at_level(logging.WARNING):
        c = cfg("parallelism=fsdp2", "parallelism.enable_async_tensor_parallel=true")
    assert c.parallelism.sequence_parallel is True
    assert "sequence_parallel=true" in caplog.text


def test_autocast_dtype_names():
    assert cfg("parallelism.autocast_dtype=bfloat16").parallelism.autocast_dtype == "bfloat16"
    assert "bf17" in error("parallelism.autocast_dtype=bf17")


def test_mp_policy_default_and_target():
    c = cfg("parallelism=fsdp2")
    assert c.mp_policy.name == "MixedPrecisionPolicy"
    assert c.mp_policy.kwargs == {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                                  "output_dtype": None, "cast_forward_inputs": False}
    c = cfg("parallelism=fsdp2", FP32)
    assert c.mp_policy.kwargs["param_dtype"] == "float32"
    msg = error("parallelism=fsdp2", "parallelism.mp_policy={_target_:torch.nn.Linear}")
    assert "torch.nn.Linear" in msg and "MixedPrecisionPolicy" in msg
    msg = error("parallelism=fsdp2", "parallelism.mp_policy={_target_:torch.distributed.fsdp."
                "MixedPrecisionPolicy,param_dtype:int8}")
    assert "param_dtype='int8'" in msg


def test_offload_policy_keys():
    c = cfg("parallelism=fsdp2",
            "parallelism.offload_policy={_target_:torch.distributed.fsdp.CPUOffloadPolicy}")
    assert c.offload_policy.name == "CPUOffloadPolicy"
    msg = error("parallelism=fsdp2", "parallelism.offload_policy={_target_:torch.distributed."
                "fsdp.CPUOffloadPolicy,pin:false}")
    assert "parallelism.offload_policy.pin" in msg and "pin_memory" in msg


def test_ddp_bucket_cap_must_be_positive_or_null():
    for value in ("-1", "0", "-0.5"):
        msg = error("parallelism=ddp", f"parallelism.bucket_cap_mb={value}")
        assert f"parallelism.bucket_cap_mb={float(value)}" in msg
        assert "> 0" in msg and "null" in msg
    assert cfg("parallelism=ddp", "parallelism.bucket_cap_mb=0.5").parallelism.bucket_cap_mb == 0.5
    assert cfg("parallelism=ddp").parallelism.bucket_cap_mb is None


def test_wandb_mode_may_be_left_to_the_environment():
    assert cfg("logger=wandb").logger.wandb.mode is None
    assert cfg("logger=wandb", "logger.wandb.mode=offline").logger.wandb.mode == "offline"
    msg = error("logger=wandb", "logger.wandb.mode=offlne")
    assert "logger.wandb.mode='offlne'" in msg and "offline" in msg and "null" in msg


def test_megatron_zero_strategy():
    assert cfg("parallelism=megatron_fsdp", "parallelism.zero_dp_strategy=optim_grads")
    assert "zero_dp_strategy=7" in error("parallelism=megatron_fsdp",
                                         "parallelism.zero_dp_strategy=7")


def test_pipeline_schedule_names():
    assert cfg("parallelism=fsdp2", "pipeline=1f1b", "pipeline.pp_schedule=ZBVZeroBubble")
    msg = error("parallelism=fsdp2", "pipeline=1f1b", "pipeline.pp_schedule=zigzag")
    assert "'zigzag'" in msg and "interleaved_1f1b" in msg


def test_pipeline_csv_must_exist(tmp_path):
    msg = error("parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={tmp_path}/x.csv")
    assert "x.csv" in msg and "no such file" in msg
    assert "pipeline.pp_schedule_csv=" in error("parallelism=fsdp2", "pipeline=csv")
    from tests.helpers import write_schedule_csv

    good = write_schedule_csv(tmp_path / "s.csv", pp=2, n_microbatches=16)
    c = cfg("parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={good}")
    assert c.pipeline.pp_schedule_csv == good
    assert "schedules 16 micro-batches but the pipeline batch makes 8" in error(
        "parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={good}",
        "pipeline.pp_microbatch_size=2")
    (tmp_path / "bad.csv").write_text("0F0,0X1\n1F0,1B0\n")
    msg = error("parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={tmp_path}/bad.csv")
    assert "row 1, column 2: '0X1'" in msg
    (tmp_path / "dup.csv").write_text("0F0,0B0\n0F0,0B0\n")
    msg = error("parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={tmp_path}/dup.csv")
    assert "stage 0 appears on rows 1 and 2" in msg
    (tmp_path / "rows.csv").write_text("0F0,0B0\n")
    assert "1 rows but mesh.pp_size=2" in error(
        "parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={tmp_path}/rows.csv")


# ----------------------------------------------------------------------------- schema checks
def test_unknown_key_added_with_plus_is_rejected():
    msg = error("+parallelism.bucket_cap=25", "parallelism=ddp")
    assert "parallelism.bucket_cap" in msg and "parallelism.bucket_cap_mb" in msg


def test_unknown_top_level_key_is_rejected():
    assert "foo" in error("+foo=1")


def test_wrong_type_rejected_by_schema():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="parallelism.static_graph"):
        cfg("parallelism=ddp", "parallelism.static_graph=[1]")


def test_boundary_checks_types_of_plain_mappings():
    from automodel.config.build import build
    from automodel.config.schema import DDPConfig, MeshConfig

    with pytest.raises(ConfigError, match=r"parallelism.static_graph=\[1\]: expected bool"):
        build(DDPConfig, {"static_graph": [1]}, "parallelism")
    with pytest.raises(ConfigError, match="mesh.tp_size=True: expected int"):
        build(MeshConfig, {"tp_size": True}, "mesh")
    assert build(MeshConfig, {"tp_size": 2}, "mesh").tp_size == 2


def test_pipeline_keys_without_schedule():
    msg = error("+pipeline.pp_microbatch_size=2")
    assert "pipeline" in msg


def test_data_and_model_checks(tmp_path):
    assert "no such file" in error("data=files", f"data.paths=[{tmp_path}/missing.txt]")
    assert "data.paths is empty" in error("data=files")
    assert "data.vocab_size=999" in error("data=synthetic", "data.vocab_size=999")
    assert "byte-level" in error("model.config.vocab_size=100")
    assert "num_attention_heads=3 must divide model.config.hidden_size=64" in error(
        "model.config.num_attention_heads=3")
    assert "num_key_value_heads=3" in error("model.config.num_key_value_heads=3")
    assert "optim.lr=0.0" in error("optim.lr=0")
    assert "distributed.backend='tcp'" in error("distributed.backend=tcp")


# ----------------------------------------------------------------------------- tensor parallel
def test_tp_numbers_come_from_the_model_config():
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2")
    assert (c.mesh.tp_size, c.mesh.dp_size, c.world_size) == (2, 1, 2)
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2", "mesh.dp_size=2")
    assert c.world_size == 4


def layout_error(*overrides) -> str:
    """The checks on the model's own structure, run before launch (meta device)."""
    from automodel.checks.preflight import check_model_layout

    with pytest.raises(ConfigError) as info:
        check_model_layout(cfg(*overrides))
    return str(info.value)


def test_tp_must_divide_heads_kv_heads_vocab_and_sp_seq_len():
    msg = layout_error("parallelism=fsdp2", "mesh.tp_size=4")
    assert "num_key_value_heads=2" in msg and "mesh.tp_size=4" in msg
    msg = layout_error("parallelism=fsdp2", "mesh.tp_size=3", "model.config.num_attention_heads=6",
                       "model.config.hidden_size=72", "model.config.num_key_value_heads=6")
    assert "vocab_size=256" in msg
    msg = layout_error("parallelism=fsdp2", "mesh.tp_size=2", "model.config.num_attention_heads=6",
                       "model.config.hidden_size=72", "model.config.num_key_value_heads=3")
    assert "num_key_value_heads=3" in msg
    msg = error("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.sequence_parallel=true",
                "trainer.seq_len=33")
    assert "trainer.seq_len=33" in msg


def test_tp_numbers_from_a_pretrained_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 6, '
                                          '"num_key_value_heads": 6, "vocab_size": 256, '
                                          '"hidden_size": 48, "num_hidden_layers": 2}')
    msg = layout_error("parallelism=fsdp2", "mesh.tp_size=4", "model=pretrained",
                       f"model.pretrained_path={tmp_path}")
    assert "num_attention_heads=6" in msg


def test_pretrained_path_alone_loads_the_checkpoint_with_its_own_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 2, '
                                          '"num_key_value_heads": 2, "vocab_size": 300, '
                                          '"hidden_size": 48, "num_hidden_layers": 2}')
    c = cfg(f"model.pretrained_path={tmp_path}")  # the default model group (llama_tiny)
    assert c.model.config == {}  # its preset's sizes are not applied to the checkpoint
    c = cfg(f"model.pretrained_path={tmp_path}", "model.config.rms_norm_eps=1e-6")
    assert c.model.config == {"rms_norm_eps": 1e-6}  # what the user sets still applies


def test_tp_plan_values():
    msg = error("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.tp_plan={lm_head:colwize}")
    assert "'colwize'" in msg and "'lm_head'" in msg and "colwise_gather_output" in msg
    assert "import path" in error("parallelism=fsdp2", "parallelism.tp_plan=notapath")
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.tp_plan=pkg.mod.PLAN")
    assert c.parallelism.tp_plan == "pkg.mod.PLAN"


def test_compile_with_tp_turns_on_sequence_parallel(caplog):
    with caplog.at_level(logging.WARNING):
        c = cfg("parallelism=fsdp2", "mesh.tp_size=2", "parallelism.enable_compile=true")
    assert c.parallelism.sequence_parallel is True and "compiled TP layers" in caplog.text


def test_few_micro_batches_warn_about_the_bubble(caplog):
    with caplog.at_level(logging.WARNING):
        cfg("parallelism=fsdp2", "pipeline=interleaved", "trainer.global_batch_size=2",
            "pipeline.pp_microbatch_size=1")
    assert "2 micro-batches for 4 stages" in caplog.text and "bubble" in caplog.text


def test_checkpoint_rules(tmp_path):
    assert "checkpoint.resume='/nope'" in error("checkpoint.resume=/nope")
    assert cfg("checkpoint.resume=auto", "checkpoint.every_steps=5").checkpoint.every_steps == 5
    assert "checkpoint.every_steps=0" in error("checkpoint.every_steps=0")
    assert cfg("parallelism=fsdp2", "pipeline=1f1b", "checkpoint.every_steps=2").pipeline
    assert "trainer.on_nonfinite='ignore': allowed: raise, skip" in error(
        "trainer.on_nonfinite=ignore")
    assert "distributed.stop_grace_seconds" in error("distributed.stop_grace_seconds=-1")
    assert "trainer.stop_at_step=200" in error("trainer.max_steps=10", "trainer.stop_at_step=200")
