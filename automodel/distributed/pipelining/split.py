"""Split a Hugging Face causal LM into pipeline stages.

Each stage is a pruned copy of the whole model. Where the parts are comes from the model
(``automodel.models.anatomy``: ``base_model_pp_plan`` or a search): the embedding lives on the
first stage, the final norm and LM head on the last, and each stage keeps its decoder layers
under their original indices, so parameter names map 1:1 to the unsplit model's. With tied
input/output embeddings the last stage keeps the embedding module too (the same parameter as
its LM head), so both stages hold the weight under the same name; ``tied.py`` keeps the two
copies equal.

A stage runs the model's own forward: the base model computes masks and positions as it
always does and iterates over all its layers, where layers of other stages pass their input
through. A stage that does not start the model feeds its received hidden states into its
first layer (whatever the base model made of its placeholder input before that layer is
dropped, so embedding scales and dropouts are applied once, on the first stage), and every
stage but the last returns its last layer's output.
"""

from __future__ import annotations

import copy
import re
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from automodel.compat import child_module, input_embeddings, map_tensors, tensor_leaves
from automodel.config.pipeline_layout import stage_layer_ranges
from automodel.distributed.pipelining.loop_form import loop_output_form
from automodel.distributed.pipelining.stage_images import add_tower_for_nothing, stage_inputs
from automodel.models.anatomy import Anatomy


# ----------------------------------------------------------------------------- the layer list
class _PassThrough:
    """A layer of another stage: returns its hidden-state input, in the form this stage's
    own layers return theirs (older layers return a tuple or list, hidden states first, and
    the loop takes ``outputs[0]``); answers the simple attributes the original layer had
    (e.g. ``attention_type``), which a base model's loop may read."""

    def __init__(self, attrs: dict, stage_layers: "StageLayers"):
        self._attrs = attrs
        self._stage_layers = stage_layers

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        form = self._stage_layers.output_form
        if form is None:
            return x
        kind, length = form  # (the other outputs, e.g. attention weights: none here)
        return kind((x,) + (None,) * (length - 1))

    def __getattr__(self, name):
        try:
            return self.__dict__["_attrs"][name]
        except KeyError:
            raise AttributeError(name) from None


class PipelineSplitError(ValueError):
    """The model's forward does something a pipeline split cannot reproduce."""


class _OwnedCall:
    """A layer of this stage as the base model's loop sees it: the first one may take the
    stage's input, the last one records the stage's output."""

    def __init__(self, stage_layers: "StageLayers", index: int):
        self._stage_layers = stage_layers
        self._index = index

    def __call__(self, *args, **kwargs):
        sl = self._stage_layers
        layer = child_module(sl, str(self._index))
        if self._index in sl.ran:
            raise PipelineSplitError(
                f"the forward of the model runs its decoder layer {self._index} more than once "
                "in one pass (a recurrent section of layers): a pipeline stage runs each of its "
                "layers once, in order; train this model without a pipeline (pipeline=none)")
        sl.ran.add(self._index)
        if self._index == sl.first and sl.stage_input is not None:
            x, sl.stage_input = sl.stage_input, None
            if args:
                args = (x,) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, hidden_states=x)
        out = layer(*args, **kwargs)
        sequence = isinstance(out, (tuple, list))  # (older layers: hidden states first)
        sl.output_form = ((list if isinstance(out, list) else tuple, len(out)) if sequence
                          else None)
        if self._index == sl.last:
            sl.stage_output = out[0] if sequence else out
        return out

    def __getattr__(self, name):
        return getattr(child_module(self._stage_layers, str(self._index)), name)


def _simple_attrs(layer: nn.Module) -> dict:
    return {k: v for k, v in vars(layer).items()
            if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))}


class StageLayers(nn.Module):
    """This stage's decoder layers under their original indices, standing in for the whole
    layer list (length and order of the unsplit model's)."""

    def __init__(self, layers: nn.ModuleList, owned: list[int], form: tuple | None = None):
        super().__init__()
        self.total = len(layers)
        for i in owned:
            self.add_module(str(i), layers[i])
        self.first, self.last = owned[0], owned[-1]
        self._others = {i: _PassThrough(_simple_attrs(layers[i]), self)
                        for i in range(self.total) if i not in owned}
        # how the layers return (None: a tensor; else (tuple or list, length)): at first as
        # the base model's loop takes it (``loop_form``), then as the owned layers return it
        self.output_form: tuple | None = form
        self.ran: set = set()  # the owned layers run in this pass (``_stage_forward`` resets)
        self.stage_input: torch.Tensor | None = None
        self.stage_output: torch.Tensor | None = None

    def _entry(self, i: int):
        return self._others[i] if i in self._others else _OwnedCall(self, i)

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        return (self._entry(i) for i in range(self.total))

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self._entry(i) for i in range(self.total)[idx]]
        return self._entry(range(self.total)[idx])


