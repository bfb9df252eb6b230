"""Submit one job to SLURM through submitit, without a Hydra sweep.

    python -m launchers.slurm [--nodes 1] [--tasks-per-node 2] [--partition P] [--time-min 60]
                              [--requeue N] [--folder DIR] [--wait] [override ...]

The overrides are the same ``key=value`` strings ``train.py`` takes; the config is composed,
validated and preflighted (``automodel.checks.preflight``: the model's TP plan and pipeline
split, the data) here, before anything is submitted. Prints the job id; with ``--wait`` it
follows the job to its end and exits non-zero (with the log path) if it failed. With
``--requeue N`` a job that fails (a node or rank lost) is requeued by SLURM up to N times and
resumes from its last complete checkpoint (``automodel.launch.slurm.requeue_parameters``).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path


class TrainJob:
    """What each SLURM task runs: compose, resolve in SLURM's environment, train one rank.

    Checkpointable for submitit: on preemption or time-out the ranks save a checkpoint and
    submitit requeues the same job, which resumes from it."""

    def __call__(self, overrides: list[str], output_dir: str):
        import os

        from automodel.config.build import ConfigError
        from automodel.errors import TrainingStopped
        from automodel.launch.restarts import task_exit_code
        from automodel.launch.slurm import next_run
        from automodel.startup import without_collections

        try:
            with without_collections():  # (the task's start-up: see automodel/startup.py)
                from automodel.api import load_config
                from automodel.checks.preflight import preflight
                from automodel.launch.local import launch

                cfg = load_config(overrides, output_dir=output_dir, env=os.environ)
                preflight(cfg)  # again in the task: the submitter's data cache is opened
                import automodel.recipes.train  # noqa: F401  (this task is a rank)
            return launch(cfg)
        except TrainingStopped as stopped:  # saved (and requeued): end the task without a
            # result, so submitit waits for the requeued run's
            print(f"automodel: {stopped}", file=sys.stderr, flush=True)
            sys.exit(task_exit_code(stopped))
        except ConfigError as err:  # (found on the node: the same in any later run)
            if next_run() is None:
                raise
            # exit code 2: neither restarted nor requeued (automodel.launch.restarts)
            print(f"automodel: configuration error:\n{err}", file=sys.stderr, flush=True)
            sys.exit(2)
        except Exception as err:
            then = next_run()
            if then is None:
                raise
            # the job runs again: no result (an error would end the submitter's wait)
            print(f"automodel: {err}\nautomodel: {then}", file=sys.stderr, flush=True)
            sys.exit(1)

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


_SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)")


def first_failed_task(batch_log: str) -> str:
    """", rank N on NODE ended first (<srun's reason>)" from srun's lines in the job's log,
    or ""."""
    try:
        with open(batch_log, errors="replace") as f:
            for line in f:
                m = _SRUN_TASK_ERROR.search(line)
                if m:
                    return (f": rank {m.group(2)} on {m.group(1)} ended first "
                            f"({m.group(3).strip()})")
    except OSError:
        pass
    return ""


_RANK_REPORT = re.compile(r"automodel: (rank \d+ failed during .*)")


def rank_report(log_folder: Path, job_id: str, first: str = "") -> str:
    """The failure summary a rank of the job printed to its log (``automodel: rank N failed
    during ...``): that of the rank srun saw end first (``first``, from
    ``first_failed_task``), else the first found; or ""."""
    found = {}
    for log in sorted(log_folder.glob(f"{job_id}_*_log.err")):
        try:
            with open(log, errors="replace") as f:
                for line in f:
                    m = _RANK_REPORT.search(line)
                    if m:
                        found.setdefault(int(m.group(1).split()[1]), m.group(1))
                        break
        except OSError:
            continue
    from automodel.runtime.failure import is_consequence

    ended = re.match(r": rank (\d+) ended first", first)
    if ended and int(ended.group(1)) in found:
        return found[int(ended.group(1))]
    causes = [r for r in sorted(found) if not is_consequence(found[r])]  # (not "peer gone")
    return found[(causes or sorted(found))[0]] if found else ""


def _request_problem(args) -> str | None:
    """Why the request of these flags can never start on its partition, or None."""
    from automodel.launch.slurm_request import Request, check_request

    return check_request(Request(
        args.nodes, args.tasks_per_node, args.cpus_per_task, args.time_min, args.partition,
        {"nodes": "--nodes", "tasks_per_node": "--tasks-per-node",
         "cpus_per_task": "--cpus-per-task", "minutes": "--time-min"}))


def resolve_job(args, output_dir: str) -> tuple:
    """(the job's config, the overrides its tasks run) as its world will have them, checked
    and preflighted before anything is submitted: ``layout=auto`` searched here for the
    job's nodes (the chosen layout's overrides, ``layout=manual``); a job that checks its plan
    (``trainer.plan_check_steps``) planned here; ``plan.json`` in ``output_dir``."""
    from automodel.api import load_config
    from automodel.checks.preflight import preflight
    from automodel.launch.slurm import submit_env
    from automodel.prepare.plan_first import plan_at_submit
    from automodel.prepare.sweep_jobs import with_overrides
    from automodel.startup import without_collections

    env = submit_env(args.nodes, args.tasks_per_node)
    overrides = list(args.overrides)
    with without_collections():
        cfg = load_config(overrides, output_dir=output_dir, env=env)
        chosen = plan_at_submit(cfg, args.nodes, args.tasks_per_node, args.partition)
        if chosen:  # (layout=auto: the job as its tasks will compose it)
            overrides = with_overrides(overrides, chosen)
            cfg = load_config(overrides, output_dir=output_dir, env=env)
        preflight(cfg, gpus=args.gpus_per_node)
    return cfg, overrides


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launchers.slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node")
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--time-min", type=int, default=60)
    p.add_argument("--requeue", type=int, default=0, metavar="N",
                   help="requeue a failed job (a node or rank lost) up to N times; it resumes "
                        "from its last complete checkpoint")
    p.add_argument("--folder", default=None, help="submitit folder (default: under the output)")
    p.add_argument("--output-dir", default=None,
                   help="the job's output directory (default: outputs/slurm/<timestamp>)")
    p.add_argument("--wait", action="store_true", help="follow the job to its end")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from automodel.config.build import ConfigError
    from automodel.launch.slurm import job_script_parameters, job_states_refreshed

    problem = _request_problem(args)
    if problem is not None:
        print(f"automodel: configuration error:\n{problem}; nothing was submitted",
              file=sys.stderr)
        return 2
    output_dir = str(Path(args.output_dir or Path("outputs") / "slurm" /
                          datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).absolute())
    try:  # the whole preflight, against the world the job will have, before submitting
        cfg, args.overrides = resolve_job(args, output_dir)
    except ConfigError as err:
        print(f"automodel: configuration error:\n{err}", file=sys.stderr)
        return 2

    import submitit

    folder = args.folder or str(Path(output_dir) / ".submitit" / "%j")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    # one rank dead = the job is over: srun stops the other tasks at once
    params = dict(nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                  cpus_per_task=args.cpus_per_task, timeout_min=args.time_min,
                  name="automodel", slurm_srun_args=["--kill-on-bad-exit=1"])
    script = job_script_parameters(args.requeue, [cfg.distributed.max_restarts])
    params.update({f"slurm_{k}": v for k, v in script.items()})
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.partition:
        params["slurm_partition"] = args.partition
    if args.account:
        params["slurm_account"] = args.account
    executor.update_parameters(**params)
    job = executor.submit(TrainJob(), args.overrides, output_dir)
    print(f"submitted SLURM job {job.job_id}; output in {output_dir}", flush=True)
    if not args.wait:
        return 0
    try:
        with job_states_refreshed():
            records = job.results()[0]
    except Exception as err:  # submitit raises with the job's state and log paths
        first = first_failed_task(str(job.paths.stderr))
        report = rank_report(Path(job.paths.stderr).parent, str(job.job_id), first)
        print(f"automodel: SLURM job {job.job_id} failed{first}"
              f"{'; ' + report if report else ''}; log: {job.paths.stderr}\n{err}",
              file=sys.stderr)
        return 1
    if records:
        print(f"SLURM job {job.job_id} finished: final loss {records[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
