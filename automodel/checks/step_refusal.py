"""What the preflight's fake step says when a step fails (``fake_step.py``): the error, where
it was raised, and whether a layout is to blame: a step that fails in one process without
parallelism too is not, and the message says so instead of advising another layout."""

from __future__ import annotations

import dataclasses

from automodel.config.resolve import TrainConfig


def casts_parameters(cfg: TrainConfig) -> bool:
    """The mixed-precision policy computes in another dtype than float32."""
    mp = cfg.mp_policy
    return mp is not None and mp.kwargs.get("param_dtype") not in (None, "float32")


def family_name(cfg: TrainConfig) -> str:
    """The model's class and model_type, from its config (nothing built)."""
    from automodel.compat import causal_lm_class, has_causal_lm
    from automodel.models.builder import hf_config

    config = hf_config(cfg.model)
    name = causal_lm_class(config).__name__ if has_causal_lm(config) else type(config).__name__
    return f"{name} (model_type {config.model_type!r})"


def _error_text(err: BaseException) -> str:
    """The error's type, its first lines, and where it was raised."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (f"{type(err).__name__}: {' '.join(lines[:3])[:600].rstrip('.')} (raised in "
            f"{_origin(err)})")


def _origin(err: BaseException) -> str:
    """The innermost frame of ``err``'s traceback: ``path:line, in function``, the path from
    its package on (or from the working directory)."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "an unknown place"
    import os

    frame = frames[-1]
    path = frame.filename
    if "site-packages/" in path:
        path = path.split("site-packages/")[-1]
    elif path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f"{path}:{frame.lineno}, in {frame.name}"


def refusal(cfg: TrainConfig, layout: str, rank_class, layers: int, module: str,
             err: BaseException) -> str:
    what = _error_text(err)
    return (f"{family_name(cfg)} cannot train with {layout}: one training step of "
            f"{rank_class.name} (rank {rank_class.rank}), run before launch on fake tensors "
            f"with the model cut to {layers} layer{'s' if layers > 1 else ''}, fails in {module}: "
            f"{what}. One process without parallelism takes the same step; every rank of this "
            f"layout would fail in step 1. {_advice(cfg, what)} "
            "(distributed.preflight_step=false skips this check.)")


def not_the_layout(cfg: TrainConfig, layers: int, module: str, err: BaseException) -> str:
    return (f"{family_name(cfg)} cannot train: one training step, run before launch on fake "
            f"tensors with the model cut to {layers} layer{'s' if layers > 1 else ''}, fails "
            f"in {module}: {_error_text(err)}. It fails the same way in one process without "
            "any parallelism, so no layout avoids it: the cause is the model's code, its "
            "options (model.config, peft, trainer) or an installed library. "
            "(distributed.preflight_step=false skips this check; step 1 would fail the same "
            "way.)")


def one_process(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as one process without parallelism (``parallelism=none``: no mesh axis, no
    pipeline, no mixed-precision policy or checkpointing), one local batch."""
    from automodel.config import schema as s
    from automodel.config.layout import Layout
    from automodel.config.strategies import strategy

    mesh = s.MeshConfig(dp_size=1, dp_replicate_size=1, cp_ulysses_size=1, pp_size=1)
    t = cfg.trainer
    return dataclasses.replace(
        cfg, strategy=strategy("none"), parallelism=s.SingleProcessConfig(),
        activation_checkpointing="none", mp_policy=None, offload_policy=None, mesh=mesh,
        layout=Layout(), pipeline=None,
        trainer=dataclasses.replace(t, global_batch_size=t.local_batch_size))


def _advice(cfg: TrainConfig, what: str) -> str:
    if casts_parameters(cfg) and any(w in what.lower() for w in _DTYPE_WORDS):
        dtype = cfg.mp_policy.kwargs["param_dtype"]
        return (f"The model's forward does not take its weights in {dtype} "
                f"(parallelism.mp_policy casts them): train it with float32 weights, "
                "parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
                "param_dtype:float32,reduce_dtype:float32}.")
    chosen = _layout_keys(cfg)
    if not chosen:
        return (f"Choose another parallelism than parallelism={cfg.strategy.name} for this "
                "model and options (parallelism=ddp, or none on one process).")
    return (f"Choose another layout, without {' or '.join(chosen)} (docs/options.md lists "
            "what each family supports)" + (", or give the model a parallelism.tp_plan of its "
                                            "own." if cfg.mesh.tp_size > 1 else "."))


def _layout_keys(cfg: TrainConfig) -> list[str]:
    """The model-parallel keys this job sets, as the user writes them."""
    m, out = cfg.mesh, []
    out += [f"mesh.tp_size={m.tp_size}"] if m.tp_size > 1 else []
    out += [f"mesh.cp_size={m.cp_size}"] if m.cp_size > 1 else []
    out += [f"mesh.ep_size={m.ep_size}"] if m.ep_size > 1 else []
    out += [f"pipeline={cfg.pipeline.pp_schedule}"] if cfg.pipeline is not None else []
    return out


_DTYPE_WORDS = ("dtype", "bfloat16", "float16", "half", "scalar type")


