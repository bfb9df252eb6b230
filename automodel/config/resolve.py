"""THE boundary: composed Hydra config (DictConfig) -> typed, validated ``TrainConfig``.

Pure Python (no torch): every rule that needs only numbers and names runs here, before any
process or process group exists. Facts that need the live model or mesh are checked later by
the code that owns them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from automodel.config import schema as s
from automodel.config.build import ConfigError, build
from automodel.config.policies import PolicySpec, resolve_policy
from automodel.config.validate import (
    check_ac_and_strategy,
    check_checkpoint,
    check_distributed,
    check_dtype,
    check_logger,
    check_optim,
    check_tensor_parallel,
    check_trainer_options,
    resolve_mesh,
    resolve_trainer,
)
from automodel.config.validate_data import check_data, check_data_with_layout
from automodel.config.validate_pipeline import check_pipeline, check_pipeline_model
from automodel.launch.env import LaunchEnv, detect_launch_env

log = logging.getLogger(__name__)

STRATEGIES = {  # schema class -> strategy name
    s.SingleProcessConfig: "none",
    s.DDPConfig: "ddp",
    s.FSDP2Config: "fsdp2",
    s.MegatronFSDPConfig: "megatron_fsdp",
}

DATA_SOURCES = {s.CorpusDataConfig: "corpus", s.SyntheticDataConfig: "synthetic",
                s.FilesDataConfig: "files", s.HFDataConfig: "hf", s.TokensDataConfig: "tokens"}


@dataclass
class TrainConfig:
    """Everything a rank needs, validated. Picklable: the launcher hands it to every rank."""

    strategy: str  # none | ddp | fsdp2 | megatron_fsdp
    parallelism: Any  # the strategy's schema dataclass, with normalized values
    activation_checkpointing: str  # none | full | selective
    activation_checkpointing_scope: List[str]  # ["all"] or groups
    mp_policy: Optional[PolicySpec]
    offload_policy: Optional[PolicySpec]
    mesh: s.MeshConfig  # every size an int
    pipeline: Optional[s.PipelineConfig]
    distributed: s.DistributedConfig
    model: s.ModelConfig
    data_source: str  # corpus | synthetic | files | hf | tokens
    data: Any
    optim: s.OptimConfig
    trainer: s.TrainerConfig  # local_batch_size resolved
    launch: LaunchEnv
    logger: s.LoggerConfig = field(default_factory=s.LoggerConfig)
    checkpoint: s.CheckpointConfig = field(default_factory=s.CheckpointConfig)
    output_dir: str = "."
    sweep_dir: Optional[str] = None  # the multirun's directory when this job is one of a sweep
    choices: Dict[str, Any] = field(default_factory=dict)  # hydra.runtime.choices
    overrides: List[str] = field(default_factory=list)
    resolved: Dict[str, Any] = field(default_factory=dict)  # the composed config, plain

    @property
    def world_size(self) -> int:
        m = self.mesh
        return m.dp_size * m.tp_size * m.cp_size * m.pp_size

    @property
    def grad_accum_steps(self) -> int:
        return self.trainer.global_batch_size // (self.trainer.local_batch_size * self.mesh.dp_size)


def _schema_of(node, table: Mapping, path: str):
    from omegaconf import OmegaConf

    cls = OmegaConf.get_type(node)
    if cls not in table:
        raise ConfigError(f"'{path}' has no known schema (got {cls}); choose one of "
                          f"the files in conf/{path}/")
    return cls


def _user_model_config_keys(overrides: list) -> set:
    """Keys of model.config set on the command line (``model.config.X=``, ``+``, ``++``)."""
    keys = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("model.config."):
            keys.add(key[len("model.config."):].split(".")[0])
    return keys


def _pretrained_keeps_its_config(model: s.ModelConfig, overrides: list) -> s.ModelConfig:
    """With ``model.pretrained_path`` the checkpoint's own config.json describes the model: a
    preset's ``model.config`` (e.g. llama_tiny's sizes) is not applied to it, only keys the
    user set on the command line."""
    if model.pretrained_path is None:
        return model
    user = _user_model_config_keys(overrides)
    dropped = sorted(k for k in model.config if k not in user)
    if dropped:
        log.info("model.pretrained_path=%s: loading it with its own config; the %s preset's "
                 "model.config keys (%s) are not applied (set model.config.KEY=... to override "
                 "one)", model.pretrained_path, model.name, ", ".join(dropped))
    return dataclasses.replace(model, config={k: v for k, v in model.config.items() if k in user})


def resolve(cfg, env: Optional[Mapping[str, str]] = None, output_dir: str = ".",
            choices: Optional[dict] = None, overrides: Optional[list] = None,
            sweep_dir: Optional[str] = None) -> TrainConfig:
    """Turn the composed config into a ``TrainConfig`` or raise ``ConfigError``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    env = os.environ if env is None else env
    expected = {"mesh", "distributed", "trainer", "parallelism", "pipeline", "model", "data",
                "optim",
                "logger", "checkpoint"}
    extra = sorted(set(cfg.keys()) - expected - {"hydra"})
    if extra:
        raise ConfigError(f"unknown top-level key(s) {extra}; allowed: {sorted(expected)}")
    try:
        plain = {key: OmegaConf.to_container(cfg[key], resolve=True, throw_on_missing=True)
                 if OmegaConf.is_config(cfg[key]) else cfg[key]
                 for key in cfg.keys() if key != "hydra"}
    except MissingMandatoryValue as err:
        raise ConfigError(f"'{err.full_key}' must be set "
                          "(it is '???' in the chosen config)") from None

    par_cls = _schema_of(cfg.parallelism, STRATEGIES, "parallelism")
    strategy = STRATEGIES[par_cls]
    par = build(par_cls, plain["parallelism"], "parallelism")
    pipeline_chosen = OmegaConf.get_type(cfg.pipeline) is s.PipelineConfig
    if not pipeline_chosen and plain.get("pipeline"):
        raise ConfigError(f"pipeline.{next(iter(plain['pipeline']))} is set but no pipeline "
                          "schedule is chosen: add pipeline=1f1b "
                          "(or another file of conf/pipeline/)")
    pipeline = build(s.PipelineConfig, plain["pipeline"], "pipeline") if pipeline_chosen else None
    data_cls = _schema_of(cfg.data, DATA_SOURCES, "data")

    launch = detect_launch_env(env)
    distributed = build(s.DistributedConfig, plain["distributed"], "distributed")
    check_distributed(distributed)
    mesh = resolve_mesh(strategy, build(s.MeshConfig, plain["mesh"], "mesh"), launch,
                         distributed, pipeline_chosen)
    trainer = resolve_trainer(build(s.TrainerConfig, plain["trainer"], "trainer"), mesh)
    ac_mode, ac_scope = check_ac_and_strategy(strategy, par, mesh)
    mp_policy = offload_policy = None
    if strategy == "fsdp2":
        mp_policy = resolve_policy("parallelism.mp_policy", par.mp_policy)
        offload_policy = resolve_policy("parallelism.offload_policy", par.offload_policy)
    if pipeline is not None:
        check_pipeline(pipeline, mesh, trainer, par)
    model = _pretrained_keeps_its_config(build(s.ModelConfig, plain["model"], "model"),
                                         overrides or [])
    check_dtype("model.dtype", model.dtype, allow_none=False)
    if strategy in ("fsdp2", "megatron_fsdp"):
        check_tensor_parallel(par, mesh, model, trainer)
    if pipeline is not None:
        check_pipeline_model(pipeline, mesh, model, trainer)
    data = build(data_cls, plain["data"], "data")
    check_data(DATA_SOURCES[data_cls], data, model)
    check_trainer_options(trainer, pipeline, par)
    check_data_with_layout(DATA_SOURCES[data_cls], data, trainer, mesh, pipeline, par)
    optim = build(s.OptimConfig, plain["optim"], "optim")
    check_optim(optim)
    logger = build(s.LoggerConfig, plain.get("logger"), "logger")
    check_logger(logger)
    checkpoint = build(s.CheckpointConfig, plain.get("checkpoint"), "checkpoint")
    check_checkpoint(checkpoint, trainer, output_dir)
    if launch.kind == "local":
        distributed = dataclasses.replace(distributed, nproc_per_node=mesh.dp_size * mesh.tp_size
                                          * mesh.cp_size * mesh.pp_size)
    return TrainConfig(
        strategy=strategy, parallelism=par, activation_checkpointing=ac_mode,
        activation_checkpointing_scope=ac_scope, mp_policy=mp_policy,
        offload_policy=offload_policy, mesh=mesh, pipeline=pipeline, distributed=distributed,
        model=model, data_source=DATA_SOURCES[data_cls], data=data, optim=optim, trainer=trainer,
        launch=launch, logger=logger, checkpoint=checkpoint, output_dir=output_dir,
        sweep_dir=sweep_dir,
        choices=dict(choices or {}),
        overrides=list(overrides or []), resolved=plain)


