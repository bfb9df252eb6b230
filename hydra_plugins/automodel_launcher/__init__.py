"""automodel's Hydra launcher plugin (``hydra/launcher=slurm``, ``conf/hydra/launcher/slurm.yaml``).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace, so the class lives
here; the repository root is on ``sys.path`` whenever ``train.py`` runs. What it adds to the
submitit SLURM launcher is in ``automodel/launch/hydra_slurm.py``.
"""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)


class SlurmLauncher(SubmititSlurmLauncher):
    """Preflights every job of the sweep in the submitting process, then submits them with
    the stock launcher (the object each SLURM task unpickles, so a task needs no import of
    this module)."""

    def launch(self, job_overrides, initial_job_idx):
        from automodel.launch.hydra_slurm import preflight_sweep

        preflight_sweep(self, job_overrides, initial_job_idx)
        stock = SubmititSlurmLauncher(**self.params)
        stock.setup(hydra_context=self.hydra_context, task_function=self.task_function,
                    config=self.config)
        return stock.launch(job_overrides, initial_job_idx)
