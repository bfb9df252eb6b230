"""automodel's Hydra launcher plugin (``hydra/launcher=slurm``, ``conf/hydra/launcher/slurm.yaml``).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace, so the class lives
here; the repository root is on ``sys.path`` whenever ``train.py`` runs. What it adds to the
submitit SLURM launcher is in ``automodel/launch/hydra_slurm.py``.
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)


@dataclass
class AutomodelSlurmQueueConf(SlurmQueueConf):
    """submitit's SLURM options, and automodel's own."""

    _target_: str = "hydra_plugins.automodel_launcher.SlurmLauncher"
    # requeue a job that fails (a node or rank lost) up to this many times; it resumes from
    # its last complete checkpoint (automodel.launch.slurm.requeue_parameters)
    requeue: int = 0


ConfigStore.instance().store(group="hydra/launcher", name="automodel_slurm",
                             node=AutomodelSlurmQueueConf(), provider="automodel")


class SlurmLauncher(SubmititSlurmLauncher):
    """Preflights every job of the sweep in the submitting process, then submits them with
    the stock launcher (the object each SLURM task unpickles, so a task needs no import of
    this module)."""

    def launch(self, job_overrides, initial_job_idx):
        from automodel.launch.hydra_slurm import check_slurm_request, stock_parameters
        from automodel.launch.slurm import job_states_refreshed
        from automodel.prepare.sweep_jobs import preflight_sweep

        check_slurm_request(self.params)
        job_overrides = [list(o) for o in job_overrides]  # (layout=auto adds its choice)
        restarts = preflight_sweep(self, job_overrides, initial_job_idx)
        stock = SubmititSlurmLauncher(**stock_parameters(self.params, restarts))
        stock.setup(hydra_context=self.hydra_context, task_function=self.task_function,
                    config=self.config)
        with job_states_refreshed():  # (the stock launcher submits, then waits for the jobs)
            return stock.launch(job_overrides, initial_job_idx)
