"""Megatron-FSDP (the ``megatron-fsdp`` package). Its runtime needs CUDA and NCCL.

The options are validated by ``automodel.config.resolve``; starting a run with this strategy is
refused early (see ``automodel.launch.support``) until its runtime lands.
"""

UNSUPPORTED_REASON = (
    "parallelism=megatron_fsdp: the options are validated, but training with it is not "
    "available yet (megatron-fsdp needs CUDA and NCCL; its runtime comes with a later "
    "release). Use parallelism=fsdp2.")
