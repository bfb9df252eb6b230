"""Start NeMo AutoModel's fine-tuning recipe on CPU ranks (one torchrun worker each).

    torchrun --nproc-per-node 2 nemo_automodel_cpu.py CONFIG.yaml [--key.sub=value ...]

NeMo AutoModel 0.7.0 targets CUDA and calls a few ``torch.cuda`` functions unconditionally
on its way to the training loop, which a CPU build of torch rejects. This file stubs exactly
those before the recipe starts; none of them touches the training arithmetic:

* ``torch.cuda.reset_peak_memory_stats``: memory bookkeeping, made a no-op.
* ``torch.cuda.current_device``: NeMo builds ``torch.device("cuda", current_device())`` for
  the pipeline-parallel machinery (unused here) and passes ``current_device()`` as the device
  on which the meta-initialised model is materialised. It returns 0 here, and the
  materialisation (``Checkpointer.initialize_model_weights``) is pointed at the CPU.
"""

import sys

import torch


def _patch_for_cpu() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: 0

    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer

    materialise = Checkpointer.initialize_model_weights

    def on_cpu(model, device, peft_init_method=None):
        return materialise(model, torch.device("cpu"), peft_init_method=peft_init_method)

    Checkpointer.initialize_model_weights = staticmethod(on_cpu)


def main() -> None:
    _patch_for_cpu()
    from nemo_automodel.cli.app import main as cli_main

    cli_main()


if __name__ == "__main__":
    sys.exit(main())
