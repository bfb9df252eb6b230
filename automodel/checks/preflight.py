"""``preflight``: the checks every entry point runs on a resolved config before any rank or
process group starts, and before a SLURM job is queued.

The model checks build the model on the meta device (no weights are read or allocated, so this
costs the same for 70B as for a tiny model): its tensor-parallel plan is resolved and checked
against its modules and sizes, and its pipeline anatomy (embedding, layers, norm, head) is
found. Each check is the one the runtime itself uses, so what passes here runs there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Union

from automodel.checks.fake_step import check_fake_step
from automodel.checks.support import check_runtime_support
from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig

log = logging.getLogger(__name__)

THIS_MACHINE = "this machine"  # preflight(gpus=...): the job's ranks run where it is called


def preflight(cfg: TrainConfig, *, gpus: Union[int, None, str] = THIS_MACHINE) -> None:
    """Run ``PREFLIGHT_CHECKS`` in order on a resolved config; raise ``ConfigError`` at the
    first that fails. Every entry point calls this one function: ``train.py``
    (``automodel/cli.py``), ``automodel.api.run``, the benchmarks (``benchmarks/common.py``),
    a SLURM submission before anything is queued (``launchers/slurm.py``, and
    ``hydra/launcher=slurm`` through ``automodel/launch/hydra_slurm.py``), and each SLURM task
    again before its rank starts.

    ``gpus``: the GPUs each of the job's ranks will see. Default: this machine's
    (``cfg.launch.gpus``). A submitter passes the job's request (``gpus_per_node``), or None
    when the job names none, and the tasks, which run the preflight again, check for a GPU.

    The data check builds the ``data=hf`` / ``tokens`` token cache (content-addressed, under
    a file lock): a SLURM task that runs after its submitter finds the entry the submitter
    built and only opens it."""
    if gpus != THIS_MACHINE:
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, gpus=gpus))
    for _name, check in PREFLIGHT_CHECKS:
        check(cfg)


def check_model_layout(cfg: TrainConfig, model=None) -> None:
    """Raise ``ConfigError`` for a TP plan, context-parallel split or pipeline split the model
    cannot take, or image inputs that cannot be derived for an image-text model. ``model``:
    the model built on the meta device already (a search checks many layouts of one model),
    else built here."""
    check_image_inputs(cfg)
    m = cfg.mesh
    if m.tp_size == 1 and m.pp_size == 1 and m.cp_size == 1 and m.ep_size == 1:
        return
    from automodel.config.validate_pipeline import check_pipeline_model
    from automodel.distributed import context_parallel, expert_parallel
    from automodel.distributed.pipelining.stage_images import check_first_stage
    from automodel.distributed.pipelining.stages import stage_contents
    from automodel.models.anatomy import find_anatomy
    from automodel.models.builder import build_meta_model

    try:
        model = build_meta_model(cfg.model) if model is None else model
    except Exception as err:  # transformers' own config checks raise several kinds
        raise ConfigError(f"model: cannot build {_which(cfg)}: {type(err).__name__}: "
                          f"{err}") from None
    from automodel.models.multimodal import is_image_text

    if is_image_text(model.config):
        _check_image_text_layout(model, m, cfg.layout.pp)
    try:
        tp_heads = _check_tp_plan(cfg, model) if m.tp_size > 1 else 1
        if m.cp_size > 1:
            context_parallel.check_model(model, m.cp_size, m.cp_ulysses_size or 1, tp_heads)
        expert_parallel.check_layout(model, m.ep_size, pipeline=cfg.pipeline,
                                     sequence_parallel=m.tp_size > 1 and getattr(
                                         cfg.parallelism, "sequence_parallel", False))
        if cfg.pipeline is not None:
            anatomy = find_anatomy(model)
            check_pipeline_model(cfg.pipeline, cfg.mesh, cfg.model, cfg.trainer,
                                 layers=anatomy.num_layers)
            contents, _ = stage_contents(model, anatomy, cfg.pipeline, m.pp_size)
            if is_image_text(model.config):
                check_first_stage(model, len(contents[0].layers))
    except ValueError as err:  # (ConfigError is one)
        raise ConfigError(str(err)) from None


def _check_image_text_layout(model, m, pp: int) -> None:
    """The layouts an image-text model cannot take in this version."""
    name = type(model).__name__
    if pp > 1 and m.cp_size > 1:
        raise ConfigError(f"{name} is an image-text model: a pipeline with context "
                          f"parallelism (mesh.pp_size={pp}, mesh.cp_size={m.cp_size}) is not "
                          "available for image-text models in this version (each takes "
                          "them alone); keep one of the two at 1")


def _check_tp_plan(cfg: TrainConfig, model) -> int:
    """The TP plan on the model: its patterns, what ``mesh.tp_size`` must divide, and (for
    an image-text model) each language block part split consistently. Returns how many ways
    attention heads are split."""
    from automodel.distributed.tensor_parallel import (
        check_divisibility,
        expand_plan,
        plan_gap,
        splits_heads,
    )
    from automodel.models.multimodal import is_image_text
    from automodel.models.parts import block_fqns
    from automodel.models.tp_plans import select_tp_plan, vision_tp

    tp = cfg.mesh.tp_size
    plan, source = select_tp_plan(model, getattr(cfg.parallelism, "tp_plan", None),
                                  vision_tp(cfg.parallelism), tp)
    concrete = expand_plan(model, plan, source)
    check_divisibility(model, concrete, tp)
    sp = getattr(cfg.parallelism, "sequence_parallel", False)
    gap = plan_gap(model, concrete, block_fqns(model), sp) if is_image_text(model.config) \
        else None
    if gap:
        raise ConfigError(f"{type(model).__name__} with mesh.tp_size={tp}"
                          f"{' and sequence parallelism' if sp else ''}: {gap} ({source}); "
                          "choose another layout"
                          f"{' (parallelism.sequence_parallel=false)' if sp else ''}, or give "
                          "a parallelism.tp_plan that splits it")
    return tp if splits_heads(concrete) else 1


def check_adapters(cfg: TrainConfig, model=None) -> None:
    """``peft``'s targets on the meta model (``model``, else built here): patterns that match
    no linear layer (with the nearest names), a rank wider than a layer, the LM head under the
    fused loss, a clash with ``model.freeze``; under QLoRA, weights that do not split into
    whole NF4 scale groups."""
    from automodel.compat import QLORA_INTERNALS, check_entries
    from automodel.config.enums import PeftMethod
    from automodel.models.builder import build_meta_model
    from automodel.peft import AdapterError, adapter_targets, uses_adapters
    from automodel.peft.nf4 import nf4_refusal

    if not uses_adapters(cfg.peft):
        return
    model = build_meta_model(cfg.model) if model is None else model
    try:
        targets = adapter_targets(model, cfg.peft, str(cfg.trainer.loss),
                                  tuple(cfg.model.freeze))
    except AdapterError as err:
        raise ConfigError(str(err)) from None
    if cfg.peft.method == PeftMethod.qlora:
        check_entries(QLORA_INTERNALS)
        shards = cfg.layout.dp_shard_cp if cfg.strategy.materialize_after_wrap else 1
        for name in targets:
            why = nf4_refusal(name, tuple(model.get_submodule(name).weight.shape),
                              cfg.peft.nf4_block_size, cfg.peft.nf4_scaler_block_size, shards)
            if why:
                raise ConfigError(f"peft=qlora: {why}")


def check_image_inputs(cfg: TrainConfig) -> None:
    """The model must be one automodel builds: a causal LM, or an image-text model (a
    ``vision_config``). An image-text model is built on the meta device, and the image inputs it
    takes and the image tokens one image fills derived (``models/image_inputs.py``), as the
    ranks will; a family for which any of that fails is refused here, naming what is missing
    (a package to install, a vision_config, an input)."""
    from automodel.models.builder import build_meta_model, hf_config
    from automodel.models.multimodal import is_image_text

    try:
        config = hf_config(cfg.model)
    except Exception as err:  # transformers' own config checks raise several kinds
        raise ConfigError(f"model ({_which(cfg)}): transformers refuses its config: "
                          f"{type(err).__name__}: {_first_line(err)}") from None
    if not is_image_text(config):
        _check_causal_lm(cfg, config)
        return
    try:
        model = build_meta_model(cfg.model)
    except ImportError as err:
        package = _missing_package(err)
        raise ConfigError(f"model ({_which(cfg)}): building {type(config).__name__}'s model "
                          f"needs the package {package!r}, which is not installed: pip install "
                          f"{package}") from None
    except Exception as err:  # the family's own modeling code
        raise ConfigError(f"model ({_which(cfg)}): cannot build {type(config).__name__}'s "
                          f"model: {type(err).__name__}: {_first_line(err)}") from None
    from automodel.data.registry import data_source, image_text_refusal

    source = data_source(cfg.data_source)
    if source.image_text is None:
        raise ConfigError(image_text_refusal(source.name, type(model).__name__))
    check_images = source.hook("image_check")  # (the images the source makes, generated or
    try:  # through the model's processor: the family must take them)
        check_images(model)
    except ValueError as err:
        raise ConfigError(f"model ({_which(cfg)}): {err}; this image-text family cannot train "
                          "in automodel (docs/image_text.md lists the families)") from None


def _check_causal_lm(cfg: TrainConfig, config) -> None:
    """A config without a ``vision_config`` is built as a causal LM: transformers must have
    one for it. Image-text families whose images come another way (discrete image codes in a
    ``vq_config``, a protein encoder, an encoder-decoder) have none, and are named here."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT,
    )

    from automodel.compat import causal_lm_class, has_causal_lm

    if has_causal_lm(config):
        if config.model_type in IMAGE_TEXT:  # (emu3, fuyu: images without a vision_config)
            log.warning("model_type %r is an image-text family without a vision_config: "
                        "automodel builds %s, its text model, and feeds it text only",
                        config.model_type, causal_lm_class(config).__name__)
        return
    subs = [k for k in (getattr(config, "sub_configs", None) or {})
            if getattr(config, k, None) is not None]
    kind = ("an encoder-decoder model" if getattr(config, "is_encoder_decoder", False)
            or {"encoder", "decoder"} <= set(subs) else
            f"a model with {', '.join(subs)} and no vision_config" if subs else
            "a model with neither a vision_config nor a causal-LM class")
    raise ConfigError(f"model ({_which(cfg)}): {type(config).__name__} is {kind}: automodel "
                      "builds image-text models from a vision_config (a vision tower whose "
                      "features fill the image tokens) and text models with "
                      "AutoModelForCausalLM, which has no class for model_type "
                      f"{config.model_type!r}")


