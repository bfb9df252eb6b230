"""Start local ranks from one pre-imported server process.

Each local rank used to be a fresh interpreter that imported torch, transformers and automodel
(about 4 s of CPU per rank; 8 ranks on a node pay it 8 times, on the same cores). Here the
ranks are forked from multiprocessing's fork server, which imports those modules once, when the
first ranks of this process start; every later launch from the same process (a Hydra multirun
sweep, a test suite) forks from it again. The server holds no CUDA context, threads or process
groups, so forking it is safe.

A forked rank inherits the server's environment, which is the launching process's environment
at the time the server started, not at the time of this launch. ``adopt_environment`` gives the
rank the launcher's environment of now, keeping what the elastic agent set for the rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from multiprocessing import forkserver

# Imported by the server before it forks any rank (a rank then finds them in sys.modules).
PRELOAD = ["automodel.runtime.forkserver", "automodel.recipes.train", "transformers",
           "transformers.models.auto.modeling_auto"]

# The environment this module was imported with: in a forked rank, the server's environment.
# (Under another start method the module is imported in the rank before the agent's variables
# are set, so the same comparison holds.)
_START_ENV = dict(os.environ)
# What torch's elastic agent sets for each rank (kept even where equal to the server's value).
_RANK_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def context(extra_preload: tuple = ()) -> multiprocessing.context.BaseContext:
    """The fork-server context, its server set to preload ``PRELOAD``, ``extra_preload`` and
    last ``automodel.runtime.preloaded`` (what every rank imports, then ``gc.freeze()``). The
    preload list takes effect when the server starts: once per launching process; a module
    that cannot be imported is skipped."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *extra_preload, "automodel.runtime.preloaded"])
    _start_server()
    return ctx


def _start_server() -> None:
    """Start the server now (if not running), importing from this process's ``sys.path``.
    (Python 3.11's server ignores the path it is handed, so it would import automodel from
    wherever its own default path finds it, e.g. another checkout's editable install.) In the
    server, torch answers ``cuda.is_available()`` through NVML, which does not start the CUDA
    driver: a driver started before the fork would be unusable in every rank."""
    server_env = {"PYTHONPATH": os.pathsep.join(
        [p or os.getcwd() for p in sys.path]
        + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    with environment_restored(server_env):
        os.environ.update(server_env)
        forkserver.ensure_running()


@contextlib.contextmanager
def environment_restored(keys):
    """On exit, ``keys`` of this process's environment are as they were on entry (set back, or
    removed where they were unset)."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launcher_environment() -> dict:
    """What ``adopt_environment`` needs from the launching process, taken at launch time."""
    return dict(os.environ)


def adopt_environment(launcher_env: dict) -> None:
    """In a rank: replace the inherited environment with ``launcher_env``, except for the
    variables set for this rank since the server started (RANK, MASTER_PORT, ...)."""
    for_this_rank = {k: v for k, v in os.environ.items() if _START_ENV.get(k) != v
                     or k in _RANK_VARIABLES or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(for_this_rank)


def run_with_launcher_environment(entry, launcher_env: dict, *args):
    """A rank's entry point: ``entry(*args)`` under the launcher's environment."""
    adopt_environment(launcher_env)
    return entry(*args)
