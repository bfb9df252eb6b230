"""The fast tier's numeric comparisons hold on another CPU kernel set: AVX2, as on a CPU
without AVX-512 (an AMD EPYC of a user's found an AVX-512-only tolerance in
tests/data/test_packing.py). The tolerances of the stored goldens were measured the same way
(tests/distributed/test_golden.py's docstring)."""

import os
import platform
import subprocess
import sys

from tests.cli.test_cli import ROOT

# The fast tests that compare a model's numbers (losses, gradients) computed two ways
NUMERIC = ["tests/data/test_packing.py", "tests/distributed/test_moe.py",
           "tests/models/test_models.py", "tests/distributed/test_mixed_precision.py"]


def test_fast_numerics_hold_on_avx2_kernels():
    kernels = "avx2" if platform.machine().lower() in ("x86_64", "amd64") else "default"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernels}
    probe = subprocess.run([sys.executable, "-c", "import torch; "
                            "print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().lower() == kernels, probe.stdout + probe.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "fast", "-p",
                          "no:cacheprovider", *NUMERIC], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
