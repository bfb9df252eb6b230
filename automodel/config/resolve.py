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
from typing import Any, Dict, List, Mapping, Optional, Union

from automodel.config import schema as s
from automodel.config.build import ConfigError, build
from automodel.config.checkpoint_dir import resolve_checkpoint
from automodel.config.launch_env import LaunchEnv, detect_launch_env
from automodel.config.layout import Layout
from automodel.config.policies import PolicySpec
from automodel.config.strategies import STRATEGIES, Strategy
from automodel.config.validate import (
    check_checkpoint,
    check_distributed,
    check_optim,
    check_tensor_memory,
    check_tensor_parallel,
    check_trainer_options,
    resolve_sequence_parallel,
)
from automodel.config.validate_data import check_data, check_data_with_layout
from automodel.config.validate_layout import resolve_layout, resolve_trainer
from automodel.config.validate_model import check_model
from automodel.config.validate_peft import check_peft
from automodel.config.validate_pipeline import check_pipeline, check_pipeline_model
from automodel.data.registry import DATA_SOURCES

log = logging.getLogger(__name__)

# The shipped strategies' schemas (a strategy registered outside automodel has its own).
ParallelismOptions = Union[s.SingleProcessConfig, s.DDPConfig, s.FSDP2Config, s.HSDPConfig,
                           s.MegatronFSDPConfig]
# The shipped data sources' schemas (a source registered outside automodel has its own).
DataOptions = Union[s.CorpusDataConfig, s.SyntheticDataConfig, s.FilesDataConfig,
                    s.HFDataConfig, s.TokensDataConfig]


@dataclass
class TrainConfig:
    """Everything a rank needs, validated. Picklable: the launcher hands it to every rank."""

    strategy: Strategy  # the entry of config/strategies.STRATEGIES: none | ddp | fsdp2 | ...
    parallelism: ParallelismOptions  # the strategy's schema dataclass, with normalized values
    activation_checkpointing: str  # an ACMode (config/enums.py): none | full | selective
    activation_checkpointing_scope: List[str]  # ["all"] or groups
    mp_policy: Optional[PolicySpec]
    offload_policy: Optional[PolicySpec]
    mesh: s.MeshConfig  # every size an int
    layout: Layout  # the degrees, axes and divisors of the mesh (config/layout.py)
    pipeline: Optional[s.PipelineConfig]
    distributed: s.DistributedConfig
    model: s.ModelConfig
    data_source: str  # a name of data/registry.DATA_SOURCES: corpus | synthetic | files | ...
    data: DataOptions  # the source's schema dataclass, checked
    optim: s.OptimConfig
    trainer: s.TrainerConfig  # local_batch_size resolved
    launch: LaunchEnv
    logger: s.LoggerConfig = field(default_factory=s.LoggerConfig)
    checkpoint: s.CheckpointConfig = field(default_factory=s.CheckpointConfig)
    peft: s.PeftConfig = field(default_factory=s.PeftConfig)  # adapters (method none: none)
    output_dir: str = "."
    experiment: Optional[str] = None  # names a folder shared by its submissions (checkpoints)
    sweep_dir: Optional[str] = None  # the multirun's directory when this job is one of a sweep
    layout_mode: str = "manual"  # layout=: manual | auto (prepare/auto_layout.py chooses it)
    choices: Dict[str, Any] = field(default_factory=dict)  # hydra.runtime.choices
    overrides: List[str] = field(default_factory=list)
    resolved: Dict[str, Any] = field(default_factory=dict)  # the composed config, plain

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def cpu_offload(self) -> bool:
        """FSDP2 keeps the parameters, gradients and optimizer states on the host."""
        return self.offload_policy is not None and self.offload_policy.name == "CPUOffloadPolicy"

    @property
    def grad_accum_steps(self) -> int:
        return self.layout.grad_accum_steps(self.trainer.global_batch_size,
                                            self.trainer.local_batch_size)


def _compute_dtype(mp_policy, par, model: s.ModelConfig) -> str:
    """The dtype the layers compute in: the mixed-precision policy's, else autocast's, else
    the model's own."""
    cast = mp_policy.kwargs.get("param_dtype") if mp_policy is not None else None
    return cast or getattr(par, "autocast_dtype", None) or model.dtype


LAYOUT_MODES = ("manual", "auto")


def _layout_mode(plain: dict) -> str:
    mode = str(plain.get("layout") or "manual")
    if mode not in LAYOUT_MODES:
        raise ConfigError(f"layout={mode!r}: allowed: {', '.join(LAYOUT_MODES)} (auto: the "
                          "planner chooses the layout for the job's GPUs)")
    return mode


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