def _missing_package(err: ImportError) -> str:
    import re

    found = re.search(r"pip install (?:-U )?`?([A-Za-z0-9_.\-]+)", str(err))
    return found.group(1) if found else (err.name or str(err)).split(".")[0]


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:2])[:500]


def _which(cfg: TrainConfig) -> str:
    m = cfg.model
    return (f"model.pretrained_path={m.pretrained_path!r}" if m.pretrained_path else
            f"model.config.model_type={m.config.get('model_type')!r}")


def prepare_data(cfg: TrainConfig) -> None:
    """The data source's ``prepare`` hook (``data=hf`` / ``tokens``: build, or find, the token
    cache and check it against the model's vocabulary) before any rank starts, so bad data
    fails here with its reason. (Under torchrun or SLURM every rank gets here; one builds, the
    others wait on the cache's lock.)"""
    from automodel.data.registry import data_source

    source = data_source(cfg.data_source)
    if source.prepare is None:
        return
    from automodel.models.builder import hf_config
    from automodel.models.multimodal import text_config

    prepare = source.hook("prepare")
    try:
        prepare(cfg.data, text_config(hf_config(cfg.model)).vocab_size)
    except ValueError as err:
        raise ConfigError(f"data={cfg.data_source}: {err}") from None


def check_resume_checkpoint(cfg: TrainConfig) -> None:
    """The checkpoint ``checkpoint.resume`` names (or, with ``auto``, the latest complete one in
    ``checkpoint.dir``), and the one ``checkpoint.initial_load_path`` names, is whole: its
    metadata reads and no shard file is missing or truncated.
    (Reading the metadata needs torch.distributed.checkpoint, so this is not a config check;
    the config checks that an explicit path exists.)"""
    from automodel.peft.resume import check_resumed_adapters

    c = cfg.checkpoint
    if c.initial_load_path is not None:
        _check_whole("checkpoint.initial_load_path", c.initial_load_path)
        check_resumed_adapters(cfg, c.initial_load_path, "checkpoint.initial_load_path")
    if c.resume is None:
        return
    from automodel.checkpoint.paths import checkpoint_root, complete_checkpoints

    key, path = "checkpoint.resume", c.resume
    if c.resume == "auto":
        found = complete_checkpoints(checkpoint_root(c.dir, cfg.output_dir))
        key, path = "checkpoint.resume=auto found", (found[-1] if found else None)
    if path is None:
        return
    _check_whole(key, path)
    _check_model_only(key, path, c.exclude_from_loading)
    check_resumed_adapters(cfg, path, key)


