"""Start NeMo AutoModel's fine-tuning recipe on CPU ranks (one torchrun worker each).

    torchrun --nproc-per-node 2 nemo_automodel_cpu.py CONFIG.yaml [--key.sub=value ...]

NeMo AutoModel 0.7.0 targets CUDA and calls a few ``torch.cuda`` functions unconditionally
on its way to the training loop, which a CPU build of torch rejects. This file stubs exactly
those before the recipe starts; none of them touches the training arithmetic:

* ``torch.cuda.reset_peak_memory_stats``: memory bookkeeping, made a no-op.
* ``torch.cuda.current_device``: NeMo builds ``torch.device("cuda", current_device())`` for
  the pipeline-parallel machinery (unused here), so it returns 0, and it hands
  ``current_device()`` to ``apply_model_infrastructure`` as the device on which the
  meta-initialised model is materialised and placed; that call is pointed at the CPU.

It also hides Triton from NeMo AutoModel (``import triton`` fails, as on a CPU-only
install): the shared venv has Triton because torchtitan imports it, and with this Triton
release NeMo's LoRA kernels (imported unconditionally) fail at import. Without Triton NeMo
takes its plain PyTorch paths, which are the ones a CPU run uses anyway.
"""

import os
import sys

import torch


def _patch_for_cpu() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if torch.cuda.is_available():
        return
    sys.modules["triton"] = None  # see the module docstring
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: 0

    from nemo_automodel._transformers import auto_model

    place = auto_model.apply_model_infrastructure

    def on_cpu(*args, **kwargs):
        kwargs["device"] = torch.device("cpu")
        return place(*args, **kwargs)

    auto_model.apply_model_infrastructure = on_cpu


def main() -> None:
    _patch_for_cpu()
    from nemo_automodel.cli.app import main as cli_main

    cli_main()


if __name__ == "__main__":
    sys.exit(main())
