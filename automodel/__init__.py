"""automodel: Hydra-composed distributed training of Hugging Face causal LMs.

Importing the package is cheap: torch is only imported by the modules that run a job.
"""

__version__ = "0.1.0"


def _quiet_torchao() -> None:
    """torchao (QLoRA's NF4 weights; transformers imports it too wherever it is installed)
    warns at import about its CUDA and Triton kernels, missing on a CPU build of torch, and
    about enums torch now handles itself: nothing NF4 uses. Its warnings are dropped (errors
    stay), and the enum lines."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported"
        not in record.getMessage())


_quiet_torchao()
