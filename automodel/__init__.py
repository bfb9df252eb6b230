"""automodel: Hydra-composed distributed training of Hugging Face causal LMs.

Importing the package is cheap: torch is only imported by the modules that run a job.
"""

__version__ = "0.1.0"
