"""Image-text models under a pipeline: what each stage takes besides its activations.

The first stage holds the vision tower and the projector (``Anatomy.front``) and runs the
model's own forward on each micro-batch's token ids and images: the images are encoded and
merged into the embeddings there, as without a pipeline. Later stages receive hidden states
only, so the step hands every stage, with each micro-batch (through the schedule, which
splits these on the batch dimension):

- ``image_rows``: the micro-batch's rows (a host tensor): the first stage looks up the
  micro-batch's image inputs by its first row (``StageImages``). Image inputs cannot be split
  by the schedule: a patch stream (Qwen2-VL's ``pixel_values``: [patches, ...]) has no batch
  dimension, and images per row vary. So the step cuts the rows into pipeline micro-batches
  before the images are loaded and keeps one entry per micro-batch;
- the model's per-token image masks (``token_type_ids``: Gemma 3's image tokens attend both
  ways on every stage's layers);
- ``rope_positions``, for a model that derives its positions from the images (Qwen2-VL's 3-D
  rotary positions): made once per micro-batch on the host by the model's own
  ``get_rope_index``, since later stages have no token ids to make them from.

A micro-batch without any image still runs the tower on the first stage, on a blank image,
and adds its features times zero to the stage's output: every rank then runs the tower's
collectives and reduces its (zero) gradients in every micro-batch, as the placeholder row
does without a pipeline (a row would change the micro-batch's shape, which every stage must
agree on).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from automodel.compat import tensor_leaves
from automodel.data.image_text import BLANK_IMAGE

ROWS = "image_rows"
POSITIONS = "rope_positions"


class StageImages:
    """The image inputs of the step's pipeline micro-batches, by first row (first stage)."""

    def __init__(self):
        self.table: dict[int, dict] = {}
        self.calls = 0

    def inputs(self, rows: torch.Tensor) -> dict:
        from automodel.compat.planning import is_fake

        if is_fake(rows):  # (the planner's fake tensors hold no values: the micro-batches in
            # the order the first stage runs them, the schedules' forward order)
            self.calls += 1
            return list(self.table.values())[(self.calls - 1) % len(self.table)]
        return self.table[int(rows[0])]


def schedule_inputs(micro_batches: list, base: nn.Module, token_masks: tuple) -> tuple:
    """(token ids [B, S], labels [B, S], the schedule's keyword inputs, the first stage's
    table) of a step's pipeline micro-batches ``[(inputs, labels, extras), ...]`` (from
    ``ImageTextData.split(placeholder_row=False)``); ``base``: the model's base (its
    ``get_rope_index``, where it derives positions); ``token_masks``: the per-token image
    masks a model may take (those the micro-batches hold are passed to every stage)."""
    token_masks = tuple(k for k in token_masks if k in micro_batches[0][2])
    table, masks, positions, start = StageImages(), [], [], 0
    for x, _, extras in micro_batches:
        images = {k: v for k, v in extras.items() if k not in token_masks and k != "position_ids"}
        table.table[start] = images
        start += x.shape[0]
        masks.append([extras[k] for k in token_masks])
        if "position_ids" in extras:  # (None: the model derives its positions)
            used = {k: extras[k] for k in token_masks}
            used.update({} if images.get(BLANK_IMAGE) else images)
            positions.append(_rope_positions(base, x, used))
    inputs = torch.cat([mb[0] for mb in micro_batches])
    labels = torch.cat([mb[1] for mb in micro_batches])
    kwargs = {ROWS: torch.arange(inputs.shape[0])}
    for i, key in enumerate(token_masks):
        kwargs[key] = torch.cat([m[i] for m in masks])
    if positions:  # [3, B, S] -> batch first, as the schedule splits it
        kwargs[POSITIONS] = torch.cat(positions, dim=1).movedim(1, 0).contiguous()
    return inputs, labels, kwargs, table


def _rope_positions(base: nn.Module, x: torch.Tensor, inputs: dict) -> torch.Tensor:
    """[3, micro-batch, S]: the model's own rotary positions of token ids ``x``, as its
    forward makes them (its ``compute_3d_position_ids`` where it has one, called as the
    forward calls it: no attention mask, no cache; else its ``get_rope_index``). Where the
    model makes none (Qwen2.5-Omni's thinker without an attention mask), the text positions
    its language model then uses."""
    make = getattr(base, "compute_3d_position_ids", None) or base.get_rope_index
    params = [p for p in inspect.signature(make).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    args = {p.name: inputs.get(p.name) for p in params}
    args["input_ids"] = x
    out = make(**args)
    positions = out[0] if isinstance(out, tuple) else out
    if positions is None:
        return torch.arange(x.shape[1]).expand(3, x.shape[0], -1)
    return positions


def stage_inputs(part: nn.Module, first: bool, kwargs: dict, inputs: dict) -> tuple:
    """(the model's keyword arguments for this micro-batch, the blank image's inputs to run
    the tower on, or None) on ``part``."""
    inputs = dict(inputs)
    rows = inputs.pop(ROWS)
    positions = inputs.pop(POSITIONS, None)
    if positions is not None:
        kwargs["position_ids"] = positions.movedim(0, 1)
    kwargs.update(inputs)
    if not first:
        return kwargs, None
    images = part._pipeline_images.inputs(rows)
    if images.get(BLANK_IMAGE):
        return kwargs, {k: v for k, v in images.items() if k != BLANK_IMAGE}
    kwargs.update(images)
    return kwargs, None


def add_tower_for_nothing(part: nn.Module, hidden: torch.Tensor, blank: dict) -> torch.Tensor:
    """``hidden`` plus zero times the tower's features of ``blank`` (a blank image)."""
    from automodel.models.image_inputs import image_features_fn

    features_of = image_features_fn(part)
    takes = set(inspect.signature(features_of).parameters)
    features = features_of(**{k: v for k, v in blank.items() if k in takes})
    zero = sum(t.sum() for t in tensor_leaves(features)
               if isinstance(t, torch.Tensor) and t.is_floating_point()) * 0
    if isinstance(hidden, DTensor):
        zero = DTensor.from_local(zero.to_local() if isinstance(zero, DTensor) else zero,
                                  hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim,
                                  run_check=False)
    return hidden + zero.to(hidden.dtype)


def check_first_stage(model: nn.Module, layers: int) -> None:
    """Raise ``ValueError`` when image features the model adds inside its language layers
    (Qwen3-VL's deepstack: after each of its first layers) would reach a layer outside the
    first stage (``layers``: how many it holds), where no image is."""
    from automodel.models.multimodal import adds_features_inside_layers

    if not adds_features_inside_layers(model):
        return
    depth = getattr(model.config.vision_config, "deepstack_visual_indexes", None)
    if depth is None:
        raise ValueError(f"{type(model).__name__} adds image features inside its language "
                         "layers, to a depth its config does not give: a pipeline cannot "
                         "keep them on its first stage; use mesh.pp_size=1")
    if layers <= len(depth):
        raise ValueError(
            f"{type(model).__name__} adds image features after each of its first {len(depth)} "
            f"language layers (vision_config.deepstack_visual_indexes), which the first "
            f"pipeline stage must hold with the next one; it holds {layers}: give it at least "
            f"{len(depth) + 1} (pipeline.module_fqns_per_model_part or layers_per_stage)")
