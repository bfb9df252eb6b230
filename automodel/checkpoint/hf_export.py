"""Export a checkpoint (saved under any layout) as a Hugging Face model directory, streamed.

    python -m automodel.checkpoint.hf_export <checkpoint dir> <output dir> [--dtype bfloat16]

The model is built from the saved ``model_config.json`` on the meta device (no memory), the
export's files are planned from it (``export_layout.py``: safetensors files of at most
``--max-shard-size``, with an index, as ``save_pretrained`` lays them out), and each file is
written from the checkpoint's tensors read a decoder layer at a time
(``export_read.py``), so a writer holds one file and one layer, never the model. In a job
(``checkpoint.export_hf``) the first rank of each host writes its share of the files. The
dtype defaults to the model's source (a pretrained model's stored dtype, else
``model.dtype``); the config, ``generation_config.json`` and the tokenizer (an image-text
model's processor) and its chat template go along. The result loads with
``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText``) and as
``model.pretrained_path``.

A ``peft`` run's checkpoint holds adapters only: every weight is read from the base it
references (checked by fingerprint), merged (``W + (alpha / r) B A``) where adapted, and the
adapter alone is written in peft's format in ``<output dir>_adapter``
(``automodel/peft/export.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from automodel.checkpoint.export_layout import INDEX_FILE, plan_export, read_groups
from automodel.checkpoint.export_read import PREFIX, BaseTensors, CheckpointTensors, aliases
from automodel.checkpoint.verify import CheckpointError
from automodel.config.value_checks import shard_bytes

DEFAULT_SHARD = "5GB"
__all__ = ["ExportJob", "export_hf", "load_full_model_state", "model_config_of", "PREFIX"]


def load_full_model_state(path: str) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint at ``path`` as full tensors, keyed by name (all at
    once: for tests and small models)."""
    tensors = CheckpointTensors(path)
    return tensors.read(list(tensors.saved))


