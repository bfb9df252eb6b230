"""The GPU set: tests about CUDA, marked ``gpu``. They need NVIDIA GPUs and a CUDA build of
torch (``scripts/setup.sh`` installs one where it sees a GPU) and are skipped elsewhere, with
the reason in the summary (tests/conftest.py). CI has no GPU; on a GPU machine:

    .venv/bin/python -m pytest -m gpu

Every other test pins its ranks to the CPU under gloo (tests.helpers.ON_CPU,
tests/test_cpu_pin.py); these ask for the default backend, which is nccl where CUDA is.
"""

import pytest
import torch

from automodel.distributed.init import backend_and_device
from tests.conftest import gpus_here
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train

pytestmark = pytest.mark.gpu


@pytest.mark.fast
def test_the_default_backend_puts_each_rank_on_its_gpu():
    assert backend_and_device(None, 0) == ("nccl", torch.device("cuda", 0))
    assert backend_and_device("nccl", 0) == ("nccl", torch.device("cuda", 0))
    assert backend_and_device("gloo", 0) == ("gloo", torch.device("cpu"))


def test_a_job_on_the_gpus_matches_the_cpu_reference(reference, tmp_path):
    # two ranks where there are two GPUs (nccl, one GPU each), else one (in this process)
    ranks = 2 if gpus_here()[0] >= 2 else 1
    records = train(["parallelism=fsdp2", FP32, "distributed.backend=null",
                     f"distributed.nproc_per_node={ranks}"], tmp_path)
    log = (tmp_path / "train.log").read_text()
    assert f"on {ranks} rank(s)" in log and "backend nccl, device cuda" in log, log
    # fp32 on both sides; cuBLAS and CUDA attention sum in another order than the CPU kernels,
    # so the bounds are looser than between CPU layouts (not measured: written on a machine
    # without a GPU). A gradient off by 2x still misses them by far.
    assert_matches(records, reference(), rtol=1e-3, grad_rtol=1e-2)
