"""Export to Hugging Face format from any layout: safetensors that from_pretrained and
model.pretrained_path load, holding exactly the trained weights.

Proof of "exactly": a run's step-4 loss and gradient norm are computed with the step-3
weights on global batch 3. The model exported at step 3, loaded by plain ``from_pretrained``
and evaluated on that batch in plain PyTorch, must give the same loss and gradient norm.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from automodel.api import load_config
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path
from automodel.data.batches import BatchPlan
from automodel.data.sources import token_sequences
from tests.helpers import BASE, FP32, train

RUN = ["trainer.max_steps=4", "checkpoint.every_steps=3", "checkpoint.export_hf=true"]
PP = ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2"]


def _loss_and_grad_norm_of(model_dir, step, overrides, tmp_path):
    cfg = load_config(BASE + overrides, str(tmp_path))
    t = cfg.trainer
    plan = BatchPlan(token_sequences(cfg.data_source, cfg.data, t.seq_len, 256),
                     t.global_batch_size, t.seed)
    batch = plan.global_batch(step)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads
    return loss.item(), torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


@pytest.mark.parametrize("name,layout", [
    ("fsdp2_dp2", ["parallelism=fsdp2", FP32]),
    ("tp2", ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]),
    ("pp2", PP + ["pipeline=1f1b"]),
    ("ddp", ["parallelism=ddp"]),
    # context parallelism swaps the attention function of the live model; the export is the
    # plain model (loaded below with transformers' own attention)
    ("cp2_ulysses", ["parallelism=fsdp2", FP32, "mesh.cp_size=2", "mesh.cp_ulysses_size=2"]),
    # experts split over 2 ranks are saved and exported as the model's fused 3-D weights
    # (the router loss off: the plain evaluation below is the cross-entropy alone)
    ("moe_ep2", ["parallelism=fsdp2", FP32, "model=qwen3_moe_tiny", "mesh.ep_size=2",
                 "model.config.output_router_logits=false"]),
])
def test_export_holds_the_trained_weights(name, layout, tmp_path):
    records = train(layout + RUN, tmp_path)
    root = str(tmp_path / "checkpoints")
    hf = os.path.join(checkpoint_path(root, 3), "hf")
    assert os.path.isfile(os.path.join(hf, "model.safetensors"))
    assert os.path.isfile(os.path.join(hf, "config.json"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    loss, grad_norm = _loss_and_grad_norm_of(hf, 3, layout + RUN, tmp_path / "cfg")
    np.testing.assert_allclose(loss, records[3]["loss"], rtol=1e-5)
    np.testing.assert_allclose(grad_norm, records[3]["grad_norm"], rtol=1e-4)
    # the final step is saved (and exported) too
    assert os.path.isfile(os.path.join(checkpoint_path(root, 4), "hf", "model.safetensors"))


def test_export_command_and_pretrained_path(tmp_path):
    layout = ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]
    train(layout + ["trainer.max_steps=3", "checkpoint.every_steps=3"], tmp_path / "run")
    ckpt = checkpoint_path(str(tmp_path / "run" / "checkpoints"), 3)
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "automodel.checkpoint.hf_export", ckpt,
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    saved = load_full_model_state(ckpt)
    assert set(exported) == set(saved)
    for key in saved:
        assert torch.equal(exported[key], saved[key]), key
    # in files of at most 100 KB (whole decoder layers each) and bfloat16: save_pretrained's
    # layout, with an index; the same weights, rounded
    sharded = tmp_path / "sharded"
    done = subprocess.run([sys.executable, "-m", "automodel.checkpoint.hf_export", ckpt,
                           str(sharded), "--max-shard-size", "100KB", "--dtype", "bfloat16"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    # the embedding (32 KB), each layer (92 KB: two do not fit), the norm with the head
    assert len(files) == 6 and files[0] == "model-00001-of-00006.safetensors"
    with open(sharded / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(saved) and set(index["weight_map"].values()) == \
        set(files)
    layers = {}  # (no decoder layer split over two files)
    for key, file in index["weight_map"].items():
        if ".layers." in key:
            layers.setdefault(re.match(r"(.*\.layers\.\d+)\.", key).group(1), set()).add(file)
    assert len(layers) == 4 and all(len(f) == 1 for f in layers.values())
    # (each file at most 100 KB of tensors, but a single tensor larger than that: 64 KB here)
    assert all((sharded / f).stat().st_size < 100_000 + 4096 for f in files)
    rounded = AutoModelForCausalLM.from_pretrained(sharded)
    assert rounded.dtype == torch.bfloat16
    for key, value in rounded.state_dict().items():
        assert torch.equal(value, saved[key].to(torch.bfloat16)), key
    # continue training from the export as a pretrained model, single process
    records = train(["parallelism=none", "model=pretrained", f"model.pretrained_path={out}",
                     "trainer.max_steps=2"], tmp_path / "again")
    assert [r["step"] for r in records] == [1, 2]
    loss, grad_norm = _loss_and_grad_norm_of(str(out), 0, ["trainer.max_steps=2"], tmp_path / "c")
    np.testing.assert_allclose(records[0]["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(records[0]["grad_norm"], grad_norm, rtol=1e-4)


@pytest.mark.fast
def test_export_of_a_damaged_checkpoint_fails_clearly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "automodel.checkpoint.hf_export",
                           str(tmp_path / "none"), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert f"checkpoint {tmp_path / 'none'}: no such directory" in done.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.fast
def test_one_rank_of_each_host_writes_the_export():
    from automodel.checkpoint.export_job import writer_slot

    hosts = ["a", "a", "b", "b", "c", "a"]  # (rank order; SLURM places ranks by node)
    assert [writer_slot(hosts, r) for r in range(6)] == [(0, 3), None, (1, 3), None, (2, 3),
                                                           None]
    assert writer_slot(["a"], 0) == (0, 1)


@pytest.mark.fast
def test_the_export_keeps_the_source_dtype_by_default(tmp_path):
    """A checkpoint records where its model came from; the export's dtype defaults to the
    dtype the pretrained weights were stored in (bfloat16 for a bfloat16 checkpoint trained
    with float32 master weights), else ``model.dtype``."""
    from automodel.api import load_config
    from automodel.config.schema import ModelConfig
    from automodel.models.builder import build_model
    from automodel.models.weight_files import model_source

    model = build_model(load_config([]).model, seed=0)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert model_source(ModelConfig(pretrained_path=str(tmp_path / "bf16"))) == \
        {"path": str(tmp_path / "bf16"), "dtype": "bfloat16"}
    assert model_source(ModelConfig(dtype="float16"))["dtype"] == "float16"  # (from config)
    from automodel.checkpoint.hf_export import ExportJob, trainer_record

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "ckpt" / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    record = {"model_source": model_source(ModelConfig(pretrained_path=str(tmp_path / "bf16")))}
    (tmp_path / "ckpt" / "trainer.json").write_text(json.dumps(record))
    assert trainer_record(str(tmp_path / "ckpt")) == record
    assert ExportJob(str(tmp_path / "ckpt")).dtype == torch.bfloat16
    assert ExportJob(str(tmp_path / "ckpt"), "float32").dtype == torch.float32