def model_config_of(path: str, values: dict | None = None):
    from transformers import AutoConfig

    if values is None:
        file = os.path.join(path, "model_config.json")
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path} has no model_config.json (written by "
                                  "automodel with every checkpoint): cannot tell which model "
                                  "it is")
        with open(file) as f:
            values = json.load(f)
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def trainer_record(path: str) -> dict:
    file = os.path.join(path, "trainer.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


class ExportJob:
    """One export of the checkpoint at ``path``, as each writer sees it: the model on the meta
    device, the layout of the files, where the tensors come from. ``config`` / ``trainer``:
    the checkpoint's ``model_config.json`` / ``trainer.json`` values (read from ``path``
    when None); ``dtype``: the export's (None: the model's source dtype); ``base_dir``: where
    a peft checkpoint's base is now (None: where it was)."""

    def __init__(self, path: str, dtype: str | None = None, max_shard_size=DEFAULT_SHARD,
                 base_dir: str | None = None, config: dict | None = None,
                 trainer: dict | None = None):
        from automodel.models.multimodal import auto_class

        self.path, self.base_dir = path, base_dir
        self.tensors = CheckpointTensors(path)  # (whole and readable, first)
        self.config = model_config_of(path, config)
        self.trainer = trainer_record(path) if trainer is None else trainer
        self.record = self.trainer.get("peft")
        with torch.device("meta"):
            self.model = auto_class(self.config).from_config(self.config)
        self.aliases = aliases(self.model)
        name = dtype or self.trainer.get("model_source", {}).get("dtype")
        self.dtype = getattr(torch, name) if name else self.tensors.dtype()
        self.layout = plan_export(self.model, self.dtype, shard_bytes(max_shard_size))
        self._check_saved()

    def _check_saved(self) -> None:
        """Every tensor the export writes is in the checkpoint (a peft checkpoint: every
        adapter the merge reads; the base is checked as it is read)."""
        from automodel.peft.export import adapters_of

        if self.record is not None:
            missing = [n for n in adapters_of(self.layout.names, self.record)
                       if n not in self.tensors.saved]
            unexpected = []
        else:
            missing = [n for n in self.layout.names if self._saved_name(n) is None]
            unexpected = sorted(set(self.tensors.saved) - set(self.aliases))
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {self.path}: weights do not match "
                                  f"{type(self.model).__name__}: missing {sorted(missing)[:8]}, "
                                  f"unexpected {unexpected[:8]}")

    def _saved_name(self, name: str) -> str | None:
        """``name`` as the checkpoint holds it (a tied weight under either of its names)."""
        return next((n for n in self.aliases.get(name, [name]) if n in self.tensors.saved),
                    None)

    def write(self, staging: str, files: list[int]) -> None:
        """Write the files ``files`` (indices of ``layout.files``) into ``staging``."""
        base = (BaseTensors(self.record, self.config, self.model, self.base_dir)
                if self.record is not None and files else None)
        for index in files:
            self._write_file(staging, index, base)

    def _write_file(self, staging: str, index: int, base) -> None:
        """One file, a read group (a decoder layer) at a time: its header first, from the
        shapes alone; each group read, merged, cast, put under the hub's names
        (``saved_layout``) and written; nothing of the file held in memory."""
        from automodel.checkpoint.safetensors_stream import StreamedFile
        from automodel.compat import saved_layout

        groups = read_groups(self.layout.files[index])
        state = self.model.state_dict(keep_vars=True)
        saved = [saved_layout(self.model, {n: torch.empty(
            state[n].shape, dtype=self._dtype_of(state[n]), device="meta") for n in group})
            for group in groups]
        entries = [(n, t.dtype, tuple(t.shape)) for names in saved for n, t in names.items()]
        with StreamedFile(os.path.join(staging, self.layout.file_name(index)), entries) as out:
            for group, names in zip(groups, saved):
                tensors = saved_layout(self.model, {
                    n: t.to(self._dtype_of(t)) for n, t in self._read(group, base).items()})
                if set(tensors) != set(names):
                    raise CheckpointError(f"the export of {group[0]}...: the hub's names of "
                                          f"the tensors read differ from the planned ones")
                for name in names:
                    out.write(name, tensors[name])

    def _dtype_of(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if t.is_floating_point() else t.dtype

    def _read(self, group: list[str], base) -> dict[str, torch.Tensor]:
        if self.record is None:
            saved = {n: self._saved_name(n) for n in group}
            read = self.tensors.read(list(saved.values()))
            return {n: read[s] for n, s in saved.items()}
        from automodel.peft.export import adapters_of, merged

        adapters = self.tensors.read(adapters_of(group, self.record))
        return merged(base.read(group), adapters, self.record)

    def finish(self, staging: str, out: str, tokenizer_path: str | None = None) -> str:
        """Once every file is written: the index, the config, the generation config, the
        tokenizer, peft's adapter; then ``staging`` becomes ``out``."""
        from automodel.peft.export import adapter_dir_of, write_peft_adapter

        _write_index(staging, [self.layout.file_name(i) for i in range(len(self.layout.files))])
        self.config.dtype = str(self.dtype).removeprefix("torch.")
        self.config.architectures = [type(self.model).__name__]
        self.config.save_pretrained(staging)
        source = self._source_dir()
        _write_generation_config(staging, self.config, source)
        _write_tokenizer(staging, self.config, tokenizer_path or self.trainer.get(
            "tokenizer_path") or _tokenizer_in(source))
        if self.record is not None:
            from automodel.peft.lora import is_adapter

            adapters = self.tensors.read([n for n in self.tensors.saved if is_adapter(n)])
            write_peft_adapter(adapters, self.record, adapter_dir_of(out))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
        return out

    def _source_dir(self) -> str | None:
        """The pretrained directory the model came from (the base of adapters), if any."""
        if self.record is not None:
            return self.base_dir or self.record["base"].get("pretrained_path")
        return self.trainer.get("model_source", {}).get("path")


def _write_index(staging: str, files: list[str]) -> None:
    """``model.safetensors.index.json`` over several files (one file needs none)."""
    if len(files) < 2:
        return
    weight_map, total = {}, 0
    for name in files:
        for key, (start, end) in _header(os.path.join(staging, name)).items():
            weight_map[key] = name
            total += end - start
    with open(os.path.join(staging, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _header(path: str) -> dict[str, tuple[int, int]]:
    """A safetensors file's tensors and their byte ranges, from its header alone."""
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def _write_generation_config(staging: str, config, source: str | None) -> None:
    """The source's ``generation_config.json`` (its sampling defaults, stop tokens), else the
    one transformers derives from the config."""
    from transformers import GenerationConfig

    name = "generation_config.json"
    if source and os.path.isfile(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(staging, name))
        return
    from automodel.models.multimodal import text_config

    GenerationConfig.from_model_config(text_config(config)).save_pretrained(staging)


def _tokenizer_in(source: str | None) -> str | None:
    if source and os.path.isfile(os.path.join(source, "tokenizer_config.json")):
        return source
    return None


def _write_tokenizer(staging: str, config, tokenizer_path: str | None) -> None:
    """The tokenizer (with its chat template), or an image-text model's processor."""
    if not tokenizer_path:
        return
    from transformers import AutoProcessor, AutoTokenizer

    from automodel.models.multimodal import is_image_text

    loader = AutoProcessor if is_image_text(config) else AutoTokenizer
    loader.from_pretrained(tokenizer_path).save_pretrained(staging)


def staging_dir(out: str) -> str:
    """Where an export to ``out`` is written before it is moved into place (emptied)."""
    staging = out.rstrip("/") + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def export_hf(path: str, out: str, tokenizer_path: str | None = None,
              dtype: str | None = None, max_shard_size=DEFAULT_SHARD,
              base_dir: str | None = None) -> str:
    """Export the checkpoint at ``path`` to ``out`` in this process, one file after another.
    ``dtype`` (float32, bfloat16, float16): the weights' and the config's; None: the model's
    source dtype."""
    job = ExportJob(path, dtype, max_shard_size, base_dir)
    staging = staging_dir(out)
    job.write(staging, job.layout.mine(0, 1))
    return job.finish(staging, out, tokenizer_path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m automodel.checkpoint.hf_export",
                                description="Write a checkpoint as a Hugging Face model.")
    p.add_argument("checkpoint", help="a checkpoint directory (…/checkpoints/step_N)")
    p.add_argument("output", help="the Hugging Face model directory to write (a peft "
                                  "checkpoint's adapter goes to <output>_adapter)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory to copy along "
                   "(default: the run's, else the source model's)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the exported weights' dtype (default: the model's source dtype)")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD,
                   help=f"the largest safetensors file (default {DEFAULT_SHARD})")
    p.add_argument("--base", default=None, help="where the adapters' base model is now, if it "
                   "moved (checked against the fingerprint the checkpoint records)")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.output, args.tokenizer, args.dtype,
                        args.max_shard_size, args.base)
    except (CheckpointError, ValueError) as err:
        print(f"automodel: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