def _plain_nodes(cfg) -> dict:
    """The composed config's nodes as plain containers (interpolations resolved)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    expected = {"mesh", "distributed", "trainer", "parallelism", "pipeline", "model", "data",
                "optim", "logger", "checkpoint", "experiment", "peft", "layout"}
    extra = sorted(set(cfg.keys()) - expected - {"hydra"})
    if extra:
        raise ConfigError(f"unknown top-level key(s) {extra}; allowed: {sorted(expected)}")
    try:
        return {key: OmegaConf.to_container(cfg[key], resolve=True, throw_on_missing=True,
                                            enum_to_str=True)  # (build() makes the members)
                if OmegaConf.is_config(cfg[key]) else cfg[key]
                for key in cfg.keys() if key != "hydra"}
    except MissingMandatoryValue as err:
        raise ConfigError(f"'{err.full_key}' must be set "
                          "(it is '???' in the chosen config)") from None


def _chosen_groups(cfg, plain: dict):
    """The strategy, its options, the pipeline (or None) and the data source that the config
    groups chose, each found by its node's schema."""
    from omegaconf import OmegaConf

    strategy = STRATEGIES.of_schema(OmegaConf.get_type(cfg.parallelism))
    par = build(strategy.schema, plain["parallelism"], "parallelism")
    pipeline_chosen = OmegaConf.get_type(cfg.pipeline) is s.PipelineConfig
    if not pipeline_chosen and plain.get("pipeline"):
        raise ConfigError(f"pipeline.{next(iter(plain['pipeline']))} is set but no pipeline "
                          "schedule is chosen: add pipeline=1f1b "
                          "(or another file of conf/pipeline/)")
    pipeline = build(s.PipelineConfig, plain["pipeline"], "pipeline") if pipeline_chosen else None
    source = DATA_SOURCES.of_schema(OmegaConf.get_type(cfg.data))
    return strategy, par, pipeline, source


def resolve(cfg, env: Optional[Mapping[str, str]] = None, output_dir: str = ".",
            choices: Optional[dict] = None, overrides: Optional[list] = None,
            sweep_dir: Optional[str] = None,
            output_named_by_time: bool = False) -> TrainConfig:
    """Turn the composed config into a ``TrainConfig`` or raise ``ConfigError``.
    ``output_named_by_time``: ``output_dir`` is new for every submission (Hydra's default)."""
    env = os.environ if env is None else env
    plain = _plain_nodes(cfg)
    strategy, par, pipeline, source = _chosen_groups(cfg, plain)
    pipeline_chosen = pipeline is not None

    launch = detect_launch_env(env)
    distributed = build(s.DistributedConfig, plain["distributed"], "distributed")
    check_distributed(distributed)
    mesh = build(s.MeshConfig, plain["mesh"], "mesh")
    layout = resolve_layout(strategy, mesh, launch, distributed, pipeline_chosen)
    mesh, par = layout.resolved(mesh), resolve_sequence_parallel(strategy, par, layout)
    trainer = resolve_trainer(build(s.TrainerConfig, plain["trainer"], "trainer"), layout)
    resolved_par = strategy.check(par, layout)  # (a ResolvedParallelism: config/strategies)
    par = resolved_par.options
    if pipeline is not None:
        check_pipeline(pipeline, mesh, trainer, par)
    model = _pretrained_keeps_its_config(build(s.ModelConfig, plain["model"], "model"),
                                         overrides or [])
    check_model(model)
    if strategy.tensor_parallel:
        check_tensor_parallel(par, layout, model, trainer)
    if pipeline is not None:
        check_pipeline_model(pipeline, mesh, model, trainer)
    data = check_data(source, build(source.schema, plain["data"], "data"), model)
    check_trainer_options(trainer, pipeline, strategy)
    check_tensor_memory(trainer, par)
    check_data_with_layout(data, trainer, mesh, pipeline, par)
    optim = build(s.OptimConfig, plain["optim"], "optim")
    check_optim(optim)
    logger = build(s.LoggerConfig, plain.get("logger"), "logger")
    checkpoint = build(s.CheckpointConfig, plain.get("checkpoint"), "checkpoint")
    checkpoint = check_checkpoint(checkpoint)
    peft = check_peft(build(s.PeftConfig, plain.get("peft"), "peft"), strategy, layout,
                      _compute_dtype(resolved_par.mp_policy, par, model))
    experiment = plain.get("experiment")
    layout_mode = _layout_mode(plain)
    checkpoint = resolve_checkpoint(checkpoint, experiment, output_dir, sweep_dir,
                                    output_named_by_time)
    if launch.kind == "local":
        distributed = dataclasses.replace(distributed, nproc_per_node=layout.world_size)
    return TrainConfig(
        strategy=strategy, parallelism=par,
        activation_checkpointing=resolved_par.activation_checkpointing,
        activation_checkpointing_scope=list(resolved_par.activation_checkpointing_scope),
        mp_policy=resolved_par.mp_policy, offload_policy=resolved_par.offload_policy,
        mesh=mesh, layout=layout, pipeline=pipeline,
        distributed=distributed, model=model, data_source=source.name, data=data,
        optim=optim, trainer=trainer,
        launch=launch, logger=logger, checkpoint=checkpoint, peft=peft, output_dir=output_dir,
        experiment=experiment, sweep_dir=sweep_dir, layout_mode=layout_mode,
        choices=dict(choices or {}),
        overrides=list(overrides or []), resolved=plain)