# ----------------------------------------------------------------------------- the forward
@dataclass
class StageRole:
    anatomy: Anatomy
    first: bool  # holds the embedding: takes token ids
    last: bool  # holds the final norm and LM head: returns logits
    # global positions of a stage input's tokens, from its local length (None: 0..L-1;
    # context parallelism sets its own)
    positions: Optional[Callable] = None
    # the router loss under a pipeline (``recipes/router_loss.py``): (router logits, batch)
    # -> this stage's routing sums, added to the received ones and passed on
    router_stats: Optional[Callable] = None


def _stage_forward(self, x: torch.Tensor, carried: torch.Tensor | None = None, **inputs):
    """Token ids (first stage) or hidden states in; hidden states or logits (last) out.
    With ``role.router_stats`` each stage also returns the routing sums of the layers so far
    (``carried``: the previous stages'). ``inputs``: an image-text model's per-micro-batch
    inputs (``stage_images.py``)."""
    role: StageRole = self._pipeline_role
    base = getattr(self, role.anatomy.base)
    layers = getattr(self.get_submodule(role.anatomy.stack), role.anatomy.layers)
    positions = (role.positions(x.shape[1], x.device) if role.positions is not None
                 else torch.arange(x.shape[1], device=x.device))
    kwargs = dict(position_ids=positions.unsqueeze(0), use_cache=False)
    if role.first:
        kwargs["input_ids"] = x
    else:  # (a residual of several streams, [batch, seq, streams, hidden] (GLM-5-Next's
        # hyper-connections), is made from [batch, seq, hidden] embeddings: zeros of that shape
        # stand in, and the layers take the received streams)
        kwargs["inputs_embeds"] = x if x.dim() <= 3 else x.new_zeros(x.shape[:2] + x.shape[-1:])
        if isinstance(layers, StageLayers):
            layers.stage_input = x
    if isinstance(layers, StageLayers):
        layers.ran = set()
    if role.router_stats is not None:  # the model's own record of its routers' logits
        kwargs["output_router_logits"] = True
    blank = None
    if inputs:
        kwargs, blank = stage_inputs(self, role.first, kwargs, inputs)
    if role.last:
        out = type(self).forward(self, **kwargs)
        return _with_router_sums(out.logits, out, role, x.shape[0], carried)
    out = base(**kwargs)
    hidden = out[0]
    if isinstance(layers, StageLayers):
        hidden, layers.stage_output = layers.stage_output, None
    # a stage must return a fresh tensor, never a view of its input (zero-bubble schedules
    # detach outputs in place)
    hidden = hidden if hidden._base is None and hidden is not x else hidden.clone()
    if blank is not None:  # (a micro-batch without images: the tower runs all the same)
        hidden = add_tower_for_nothing(self, hidden, blank)
    return _with_router_sums(hidden, out, role, x.shape[0], carried)


def _with_router_sums(y: torch.Tensor, out, role: StageRole, batch: int, carried):
    """``y``, or (``y``, the routing sums of this stage's layers and the previous ones')."""
    if role.router_stats is None:
        return y
    sums = role.router_stats(out.router_logits, batch)
    return y, sums if carried is None else carried + sums


# ----------------------------------------------------------------------------- contents
@dataclass
class StageContents:
    layers: list  # original decoder-layer indices, in order
    embed: bool  # the token embedding (first stage)
    head: bool  # the final norm and LM head (last stage)


def even_contents(num_layers: int, num_stages: int, layers_per_stage: int | None) -> list:
    ranges = stage_layer_ranges(num_layers, num_stages, layers_per_stage)
    return [StageContents(list(r), i == 0, i == num_stages - 1) for i, r in enumerate(ranges)]


