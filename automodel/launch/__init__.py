"""Starting ranks: detect torchrun / SLURM, or spawn local ranks ourselves."""
