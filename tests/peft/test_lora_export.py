"""The export of a LoRA run (``checkpoint.export_hf=true``): the merged model loads in
transformers, the adapter in peft (``PeftModel.from_pretrained`` over the base model), and
both give the trained model's logits; a pipeline x tensor-parallel job's export holds every
stage and shard, equal to one process's."""

import json
import os

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.paths import checkpoint_path
from automodel.models.builder import build_model
from tests.helpers import FP32, train
from tests.peft.exported import EXPORT, exported_run, logits, merged_model, trained_model

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny pretrained model on disk (the base the adapters are trained on)."""
    path = tmp_path_factory.mktemp("base")
    cfg = load_config([])
    build_model(cfg.model, seed=0).save_pretrained(str(path))
    return str(path)


def test_the_merged_model_and_the_peft_adapter_give_the_trained_logits(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = ["model=pretrained", f"model.pretrained_path={base_dir}"] + LORA
    cfg, step = exported_run(run, tmp_path)
    _the_export_refuses_another_base(step, base_dir, tmp_path)
    trained = logits(trained_model(cfg, step))
    base = logits(AutoModelForCausalLM.from_pretrained(base_dir).eval())
    assert not torch.allclose(trained, base, atol=1e-3)  # (the adapters moved it)
    torch.testing.assert_close(logits(merged_model(step)), trained, rtol=1e-4, atol=1e-5)

    adapter = os.path.join(step, "hf_adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == base_dir
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                          adapter).eval()
    torch.testing.assert_close(logits(with_peft), trained, rtol=1e-4, atol=1e-5)


def test_a_pipeline_times_tensor_parallel_export_holds_every_stage_and_shard(base_dir,
                                                                             tmp_path):
    from safetensors.torch import load_file

    run = ["model=pretrained", f"model.pretrained_path={base_dir}"] + LORA + EXPORT
    train(["parallelism=none"] + run, tmp_path / "one")
    train(["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
           "mesh.tp_size=2", "parallelism.sequence_parallel=true"] + run, tmp_path / "pptp")
    one, pptp = (checkpoint_path(str(tmp_path / d / "checkpoints"), 3) for d in ("one", "pptp"))
    for name in ("hf/model.safetensors", "hf_adapter/adapter_model.safetensors"):
        a, b = load_file(os.path.join(one, name)), load_file(os.path.join(pptp, name))
        assert set(a) == set(b)  # every layer of both stages, every adapter
        for key in a:  # whole tensors (both TP shards), equal to one process's
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
    adapters = load_file(os.path.join(pptp, "hf_adapter/adapter_model.safetensors"))
    assert len(adapters) == 2 * 7 * 4 and all(k.startswith("base_model.model.model.layers.")
                                              for k in adapters)


def _the_export_refuses_another_base(step: str, base_dir: str, tmp_path) -> None:
    """The export reads the base the checkpoint references, checked by its fingerprint: a
    base of other weights (another seed's, in the same shapes and files) is refused naming
    both; a base that moved is found with --base."""
    import shutil
    import subprocess
    import sys

    other = tmp_path / "other_base"
    build_model(load_config([]).model, seed=1).save_pretrained(str(other))

    def export(*extra):
        return subprocess.run([sys.executable, "-m", "automodel.checkpoint.hf_export", step,
                               str(tmp_path / "out"), *extra], capture_output=True, text=True)

    done = export("--base", str(other))
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert f"trained over the base {base_dir} (fingerprint" in done.stderr, done.stderr
    assert f"but {other} has fingerprint" in done.stderr
    moved = tmp_path / "moved_base"
    shutil.copytree(base_dir, moved)
    assert export("--base", str(moved)).returncode == 0
    with open(os.path.join(step, "hf", "config.json")) as f:  # (the job's own export: the same)
        assert json.load(f) == json.loads((tmp_path / "out" / "config.json").read_text())
