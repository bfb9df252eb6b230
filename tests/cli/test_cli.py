"""The command line as a user types it, in subprocesses."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.test_golden import assert_golden
from tests.helpers import ON_CPU

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train.py")
QUICK = ["data=synthetic", "data.num_sequences=64", "trainer.max_steps=3", "trainer.log_every=1",
         "trainer.global_batch_size=8", "trainer.seq_len=16"]


def cli_args(args) -> list:
    """The command line ``run`` gives: ``args``, then the CPU pin (tests.helpers.ON_CPU: ranks
    on the CPU under gloo, also on a machine with GPUs) unless ``args`` name a backend."""
    args = list(args)
    if any(a.startswith("distributed.backend=") for a in args):
        return args
    return args + ON_CPU


def run(args, cwd, env_extra=None, timeout=300, cmd=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    env = {k: v for k, v in env.items() if v is not None}  # (None: unset it)
    return subprocess.run((cmd or [sys.executable, TRAIN]) + cli_args(args), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def no_torch_env(tmp_path):
    """PYTHONPATH with a 'torch' that fails on import: proves a command never imports torch."""
    fake = tmp_path / "fake_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch must not be imported here')\n")
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}


# A machine without a visible GPU, on any machine: CUDA sees none, nor does config resolution
# (automodel.config.launch_env.visible_gpu_count reads the variable as CUDA does).
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def metrics_files(root: Path):
    return sorted(root.rglob("metrics.jsonl"))


def losses(path: Path, key="loss"):
    values = [json.loads(line)[key] for line in path.read_text().splitlines()]
    assert values, f"{path} holds no records"
    return values


def grad_norms(path: Path):
    return losses(path, "grad_norm")


@pytest.mark.fast
def test_cfg_job_prints_the_composed_config_without_torch(tmp_path):
    out = run(["--cfg", "job", "parallelism=fsdp2", "pipeline=interleaved"], tmp_path,
              no_torch_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "pp_schedule: interleaved_1f1b" in out.stdout
    assert "enable_fsdp2_prefetch: true" in out.stdout
    assert not (tmp_path / "outputs").exists() or not metrics_files(tmp_path)


@pytest.mark.fast
def test_typo_fails_before_torch_with_a_suggestion(tmp_path):
    out = run(["parallelism=ddp", "parallelism.bucket_cap=25"], tmp_path, no_torch_env(tmp_path))
    assert out.returncode == 2
    assert "'parallelism.bucket_cap' is not an option of DDPConfig" in out.stderr
    assert "Did you mean 'parallelism.bucket_cap_mb'" in out.stderr
    assert "find_unused_parameters" in out.stderr  # what is allowed


@pytest.mark.fast
def test_bad_value_type_fails_at_compose(tmp_path):
    out = run(["parallelism=ddp", "parallelism.bucket_cap_mb=lots"], tmp_path,
              no_torch_env(tmp_path))
    assert out.returncode != 0
    assert "parallelism.bucket_cap_mb" in out.stderr and "'lots'" in out.stderr


@pytest.mark.fast
def test_unknown_group_option_lists_the_choices(tmp_path):
    out = run(["parallelism=fsdq"], tmp_path, no_torch_env(tmp_path))
    assert out.returncode != 0
    assert "Could not find 'parallelism/fsdq'" in out.stderr and "hsdp" in out.stderr


@pytest.mark.fast
def test_bad_size_product_fails_before_any_process(tmp_path):
    out = run(["parallelism=fsdp2", "mesh.dp_size=3", "distributed.nproc_per_node=2"], tmp_path,
              no_torch_env(tmp_path))
    assert out.returncode == 2
    assert "distributed.nproc_per_node=2" in out.stderr and "mesh.dp_size" in out.stderr


@pytest.mark.fast
def test_what_this_machine_cannot_run_is_refused_before_torch_is_imported(tmp_path):
    # megatron-fsdp needs an NVIDIA GPU: a machine without one says so without importing torch
    out = run(["parallelism=megatron_fsdp"], tmp_path, {**no_torch_env(tmp_path), **NO_GPU})
    assert out.returncode == 2 and "runs on NVIDIA GPUs only" in out.stderr


def test_a_failing_rank_fails_the_job_and_is_named(tmp_path):
    # An activation name transformers does not know: the model constructor raises on the ranks.
    out = run(["parallelism=ddp", "+model.config.hidden_act=no_such_act"] + QUICK, tmp_path)
    assert out.returncode == 1
    assert "automodel: job failed" in out.stderr
    assert re.search(r"rank [01] failed \(exit code 1\) during model build: KeyError: "
                     r"'no_such_act'", out.stderr)


def test_local_launch_and_torchrun_agree_with_one_output_dir_each(tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "torchrun").mkdir()
    local = run(["parallelism=ddp"] + QUICK, tmp_path / "local")
    # --standalone: a rendezvous port the OS picks (not a fixed one such as 29500)
    torchrun = run(["--standalone", "--nproc_per_node", "2", TRAIN, "parallelism=ddp"] + QUICK,
                   tmp_path / "torchrun",
                   cmd=[sys.executable, "-m", "torch.distributed.run"])
    assert local.returncode == 0, local.stderr
    assert torchrun.returncode == 0, torchrun.stderr
    [local_metrics] = metrics_files(tmp_path / "local")
    [torchrun_metrics] = metrics_files(tmp_path / "torchrun")  # rank 1 wrote no directory
    assert len([p for p in (tmp_path / "torchrun" / "outputs").rglob("*") if p.is_dir()
                and p.name != ".hydra" and p.parent.name != "outputs"]) == 1
    assert len(losses(local_metrics)) == 3
    np.testing.assert_allclose(losses(torchrun_metrics), losses(local_metrics), rtol=1e-6)
    np.testing.assert_allclose(grad_norms(torchrun_metrics), grad_norms(local_metrics),
                               rtol=1e-5)
    assert (local_metrics.parent / ".hydra" / "config.yaml").exists()
    assert (local_metrics.parent / "train.log").read_text().count("step 3/3") == 1


def test_readme_main_job_matches_its_golden_values_and_learns(tmp_path):
    # The README's first laptop command ("Try it on a laptop: two commands"), minus the setup
    # step (the test runs inside the venv), logging every step (logging changes no number):
    # its first 5 steps are the stored default job's (tests/golden/default_job.json: the same
    # job stopped at step 5), losses, gradient norms and learning rates; then it learns.
    out = run(["trainer.log_every=1"], tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    [metrics] = metrics_files(tmp_path)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 301))
    assert_golden("default_job", records[:5])
    assert records[0]["loss"] > 5.0 and records[-1]["loss"] < 1.0
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_second", "peak_memory_bytes"):
        assert key in records[-1]


def test_local_launcher_reruns_a_saved_run(tmp_path):
    first = run(["parallelism=fsdp2"] + QUICK, tmp_path)
    assert first.returncode == 0, first.stderr
    [metrics] = metrics_files(tmp_path)
    again = run(["--rerun", str(metrics.parent), "--output-dir", str(tmp_path / "again")],
                ROOT, cmd=[sys.executable, "-m", "launchers.local"])
    assert again.returncode == 0, again.stderr
    assert len(losses(metrics)) == 3
    assert losses(tmp_path / "again" / "metrics.jsonl") == losses(metrics)
    assert grad_norms(tmp_path / "again" / "metrics.jsonl") == grad_norms(metrics)
    bad = run(["parallelism=ddp", "mesh.cp_size=2"], ROOT, cmd=[sys.executable, "-m",
                                                              "launchers.local"])
    assert bad.returncode == 2 and "mesh.cp_size=2" in bad.stderr
