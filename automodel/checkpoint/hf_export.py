"""Export a checkpoint (saved under any layout) as a Hugging Face model directory.

    python -m automodel.checkpoint.hf_export <checkpoint dir> <output dir>

Reads the model weights of a torch.distributed.checkpoint directory in one process, without
a process group (DCP reassembles DDP, FSDP2 and TP shards and pipeline stages into full
tensors), builds the model from the saved ``model_config.json`` on the meta device (no
memory for a second copy), and writes ``save_pretrained`` safetensors plus the config, and the
tokenizer when the run used one (an image-text model's processor). The result loads with
``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText``) and as
``model.pretrained_path``. A ``peft=lora`` run's checkpoint is written merged
(``W + (alpha / r) B A``), and its adapter alone in peft's format in ``<output dir>_adapter``
(``automodel/peft/export.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from automodel.checkpoint.verify import CheckpointError, check_files

PREFIX = "model."


def load_full_model_state(path: str) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint at ``path`` as full tensors, keyed by name."""
    meta = check_files(path)
    state = {}
    for key, info in meta.state_dict_metadata.items():
        if key.startswith(PREFIX) and isinstance(info, TensorStorageMetadata):
            state[key[len(PREFIX):]] = torch.empty(info.size, dtype=info.properties.dtype)
    if not state:
        raise CheckpointError(f"checkpoint {path} holds no model weights")
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    return state


def model_config_of(path: str):
    from transformers import AutoConfig

    file = os.path.join(path, "model_config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path} has no model_config.json (written by "
                              "automodel with every checkpoint): cannot tell which model it is")
    with open(file) as f:
        values = json.load(f)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def export_hf(path: str, out: str, tokenizer_path: str | None = None,
              dtype: str | None = None) -> str:
    """``dtype`` (float32, bfloat16, float16): the exported weights' and the config's; None:
    as saved."""
    from transformers import AutoProcessor, AutoTokenizer

    from automodel.models.multimodal import auto_class, is_image_text, text_config

    state = load_full_model_state(path)
    config = model_config_of(path)
    trainer = _trainer_record(path)
    if trainer.get("peft"):  # (a LoRA run: merged, and the adapter in peft's format beside)
        from automodel.peft.export import (
            adapter_dir_of,
            base_state,
            merged,
            split_state,
            write_peft_adapter,
        )

        adapters = split_state(state)[1]  # (anything else saved is a frozen weight's alias)
        base = base_state(trainer["peft"], config)  # (the base is referenced)
        write_peft_adapter(adapters, trainer["peft"], adapter_dir_of(out))
        state = merged(base, adapters, trainer["peft"])
    with torch.device("meta"):
        model = auto_class(config).from_config(config)
    expected = set(model.state_dict())
    missing = expected - set(state)
    if text_config(config).tie_word_embeddings:  # one tensor under two names; either stored
        missing -= {k for k in missing if k in _tied_names(model)}
    if missing or set(state) - expected:
        raise CheckpointError(f"checkpoint {path}: weights do not match {type(model).__name__}"
                              f": missing {sorted(missing)[:8]}, unexpected "
                              f"{sorted(set(state) - expected)[:8]}")
    if dtype is not None:  # (the meta model too: save_pretrained writes its dtype)
        state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                 for k, v in state.items()}
        model.to(getattr(torch, dtype))
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if tokenizer_path is None:
        tokenizer_path = trainer.get("tokenizer_path")
    if tokenizer_path:  # (an image-text model: its processor, which holds the tokenizer)
        loader = AutoProcessor if is_image_text(config) else AutoTokenizer
        loader.from_pretrained(tokenizer_path).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _trainer_record(path: str) -> dict:
    file = os.path.join(path, "trainer.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def _tied_names(model) -> set[str]:
    names = set()
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is out or module is inp:
            names.add(f"{name}.weight")
    return names


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m automodel.checkpoint.hf_export",
                                description="Write a checkpoint as a Hugging Face model.")
    p.add_argument("checkpoint", help="a checkpoint directory (…/checkpoints/step_N)")
    p.add_argument("output", help="the Hugging Face model directory to write")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory to copy along")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the exported weights' dtype (default: as saved)")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.output, args.tokenizer, args.dtype)
    except CheckpointError as err:
        print(f"automodel: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
