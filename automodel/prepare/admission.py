"""Which layouts a search may weigh: each candidate is put to the checks the preflight would
make of it as a job (the config's refusals, then the model's: its TP plan, context-parallel
split, expert and pipeline layouts), so ``layout=auto`` and ``plan.py plan.search=true`` only
rank layouts the job could run, and never choose, or name in a refusal, one the preflight would
refuse (``peft=qlora`` and a TP layout, say).

Cheap enough for thousands of candidates: the job's config is composed once per pipeline
schedule and each candidate's keys are set on a copy (no composition per candidate), the
verdict is kept per layout (the micro-batch size aside), and the model is built on the meta
device once.
"""

from __future__ import annotations

import logging

from automodel.config.build import ConfigError

log = logging.getLogger(__name__)

_MICRO_BATCH = ("pipeline.pp_microbatch_size=", "trainer.local_batch_size=")


class Admission:
    """``admission(candidate)``: why the preflight would refuse the candidate's layout, or
    None. ``base``: the job's own overrides, without layout keys."""

    def __init__(self, base: list[str], seq_len: int):
        self.base = [o for o in base if not o.startswith("distributed.nproc_per_node=")]
        self.seq_len = seq_len
        self._composed: dict = {}  # group choices -> the composed config
        self._verdicts: dict = {}  # a layout's overrides (no micro-batch size) -> refusal
        self._probes: dict = {}  # a probe's key -> refusal
        self._model = None

    def __call__(self, candidate) -> str | None:
        overrides = candidate.overrides()
        key = tuple(o for o in overrides if not o.startswith(_MICRO_BATCH))
        if key not in self._verdicts:
            self._verdicts[key] = self._refusal(overrides) or self._probe_refusal(
                candidate.probe)
        return self._verdicts[key]

    def _probe_refusal(self, key) -> str | None:
        """The planner estimates a layout from a probe: a short run of its layer shapes on
        ``key.dp`` FSDP ranks (``planning/probes.py``), which must be a job the preflight lets
        start too (QLoRA's NF4 weights split over its shards, say)."""
        from automodel.planning.probes import PROBE_DEPTHS, probe_overrides

        if key not in self._probes:
            why = self._refusal(probe_overrides(self.base, key, PROBE_DEPTHS[0], self.seq_len))
            self._probes[key] = None if why is None else (
                f"the planner measures this layout on {key.dp} x {key.cp * key.tp} ranks "
                f"(probe {key.name}), which the preflight refuses: {why}")
        return self._probes[key]

    def _refusal(self, overrides: list[str]) -> str | None:
        from automodel.checks.preflight import LAYOUT_CHECKS

        try:
            cfg = self._resolve(overrides)
            for check in LAYOUT_CHECKS:
                check(cfg, self._meta_model(cfg))
        except ConfigError as err:
            return str(err).splitlines()[0]
        return None

    def _resolve(self, overrides: list[str]):
        """The job with ``overrides`` (a candidate's: mesh sizes, the pipeline, its options),
        resolved as ``load_config`` would: the group choices composed (once each), the other
        keys set on a copy."""
        from omegaconf import OmegaConf

        from automodel.config.resolve import resolve

        choices = tuple(o for o in overrides if "." not in o.split("=", 1)[0])
        if choices not in self._composed:
            from automodel.config.compose import compose

            composed = compose([*self.base, *choices, "mesh.dp_size=1"])
            groups = OmegaConf.to_container(composed.hydra.runtime.choices)
            with _unlocked(composed):
                del composed["hydra"]  # (a copy per layout: Hydra's own node is most of it)
            self._composed[choices] = composed, groups
        composed, groups = self._composed[choices]
        cfg = composed.copy()
        keys = [o.lstrip("+") for o in overrides if o not in choices]
        with _unlocked(cfg):
            cfg.merge_with(OmegaConf.from_dotlist(keys))
        return resolve(cfg, env={"CUDA_VISIBLE_DEVICES": ""}, choices=groups,
                       overrides=[*self.base, *overrides])

    def _meta_model(self, cfg):
        if self._model is None:
            from automodel.models.builder import build_meta_model

            self._model = build_meta_model(cfg.model)
        return self._model


class _unlocked:
    """A composed config's struct flag off while keys are set (they are checked again by
    ``resolve``, against the schemas)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.cfg, True)