def _check_model_only(key: str, path: str, exclude) -> None:
    """A checkpoint saved without its optimizer (``last_save_model_only``) resumes only with
    the optimizer left out."""
    import json
    import os

    with open(os.path.join(path, "trainer.json")) as f:
        model_only = json.load(f).get("model_only", False)
    if model_only and "optimizer" not in exclude:
        raise ConfigError(f"{key} {path}: it holds the model's weights only (saved with "
                          "checkpoint.last_save_model_only=true); start from them with "
                          f"checkpoint.initial_load_path={path}, or resume with "
                          "checkpoint.exclude_from_loading=[optimizer]")


def _check_whole(key: str, path: str) -> None:
    from automodel.checkpoint.verify import check_files
    from automodel.errors import CheckpointError

    try:
        check_files(path)
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None


# What a resolved config must pass before anything starts, in order: what the machine can run,
# the checkpoint to resume from, what the model can take, then the data. ``preflight`` runs
# them; nothing else calls them in sequence.
def warn_split_axes(cfg: TrainConfig) -> None:
    """On several nodes (ranks filling a node before the next), warn from rank 0, and from a
    submitter, when a group of tp, cp or HSDP's dp_shard would span nodes."""
    from automodel.config.nodes import blocks, split_axes_warning

    launch = cfg.launch
    world, per_node = launch.world_size, launch.local_world_size
    if launch.rank != 0 or not world or not per_node or per_node >= world:
        return
    message = split_axes_warning(cfg.layout, blocks(world, per_node))
    if message:
        log.warning(message)


# the checks whose verdict depends on the layout, given the model built on the meta device:
# what a search asks of each candidate (``prepare/admission.py``)
LAYOUT_CHECKS = (check_model_layout, check_adapters)

PREFLIGHT_CHECKS = (
    ("runtime support", check_runtime_support),
    ("resume checkpoint", check_resume_checkpoint),
    ("model layout", check_model_layout),
    ("adapters", check_adapters),
    ("fake step", check_fake_step),
    ("data", prepare_data),
    ("nodes", warn_split_axes),
)
