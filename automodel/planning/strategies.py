"""How the planner runs each ``parallelism=<name>``: the strategy's own wrap, a planning
stand-in for a wrap that cannot run on fake tensors, or a refusal that says why.

A strategy missing here is refused by name (``ConfigError``): a simulation must run the
wrap the job would run, or say it cannot.
"""

from __future__ import annotations

import dataclasses

from automodel.config.build import ConfigError

# the strategy's own code runs on fake tensors as it is
AS_IS = ("none", "fsdp2", "hsdp")
# strategy -> the planning wrap that stands in for its ``wrap`` (an import path)
PLANNING_WRAPS = {"ddp": "automodel.planning.ddp.wrap_planned_ddp"}
# strategy -> what its stand-in does differently (a note of every plan of it)
STAND_IN_NOTES = {
    "ddp": "parallelism=ddp: DDP's C++ reducer re-enacted (planning/ddp.py); the step "
           "simulated is DDP's first, with the buckets of the wrap; a run rebuilds them in "
           "gradient-ready order after it: the bytes per step are the same, the number of "
           "all-reduces (comm_calls_per_step) may differ",
}
# strategy -> why the planner cannot simulate it
REFUSED = {
    "megatron_fsdp": (
        "the megatron-fsdp package runs on CUDA only: its wrap (MegatronFSDP.__init__) asks "
        "for the current CUDA device and creates CUDA streams for its gathers and reductions, "
        "which the planner's CPU process has not; plan the layout with parallelism=fsdp2 (the "
        "same sharding of parameters, gradients and optimizer states over the same ranks)"),
}


def planning_strategy(strategy):
    """The ``Strategy`` entry the planner runs in place of ``strategy``."""
    if strategy.name in REFUSED:
        raise ConfigError(f"parallelism={strategy.name} cannot be planned: "
                          f"{REFUSED[strategy.name]}")
    if strategy.name in PLANNING_WRAPS:
        return dataclasses.replace(strategy, wrap=PLANNING_WRAPS[strategy.name])
    if strategy.name not in AS_IS:
        raise ConfigError(
            f"parallelism={strategy.name} has no planning path: the planner runs only "
            f"strategies whose wrap it knows to run on fake tensors "
            f"({', '.join(AS_IS + tuple(PLANNING_WRAPS))}); add its entry to "
            "automodel/planning/strategies.py")
    return strategy
