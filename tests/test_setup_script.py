"""scripts/setup.sh chooses the torch build from the machine (dry runs: nothing installed)."""

import glob
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path, torch=None, nvidia_smi=None) -> str:
    """The script's dry-run output; ``nvidia_smi``: what a fake nvidia-smi -L prints."""
    env = {k: v for k, v in os.environ.items() if k != "AUTOMODEL_TORCH"}
    if torch is not None:
        env["AUTOMODEL_TORCH"] = torch
    if nvidia_smi is not None:
        fake = tmp_path / "bin" / "nvidia-smi"
        fake.parent.mkdir(exist_ok=True)
        fake.write_text(f"#!/bin/sh\nprintf '{nvidia_smi}'\n")
        fake.chmod(0o755)
        env["PATH"] = f"{fake.parent}:{env['PATH']}"
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def test_a_listed_gpu_gets_the_cuda_build(tmp_path):
    out = dry_run(tmp_path, nvidia_smi="GPU 0: NVIDIA H200 (UUID: GPU-1)\\n")
    assert "torch: cu128 (auto: nvidia-smi lists 1 GPU(s))" in out
    assert ("pip install torch==2.13.0+cu128 --extra-index-url "
            "https://download.pytorch.org/whl/cu128") in out


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="this machine has a GPU")
def test_no_gpu_gets_the_cpu_build(tmp_path):
    for fake in (None, "No devices were found\\n"):
        out = dry_run(tmp_path, nvidia_smi=fake)
        assert "torch: cpu (auto: no NVIDIA GPU" in out
        assert "pip install torch==2.13.0+cpu\n" in out  # "+cpu": never a CUDA wheel


def test_the_environment_overrides_the_choice(tmp_path):
    gpu = "GPU 0: NVIDIA H200 (UUID: GPU-1)\\n"
    assert "pip install torch==2.13.0+cpu\n" in dry_run(tmp_path, "cpu", nvidia_smi=gpu)
    out = dry_run(tmp_path, "cuda")
    assert "torch: cu128 (AUTOMODEL_TORCH=cuda)" in out and "whl/cu128" in out
    out = dry_run(tmp_path, "cu126")
    assert "pip install torch==2.13.0+cu126 --extra-index-url " \
           "https://download.pytorch.org/whl/cu126" in out
    out = dry_run(tmp_path, "torch==2.13.0 --index-url https://mirror.example/simple")
    assert "torch: custom" in out
    assert "pip install torch==2.13.0 --index-url https://mirror.example/simple" in out