def contents_from_fqns(model: nn.Module, anatomy: Anatomy, fqns_per_part: list) -> list:
    """``pipeline.module_fqns_per_model_part`` -> stage contents, checked against the model.
    The modules before the layers go with the embedding (first part), those after with the
    head (last part); naming them is allowed, not needed."""
    stack = model.get_submodule(anatomy.stack)
    num_layers = anatomy.num_layers
    starts = {anatomy.fqn(n) for n in (anatomy.embed, *anatomy.before)} | set(anatomy.front)
    ends = {anatomy.head} | {anatomy.fqn(n) for n in anatomy.after}
    passive = {anatomy.fqn(n) for n, m in stack.named_children()
               if not any(True for _ in m.parameters())}
    layer_fqn = re.compile(rf"^{re.escape(anatomy.fqn(anatomy.layers))}\.(\d+)$")
    allowed = ", ".join([*sorted(starts), f"{anatomy.fqn(anatomy.layers)}.<0..{num_layers - 1}>",
                         *sorted(ends)])
    contents, seen = [], []
    for i, fqns in enumerate(fqns_per_part):
        stage = StageContents([], False, False)
        for fqn in fqns:
            m = layer_fqn.match(fqn)
            if m and int(m.group(1)) < num_layers:
                stage.layers.append(int(m.group(1)))
            elif fqn in starts:
                stage.embed = True
            elif fqn in ends:
                stage.head = True
            elif fqn not in passive:
                raise ValueError(f"pipeline.module_fqns_per_model_part[{i}] names {fqn!r}, which "
                                 f"is not a part of {type(model).__name__} that can be placed "
                                 f"(allowed: {allowed})")
        seen += stage.layers
        contents.append(stage)
    if sorted(seen) != list(range(num_layers)) or seen != sorted(seen):
        raise ValueError("pipeline.module_fqns_per_model_part must place every decoder layer "
                         f"exactly once and in order; it places {seen}")
    if any(not c.layers for c in contents):
        raise ValueError("pipeline.module_fqns_per_model_part: every part needs at least one "
                         "decoder layer")
    if not contents[0].embed or any(c.embed for c in contents[1:]):
        raise ValueError(f"pipeline.module_fqns_per_model_part: {' and '.join(sorted(starts))} "
                         "belong to the first part")
    if not contents[-1].head or any(c.head for c in contents[:-1]):
        raise ValueError(f"pipeline.module_fqns_per_model_part: {' and '.join(sorted(ends))} "
                         "belong to the last part")
    return contents


def ties_embeddings(model: nn.Module) -> bool:
    """The input embedding and the LM head share one weight."""
    inp, out = input_embeddings(model), model.get_output_embeddings()
    return inp is not None and out is not None and out.weight is inp.weight


def build_stage(model: nn.Module, anatomy: Anatomy, contents: StageContents,
                patch_inner: bool = True, patch_causal_lm: bool = True) -> nn.Module:
    """A pruned deep copy of ``model`` holding only ``contents``. On a stage that does not
    start the model, the modules that run before the layers are stand-ins (``StandIn``: the
    stage's input replaces what they make); on one that does not end it, those after the
    layers are identities (the stage returns its last layer's output)."""
    tied = ties_embeddings(model)
    # buffers the build computed on the host (rotary frequencies, embedding scales) are shared,
    # not copied: alike on every stage, and each part gets its own at materialization
    # (``to_empty``); so the copy allocates nothing, also under the planner's fake mode
    stage = copy.deepcopy(model, memo=_host_buffers(model))
    stack = stage.get_submodule(anatomy.stack)
    layers = getattr(stack, anatomy.layers)
    if patch_inner:
        _, form = loop_output_form(type(stack), anatomy.layers)
        setattr(stack, anatomy.layers, StageLayers(layers, contents.layers, form))
    else:  # the model's own forward copes with a pruned list (original keys kept)
        setattr(stack, anatomy.layers, nn.ModuleDict({str(i): layers[i] for i in contents.layers}))
    if not contents.embed:
        if not (tied and contents.head):
            setattr(stack, anatomy.embed, None)  # later stages pass inputs_embeds
        for name in anatomy.before:
            setattr(stack, name, StandIn(getattr(stack, name)))
        for fqn in anatomy.front:  # (an image-text model's tower: the first stage's)
            parent, _, name = fqn.rpartition(".")
            setattr(stage.get_submodule(parent), name, None)
    if not contents.head:
        for name in anatomy.after:
            setattr(stack, name, nn.Identity())
        setattr(stage, anatomy.head, None)
    if patch_causal_lm:
        stage._pipeline_role = StageRole(anatomy, contents.embed, contents.head)
        stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def _host_buffers(module: nn.Module) -> dict:
    """A deep copy's memo that shares ``module``'s buffers on the host instead of copying."""
    return {id(b): b for b in module.buffers() if not b.is_meta}


class StandIn(nn.Module):
    """A module of the first stage (learned positions, an embedding norm) on a later stage:
    no parameters; returns zeros of the shape the module would return, computed by a copy of
    it on the meta device. The base model's forward still runs it on its placeholder input;
    the stage's received hidden states then replace the result (``StageLayers``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        shape_of = copy.deepcopy(module, memo=_host_buffers(module))
        if any(not p.is_meta for p in shape_of.parameters()):  # (a model built on the host)
            shape_of = shape_of.to("meta")
        self.__dict__["_shape_of"] = shape_of  # (not a submodule: no parameters here)
        self.replaces = type(module).__name__

    def forward(self, *args, **kwargs):
        device = next((t.device for t in tensor_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)), torch.device("cpu"))
        args, kwargs = map_tensors(lambda t: t.to("meta"), (args, kwargs))
        out = self._shape_of(*args, **kwargs)
        return map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out)

    def extra_repr(self) -> str:
        return f"stands in for {self.replaces}"
