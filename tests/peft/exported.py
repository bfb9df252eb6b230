"""What the export tests of LoRA, QLoRA and DoRA share: a one-process run that exports its
step-3 checkpoint, the model as it trained (base + the checkpoint's adapters), and logits."""

import os

import torch

from automodel.api import load_config
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path
from automodel.models.builder import build_model
from automodel.peft import add_adapters, is_adapter
from tests.helpers import job_overrides, train

EXPORT = ["checkpoint.every_steps=3", "trainer.max_steps=3", "checkpoint.export_hf=true"]
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def exported_run(run: list, tmp_path, layout=("parallelism=none",)) -> tuple:
    """(config, step-3 checkpoint dir) of ``run`` trained 3 steps and exported."""
    train(list(layout) + run + EXPORT, tmp_path)
    return (load_config(job_overrides(list(layout) + run + EXPORT)),
            checkpoint_path(str(tmp_path / "checkpoints"), 3))


def trained_model(cfg, step_dir: str):
    """The model as trained: the base (pretrained, or from config and the run's seed) with the
    adapters of the checkpoint, which holds nothing else."""
    model = build_model(cfg.model, seed=cfg.trainer.seed)
    add_adapters(model, cfg.peft, str(cfg.trainer.loss))
    state = load_full_model_state(step_dir)
    assert state and all(is_adapter(k) for k in state)  # (the base is referenced, not saved)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not any(is_adapter(k) for k in missing)
    return model.eval()


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def merged_model(step_dir: str):
    """The merged export, loaded by transformers alone."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(step_dir, "hf")).eval()
