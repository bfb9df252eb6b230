"""Start torchtitan's trainer on CPU ranks (one torchrun worker each).

    torchrun --nproc-per-node 2 torchtitan_cpu.py --module torchtitan_llama \
        --config llama_bench [--training.steps N ...]

torchtitan 0.3.0 picks its device at import time from the available accelerator and falls
back to ``cuda`` when there is none, so on a CPU-only torch it would ask for NCCL and CUDA
devices. Before anything else of torchtitan is imported, this file points its device choice
(``torchtitan.tools.utils.device_type`` / ``device_module``) at the CPU: the process group
then uses gloo (torch's default backend for ``cpu``), the mesh and the model live on the CPU,
and the CUDA memory monitor reads nothing. The training step itself is torchtitan's own.

It also fills one gap between torchtitan 0.3.0 and torch 2.13.0: after the first step
torchtitan shortens the process groups' timeout with ``torch.distributed.set_timeout``, which
this torch ships under its older private name ``distributed_c10d._set_pg_timeout``.
"""

import os
import sys

import torch


class _CpuDevice:
    """What torchtitan asks of its device module, answered for the CPU (no memory stats)."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        class Properties:
            total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Properties()

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}


def _use_cpu() -> None:
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    if torch.cuda.is_available():
        return
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _CpuDevice


def main() -> None:
    _use_cpu()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    sys.exit(main())
