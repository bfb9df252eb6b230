"""The batch scripts of docs/recipes.md (``examples/slurm/*.sbatch``) run, in miniature, on the
local SLURM cluster, and a plain ``srun`` job trains as the local run does.

Each script is submitted with ``sbatch`` as it is written: its ``#SBATCH`` lines, its checks of
the variables it reads, ``source .venv/bin/activate`` and ``srun python train.py`` with the
same overrides, from the directory a user submits from (a checkout: here a folder of links to
this repository's files). ``miniature`` changes only sizes, each named in ``SIZES`` and
``SBATCH_SIZES``: 2 nodes x 2 tasks on partition ``two`` (node1 and node2, each in its own
network namespace: the ranks of the two nodes meet over a virtual network), no GPUs, tiny
models saved with weights and a chat tokenizer (LLaVA-NeXT: its processor, and image files
beside the samples) in place of the real checkpoints, tp 8 and ep 8
as 2, a few steps; the ranks pinned to the CPU under gloo as every test job is
(``tests.helpers.ON_CPU``). Each layout keeps its shape: HSDP replicates across the two nodes
and shards within, the pipeline's stages are the two nodes with TP inside each, the experts
are regrouped as ep_shard 2 x ep 2.

Without the cluster these tests skip, except under CI, where they fail (tests/launch/
test_slurm.py's ``require_cluster``)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from automodel.tracking.metrics import read_metrics
from tests.cli.test_cli import ROOT, TRAIN
from tests.data.processors import save_llava_next, write_samples
from tests.distributed.test_golden import assert_golden
from tests.helpers import ON_CPU, chat_records, save_chat_tokenizer
from tests.launch.test_slurm import require_cluster
from tests.launch.test_slurm_nodes import two_nodes_up

SCRIPTS = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
# train.py overrides whose values are sizes: their miniature values (keys a script does not
# name are not added)
SIZES = {"mesh.tp_size": "2", "mesh.ep_size": "2", "mesh.pp_size": "2", "trainer.seq_len": "32",
         "trainer.global_batch_size": "8", "trainer.local_batch_size": "1",
         "pipeline.pp_microbatch_size": "2", "trainer.max_steps": "3", "trainer.log_every": "1",
         "trainer.eval_every": "2", "trainer.eval_batches": "1", "checkpoint.every_steps": "1",
         "optim.warmup_steps": "1", "data.eval_fraction": "0.2",
         # NF4 scale groups of 64 x 4 values: the tiny model's weights split in whole groups
         # over 4 FSDP2 ranks (a 70B weight holds thousands of 64 x 256)
         "peft.nf4_scaler_block_size": "4"}
# #SBATCH options whose values are sizes (None: dropped; the local nodes have no GPUs)
SBATCH_SIZES = {"nodes": "2", "ntasks-per-node": "2", "gpus-per-node": None, "cpus-per-task": "1",
                "mem": None}
# What each script's start-up line must say of its layout, in miniature
LAYOUTS = {
    "llama3_1_8b_instruct_hsdp":
        r"hsdp on 4 rank\(s\) \(dp=4, cp=1, tp=1, pp=1; dp_replicate=2 x dp_shard=2\).*"
        r"2 micro-batch\(es\) per rank",
    "llama3_1_8b_instruct_tp8_pp2": r"fsdp2 on 4 rank\(s\) \(dp=1, cp=1, tp=2, pp=2\)",
    "qwen3_30b_a3b_ep8": r"fsdp2 on 4 rank\(s\) \(dp=4, cp=1, tp=1, pp=1; ep=2\)",
    "llama3_1_70b_instruct": r"fsdp2 on 4 rank\(s\) \(dp=1, cp=1, tp=2, pp=2\).*"
                             r"4 pipeline stages",
    "llama3_1_70b_instruct_lora": r"fsdp2 on 4 rank\(s\) \(dp=4, cp=1, tp=1, pp=1\)",
    "llama3_1_70b_instruct_qlora": r"fsdp2 on 4 rank\(s\) \(dp=4, cp=1, tp=1, pp=1\)",
    "llava_next_72b_tp8_pp2": r"fsdp2 on 4 rank\(s\) \(dp=1, cp=1, tp=2, pp=2\).*"
                              r"FSDPLlavaNextForConditionalGeneration"}
MODELS = {"LLAMA_8B_INSTRUCT": "llama", "LLAMA_70B_INSTRUCT": "llama",
          "QWEN3_30B_A3B": "qwen3_moe", "LLAVA_NEXT_72B": "llava_next"}


@pytest.fixture(scope="module", autouse=True)
def _cluster():
    require_cluster()


def miniature(script: str) -> str:
    """The script with the sizes of ``SIZES`` / ``SBATCH_SIZES``, partition ``two`` and the CPU
    pin; every other line as written."""
    lines, out = script.splitlines(), []
    for line in lines:
        m = re.match(r"#SBATCH\s+--([\w-]+)=(\S+)$", line)
        if m and m.group(1) in SBATCH_SIZES:
            if SBATCH_SIZES[m.group(1)] is not None:
                out.append(f"#SBATCH --{m.group(1)}={SBATCH_SIZES[m.group(1)]}")
            continue
        if line.startswith("#SBATCH --job-name"):
            out += [line, "#SBATCH --partition=two"]
            continue
        words = [_smaller(w) for w in line.split(" ")]
        out.append(" ".join(words))
    text = "\n".join(out) + "\n"
    # one srun line per script, which ends every task when one dies (docs/failures.md)
    line = "srun --kill-on-bad-exit=1 python train.py "
    assert text.count(line) == 1, "one srun line per script"
    return text.replace(line, f"{line}{' '.join(ON_CPU)} ")


def _smaller(word: str) -> str:
    key, sep, _ = word.partition("=")
    return f"{key}={SIZES[key]}" if sep and key in SIZES else word


def _save_tiny_models(root: Path) -> dict:
    """A tiny Llama and a tiny Qwen3-MoE with weights, and the chat tokenizer of the doc
    tests (its vocabulary fits the models'), and a tiny LLaVA-NeXT with its processor
    (``tests/data/processors.py``), in the folders the scripts' variables name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.api import load_config

    tok = save_chat_tokenizer(root / "tokenizer", chat_records())
    assert len(tok) <= 128
    folders = {}
    for family, preset in (("llama", "llama_tiny"), ("qwen3_moe", "qwen3_moe_tiny")):
        config = {**load_config([f"model={preset}"]).model.config, "vocab_size": 128}
        config.pop("output_router_logits", None)  # (the Qwen3 recipe turns it on itself)
        hf = AutoConfig.for_model(**config)
        hf.bos_token_id = hf.eos_token_id = tok.eos_token_id
        AutoModelForCausalLM.from_config(hf).save_pretrained(root / family)
        tok.save_pretrained(root / family)
        folders[family] = root / family
    save_llava_next(root / "llava_next")
    folders["llava_next"] = root / "llava_next"
    return folders


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The variables the scripts read, as a user sets them, and the checkout to submit from."""
    root = tmp_path_factory.mktemp("recipes")
    models = _save_tiny_models(root / "models")
    (root / "data").mkdir()
    (root / "data" / "chat.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in chat_records() * 8))
    # image-text samples (LLaVA-NeXT's placeholder), every other one with an image file
    write_samples(root / "data", "<image>", [f"sample {i}: " + "words " * (i % 4 + 1)
                                              for i in range(40)], file="images.jsonl")
    env = {name: str(models[family]) for name, family in MODELS.items()}
    return {**env, "DATA": str(root / "data")}


def checkout(where: Path) -> Path:
    """A folder to submit from that holds what the repository root does (links)."""
    where.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", "outputs", "multirun", "wandb", ".pytest_cache"}:
            (where / entry.name).symlink_to(entry)
    return where


def _finished(job_id: str) -> str:
    """The job's final state, polled every half second (``sbatch --wait`` backs off to tens
    of seconds between its checks)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                             capture_output=True, text=True).stdout.split()
        if out and out[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return out[0]
        time.sleep(0.5)  # (poll: until SLURM ends the job)
    subprocess.run(["scancel", job_id])
    return "TIMEOUT (the test's 10 minutes)"


@pytest.fixture(scope="module")
def recipe_jobs(inputs, tmp_path_factory):
    """Every script submitted at once (SLURM runs them one after another: each takes the
    nodes' memory), then waited for: {script name: (job id, final state, submit dir, EXP,
    WANDB_DIR)}."""
    if not two_nodes_up():
        pytest.fail("partition 'two' (node1, node2) is not up; see scripts/slurm_cluster.sh")
    jobs = {}
    for script in SCRIPTS:
        where = tmp_path_factory.mktemp(script.stem)
        submit_dir = checkout(where / "checkout")
        (submit_dir / script.name).write_text(miniature(script.read_text()))
        env = {**os.environ, **inputs, "EXP": str(where / "exp"), "WANDB_MODE": "offline",
               "WANDB_DIR": str(where / "wandb")}
        out = subprocess.run(["sbatch", "--parsable", script.name], cwd=submit_dir, env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        jobs[script.name] = (out.stdout.strip().split(";")[0], submit_dir, where)
    return {name: (job, _finished(job), submit_dir, where / "exp", where / "wandb")
            for name, (job, submit_dir, where) in jobs.items()}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_recipe_runs_in_miniature_on_two_nodes(script, recipe_jobs):
    """The script as a user submits it (sizes aside): the job completes on node1 and node2,
    trains in its layout with evaluations (and the router's loss where it asks for it), keeps
    the last 2 checkpoints with their Hugging Face exports, and writes its W&B run
    (offline)."""
    job_id, state, submit_dir, exp, wandb_dir = recipe_jobs[script.name]
    log = (submit_dir / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", f"{state}:\n{log[-6000:]}"
    [run] = [p.parent for p in (submit_dir / "outputs").rglob("metrics.jsonl")]
    train_log = (run / "train.log").read_text()
    assert "ranks 0-1 on node1, ranks 2-3 on node2" in train_log, train_log[-3000:]
    assert re.search(LAYOUTS[script.stem], train_log), train_log[:3000]
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if r.get("loss") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    text = script.read_text()
    if "output_router_logits=true" in text:  # the router's loss is on
        assert all(r["aux_loss"] > 0 for r in steps)
    if "trainer.eval_every" in text:
        assert [r["step"] for r in records if r.get("eval_loss") is not None] == [2, 3]
    ckpts = exp / re.search(r"checkpoint\.dir=\$EXP/(\S+)", text).group(1)
    saved = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000002", "step_00000003"]  # keep_last=2 of 1, 2 and 3
    hf = ckpts / "step_00000003" / "hf"
    assert (hf / "config.json").exists() and list(hf.glob("*.safetensors")), hf
    assert not (ckpts / "step_00000002" / "hf").exists()  # (checkpoint.export_hf=final)
    if "data=files" in text:  # an image-text model: its processor beside the weights
        assert (hf / "processor_config.json").exists(), sorted(p.name for p in hf.iterdir())
    else:  # the chat data's tokenizer, its chat template, the model's generation settings
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(hf).chat_template, sorted(hf.iterdir())
    assert (hf / "generation_config.json").exists()
    if "export_dtype=bfloat16" in text:
        assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    method = re.search(r"peft=(q?lora)", text)
    if method:  # the adapters: in the log, and exported for peft beside the merge
        assert f"peft={method.group(1)}: adapters of rank 16" in train_log
        assert (ckpts / "step_00000003" / "hf_adapter" / "adapter_model.safetensors").exists()
    assert list(wandb_dir.rglob("offline-run-*")), "no offline W&B run"


def test_plain_srun_trains_as_the_local_run(tmp_path):
    """`srun --ntasks=2 python train.py ...` inside no submitit job: the two tasks are the
    job's ranks (SLURM's own variables), meet at the first node, and the run reproduces the
    stored numbers of the same job on 2 local ranks (tests/golden/default_job.json: the first
    5 steps of `python train.py`, bf16 tolerances)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    out = subprocess.run(["srun", "--ntasks=2", "--partition=debug", str(ROOT / ".venv" / "bin"
                                                                          / "python"),
                          TRAIN, "trainer.stop_at_step=5", "trainer.log_every=1", *ON_CPU],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-5000:]
    [metrics] = list(tmp_path.rglob("metrics.jsonl"))
    log = (metrics.parent / "train.log").read_text()
    assert "on 2 rank(s) (dp=2" in log and "rendezvous at localhost:" in log, log
    assert_golden("default_job", read_metrics(metrics))
