"""Peak host memory of the Hugging Face export against the model's size.

Builds a Llama-style model of about 0.75B parameters (3.0 GB in float32), saves it as a
training checkpoint would (torch.distributed.checkpoint, float32, with ``trainer.json`` and
``model_config.json``), and as a LoRA run's checkpoint over a bfloat16 pretrained base (the
base as safetensors, the checkpoint holding rank-16 adapters only). Then, each in a fresh
process, it exports:

- ``streamed``: ``python -m automodel.checkpoint.hf_export`` (one file and one layer at a time),
  in bfloat16 with 250 MB files, of the full checkpoint and of the LoRA checkpoint (merged);
- ``whole``: what an export that holds the model does (every tensor read, then
  ``save_pretrained``), of the full checkpoint, for comparison;
- ``imports``: the same interpreter importing what the export imports, and nothing else.

Each process reports its peak resident memory (``VmHWM``). Run:

    python benchmarks/export_memory.py [--layers 12] [--workdir /tmp/export_memory]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the peak of the process's own memory: VmHWM (ru_maxrss would carry over the peak of the
# process this one was forked from, across the exec)
PEAK = ("import sys, runpy\nsys.argv = {argv!r}\ntry:\n    {body}\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('PEAK', int(hwm.split()[1]) * 1024)")


def _config(layers: int) -> dict:
    return {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "tie_word_embeddings": False}


def make_checkpoints(work: str, layers: int) -> dict:
    """The full checkpoint, the base and the LoRA checkpoint (made once per work folder)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.config import schema as s
    from automodel.config.enums import PeftMethod
    from automodel.peft import add_adapters, init_adapters
    from automodel.peft.export import adapter_record
    from automodel.peft.lora import lora_modules

    paths = {k: os.path.join(work, k) for k in ("full", "base", "lora")}
    if all(os.path.isdir(p) for p in paths.values()):
        return paths
    config = _config(layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    params = sum(p.numel() for p in model.parameters())
    trainer = {"step": 1, "scheduler": {}, "world_size": 1,
               "model_source": {"path": None, "dtype": "float32"}}
    _save(paths["full"], {k: v for k, v in model.state_dict().items()}, config, trainer)
    model.to(torch.bfloat16).save_pretrained(paths["base"])
    peft = s.PeftConfig(method=PeftMethod.lora, rank=16, alpha=32.0)
    targets = add_adapters(model, peft)
    init_adapters([model], peft, seed=0)
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    record = adapter_record(peft, targets, s.ModelConfig(pretrained_path=paths["base"]), 0)
    _save(paths["lora"], adapters, config, {**trainer, "peft": record,
                                             "model_source": {"path": paths["base"],
                                                              "dtype": "bfloat16"}})
    with open(os.path.join(work, "sizes.json"), "w") as f:
        json.dump({"parameters": params, "adapters": sum(v.numel() for v in adapters.values()),
                   "layers": layers, "adapted_layers": len(lora_modules(model))}, f)
    del model
    return paths


def _save(path: str, state: dict, config: dict, trainer: dict) -> None:
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    dcp.save({"model": state}, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "model_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "trainer.json"), "w") as f:
        json.dump(trainer, f)


def _peak(body: str, argv: list[str]) -> tuple[int, float]:
    """(peak resident bytes, seconds) of a fresh interpreter running ``body``."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", PEAK.format(argv=argv, body=body)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith("PEAK"))
    return int(line.split()[1]), time.monotonic() - start


EXPORT = "runpy.run_module('automodel.checkpoint.hf_export', run_name='__main__')"
IMPORTS = ("import torch, transformers, safetensors, torch.distributed.checkpoint; "
           "import automodel.checkpoint.hf_export, automodel.peft.export; "
           "from transformers import AutoModelForCausalLM")
WHOLE = ("import torch; from transformers import AutoModelForCausalLM; "
         "from automodel.checkpoint.hf_export import load_full_model_state, model_config_of; "
         "s = {k: v.to(torch.bfloat16) for k, v in load_full_model_state(sys.argv[1]).items()}; "
         "c = model_config_of(sys.argv[1]); m = AutoModelForCausalLM.from_config(c); "
         "m.save_pretrained(sys.argv[2], state_dict=s, max_shard_size='250MB')")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--workdir", default="/tmp/export_memory")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    paths = make_checkpoints(args.workdir, args.layers)
    with open(os.path.join(args.workdir, "sizes.json")) as f:
        sizes = json.load(f)
    out = os.path.join(args.workdir, "out")
    rows = []
    for name, body, argv in [
        ("imports", IMPORTS, ["x"]),
        ("streamed, full checkpoint", EXPORT, ["x", paths["full"], out, "--dtype", "bfloat16",
                                               "--max-shard-size", "250MB"]),
        ("streamed, LoRA checkpoint (merged)", EXPORT,
         ["x", paths["lora"], out + "_lora", "--max-shard-size", "250MB"]),
        ("whole, full checkpoint", WHOLE, ["x", paths["full"], out + "_whole"]),
    ]:
        peak, seconds = _peak(body, argv)
        rows.append((name, peak, seconds))
    fp32 = sizes["parameters"] * 4
    print(f"model: {sizes['parameters'] / 1e9:.2f}B parameters, {fp32 / 1e9:.2f} GB in "
          f"float32, {fp32 / 2e9:.2f} GB in bfloat16; LoRA rank 16: "
          f"{sizes['adapters'] / 1e6:.1f}M adapter parameters")
    print("| export | peak RSS | over the imports | seconds |")
    print("|---|---|---|---|")
    base = rows[0][1]
    for name, peak, seconds in rows:
        print(f"| {name} | {peak / 1e9:.2f} GB | {(peak - base) / 1e9:.2f} GB | {seconds:.1f} |")
    for folder in (out, out + "_lora", out + "_lora_adapter", out + "_whole"):
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
