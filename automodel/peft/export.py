"""The adapters of a checkpoint as peft writes them, and merged into the weights.

A checkpoint of a ``peft=lora`` run records its adapters' settings in ``trainer.json``
(``"peft"``: rank, alpha, the adapted modules, the base model's path). The export then writes

- the merged model: ``W + (alpha / r) B A`` in every adapted layer (under DoRA, each row of
  it scaled to its trained length ``m``), a plain Hugging Face
  model (transformers loads it without peft); under QLoRA ``W`` is the weight's NF4 form,
  dequantized (what the adapters were trained against);
- the adapter alone, in peft's format: ``adapter_config.json`` and
  ``adapter_model.safetensors`` with the keys ``base_model.model.<module>.lora_A.weight``;
  ``peft.PeftModel.from_pretrained(<base model>, <adapter dir>)`` loads it (a QLoRA adapter
  over the full-precision base, as QLoRA adapters are used: the logits then differ from
  training's by the quantization error).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from automodel.config import schema as s
from automodel.config.enums import PeftMethod
from automodel.peft.base_ref import base_reference
from automodel.peft.experts import expert_update, peft_keys, to_peft_layout
from automodel.peft.lora import ADAPTER_CHILDREN, EXPERT_SUFFIXES, MAGNITUDE, is_adapter
from automodel.peft.nf4 import dequantized, to_nf4

PEFT_PREFIX = "base_model.model."


def adapter_record(peft: s.PeftConfig, modules: list[str], model: s.ModelConfig,
                   seed: int, experts: dict | None = None,
                   transposed: list[str] | None = None) -> dict:
    """What ``trainer.json`` keeps of a run's adapters, and of its base
    (``base_ref.base_reference``: the checkpoint does not hold the base). ``transposed``:
    the adapted ``Conv1D`` layers (weights [in, out]: peft's ``fan_in_fan_out``)."""
    record = {"method": str(peft.method), "r": peft.rank, "lora_alpha": peft.alpha,
              "lora_dropout": peft.dropout, "use_dora": peft.use_dora,
              "target_modules": sorted(modules),
              "base_model_name_or_path": model.pretrained_path,
              "base": base_reference(model, seed)}
    if transposed:
        record["fan_in_fan_out"] = sorted(transposed)
    if experts:  # expert weights' full names -> stored transposed
        record["target_parameters"] = dict(experts)
    if nf4_record(peft) is not None:  # (the base trained on: each weight's NF4 values)
        record["nf4"] = nf4_record(peft)
    return record


def nf4_record(peft: s.PeftConfig) -> dict | None:
    """A QLoRA run's NF4 sizes as ``trainer.json`` keeps them; None for LoRA."""
    if peft.method != PeftMethod.qlora:
        return None
    return {"block_size": peft.nf4_block_size, "scaler_block_size": peft.nf4_scaler_block_size}


def split_state(state: dict) -> tuple[dict, dict]:
    """(base weights, adapters) of a full model state."""
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    return base, {k: v for k, v in state.items() if is_adapter(k)}


def adapters_of(names, record: dict) -> list[str]:
    """The adapters' names that the merge of the base tensors ``names`` reads."""
    names = set(names)
    out = []
    for module in record["target_modules"]:
        if f"{module}.weight" in names:
            out += [f"{module}.{child}.weight" for child in ADAPTER_CHILDREN]
            out += [f"{module}.{MAGNITUDE}"] if record.get("use_dora") else []
    for name in record.get("target_parameters", {}):
        if name in names:
            out += [name + suffix for suffix in EXPERT_SUFFIXES]
    return out


def merged(base: dict, adapters: dict, record: dict) -> dict:
    """The base weights (all, or some: each adapted weight among them merged) with every
    adapter's update added (computed in float32, stored in the weight's dtype). A QLoRA run's
    adapters trained over the NF4 form of the weights: the update is added to that
    (dequantized), which gives the trained model's logits."""
    scale = record["lora_alpha"] / record["r"]
    transposed = set(record.get("fan_in_fan_out", ()))
    out = dict(base)
    for module in record["target_modules"]:
        if f"{module}.weight" not in base:
            continue
        a = adapters[f"{module}.{ADAPTER_CHILDREN[0]}.weight"].float()
        b = adapters[f"{module}.{ADAPTER_CHILDREN[1]}.weight"].float()
        w = trained_base(base[f"{module}.weight"], record)
        flip = module in transposed  # (a Conv1D: [in, out], merged as [out, in])
        new = (w.float().t() if flip else w.float()) + scale * (b @ a)
        if record.get("use_dora"):  # each output row set to its trained length
            magnitude = adapters[f"{module}.{MAGNITUDE}"].float()
            new = new * (magnitude / torch.linalg.vector_norm(new, dim=1))[:, None]
        out[f"{module}.weight"] = (new.t() if flip else new).contiguous().to(w.dtype)
    for name, transposed in record.get("target_parameters", {}).items():
        if name not in base:
            continue
        w = base[name]
        update = expert_update(adapters[name + EXPERT_SUFFIXES[0]].float(),
                               adapters[name + EXPERT_SUFFIXES[1]].float(), scale, transposed)
        out[name] = (w.float() + update).to(w.dtype)
    return out


def trained_base(weight, record: dict):
    """An adapted layer's weight as the run saw it: the NF4 values under QLoRA."""
    if "nf4" not in record:
        return weight
    q = record["nf4"]
    return dequantized(to_nf4(weight, q["block_size"], q["scaler_block_size"]))


def write_peft_adapter(adapters: dict, record: dict, out: str) -> str:
    """``out`` as a peft adapter directory (written whole, then moved into place)."""
    from safetensors.torch import save_file

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(_in_peft_layout(adapters, record), os.path.join(tmp, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["r"],
              "lora_alpha": record["lora_alpha"], "lora_dropout": record["lora_dropout"],
              "target_modules": record["target_modules"], "bias": "none",
              "use_dora": bool(record.get("use_dora")),
              "use_rslora": False, "fan_in_fan_out": bool(record.get("fan_in_fan_out")),
              "init_lora_weights": True,
              "modules_to_save": None, "inference_mode": True,
              "target_parameters": sorted(record.get("target_parameters", {})) or None,
              "base_model_name_or_path": record["base_model_name_or_path"]}
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _in_peft_layout(adapters: dict, record: dict) -> dict:
    """The adapters under peft's keys (``base_model.model.`` + name); expert adapters
    renamed and reshaped as peft keeps an expert weight's (``experts.peft_keys``)."""
    out = {PEFT_PREFIX + k: v.contiguous() for k, v in adapters.items()
           if not k.endswith(EXPERT_SUFFIXES)}
    keys = peft_keys(record.get("target_parameters", {}))
    for name in record.get("target_parameters", {}):
        a, b = to_peft_layout(adapters[name + EXPERT_SUFFIXES[0]],
                              adapters[name + EXPERT_SUFFIXES[1]])
        out[PEFT_PREFIX + keys[name + EXPERT_SUFFIXES[0]]] = a.contiguous()
        out[PEFT_PREFIX + keys[name + EXPERT_SUFFIXES[1]]] = b.contiguous()
    return out


def adapter_dir_of(out: str) -> str:
    """Where the adapter goes beside a merged export at ``out``."""
    return out.rstrip("/") + "_adapter"
