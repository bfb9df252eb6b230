"""Before a run resumes: the checkpoint's adapters and base must be this run's.

A ``peft=lora`` checkpoint holds adapters and references its base (``base_ref.py``); a full
checkpoint holds every weight. Resuming one as the other, with another rank or other adapted
layers, or over another base is refused before launch, saying what the checkpoint holds and
what to write instead."""

from __future__ import annotations

import json
import os

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.peft.base_ref import base_reference, same_base
from automodel.peft.export import nf4_record


def _saved_record(path: str) -> dict | None:
    file = os.path.join(path, "trainer.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("peft")


def check_resumed_adapters(cfg: TrainConfig, path: str, key: str) -> None:
    from automodel.peft import uses_adapters

    saved, now = _saved_record(path), uses_adapters(cfg.peft)
    if saved and not now:
        raise ConfigError(f"{key}: {path} is a LoRA checkpoint (adapters of rank {saved['r']} "
                          "and no base weights): resume it with "
                          f"peft={saved.get('method', 'lora')} "
                          f"peft.rank={saved['r']}, or start a run of full fine-tuning from "
                          "its merged export (checkpoint.export_hf; model.pretrained_path=...)")
    if now and not saved:
        raise ConfigError(f"{key}: {path} holds a model trained without adapters: a peft=lora "
                          "run starts from a base model (model.pretrained_path=<its HF "
                          "export>), not from a full checkpoint")
    if not now:
        return
    method, nf4 = saved.get("method", "lora"), nf4_record(cfg.peft)
    if method != str(cfg.peft.method) or saved.get("nf4") != nf4:
        raise ConfigError(f"{key}: {path} holds adapters trained with peft={method}"
                          f"{_sizes(saved.get('nf4'))}; this run asks for "
                          f"peft={cfg.peft.method}{_sizes(nf4)}: set them as saved (the "
                          "adapters fit the base weights they were trained over: full "
                          "precision or the NF4 values)")
    if bool(saved.get("target_parameters")) != cfg.peft.experts:
        raise ConfigError(f"{key}: {path} holds adapters "
                          f"{'with' if saved.get('target_parameters') else 'without'} expert "
                          f"adapters; this run asks for peft.experts={cfg.peft.experts}: set "
                          "it as saved")
    if bool(saved.get("use_dora")) != cfg.peft.use_dora:
        raise ConfigError(f"{key}: {path} holds adapters trained with "
                          f"peft.use_dora={bool(saved.get('use_dora'))}; this run asks for "
                          f"peft.use_dora={cfg.peft.use_dora}: set it as saved")
    if saved["r"] != cfg.peft.rank or saved["lora_alpha"] != cfg.peft.alpha:
        raise ConfigError(f"{key}: {path} holds adapters of rank {saved['r']} and alpha "
                          f"{saved['lora_alpha']}; this run asks for peft.rank={cfg.peft.rank} "
                          f"peft.alpha={cfg.peft.alpha}: set them as saved")
    _check_targets(cfg, path, key, saved)
    base = base_reference(cfg.model, cfg.trainer.seed)
    if not same_base(saved["base"], base):
        raise ConfigError(f"{key}: {path} was trained over another base model than this "
                          f"run's: saved {_describe(saved['base'])}, now {_describe(base)}; "
                          "adapters only fit the base they were trained on")


def _check_targets(cfg: TrainConfig, path: str, key: str, saved: dict) -> None:
    from automodel.models.builder import build_meta_model
    from automodel.peft.targets import adapter_targets

    now = sorted(adapter_targets(build_meta_model(cfg.model), cfg.peft, str(cfg.trainer.loss),
                                 tuple(cfg.model.freeze)))
    if now != saved["target_modules"]:
        gone = sorted(set(saved["target_modules"]) - set(now))
        new = sorted(set(now) - set(saved["target_modules"]))
        raise ConfigError(f"{key}: {path} holds adapters on other layers than this run's "
                          f"peft.target_modules/exclude_modules choose (saved only: "
                          f"{gone[:3]}, now only: {new[:3]}): set them as the saved run had")


def _sizes(nf4: dict | None) -> str:
    return "" if nf4 is None else (f" (peft.nf4_block_size={nf4['block_size']} "
                                   f"peft.nf4_scaler_block_size={nf4['scaler_block_size']})")


def _describe(base: dict) -> str:
    if "sha256" in base:
        return f"{base['pretrained_path']} (fingerprint {base['sha256'][:12]})"
    return f"from config, seed {base['seed']}, dtype {base['dtype']}"
