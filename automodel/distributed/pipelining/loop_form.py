"""How a base model's loop takes what its decoder layers return, read from the loop's source.

A pipeline stage passes other stages' layers through (``split._PassThrough``). What a
pass-through returns must fit the loop that called it: ``hidden_states = layer(...)`` takes a
tensor, ``hidden_states, attn = layer(...)`` takes a pair, ``out = layer(...)`` followed by
``out[0]`` takes a sequence. After a stage's first own layer has run, the stage knows the form
from that call; before it (every stage but the first meets the earlier stages' layers first)
the form comes from here: the statement in the stack's ``forward`` that calls the loop
variable over ``self.<layers>``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def loop_output_form(stack_cls: type, layers_attr: str):
    """``(found, form)``; ``form`` is what a pass-through returns: None (the hidden states
    themselves) or (tuple, length) with the hidden states first. ``found`` is False where
    the source does not show it (no source, no loop over ``self.<layers_attr>``, the layer
    called in a form this does not read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(stack_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False, None
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and _iterates(loop.iter, layers_attr):
            var = _layer_variable(loop.target, loop.iter)
            if var is not None:
                return _form_of_call(loop, var)
    return False, None


def _iterates(node: ast.AST, attr: str) -> bool:
    """The loop runs over ``self.<attr>`` (directly, sliced, under ``enumerate``/``zip``)."""
    return any(isinstance(n, ast.Attribute) and n.attr == attr
               and isinstance(n.value, ast.Name) and n.value.id == "self"
               for n in ast.walk(node))


def _layer_variable(target: ast.AST, it: ast.AST) -> str | None:
    """The loop variable that holds the layer: the target itself, or its last element under
    ``enumerate`` (``for i, layer in enumerate(self.layers)``)."""
    if isinstance(target, ast.Name):
        return target.id
    if (isinstance(target, ast.Tuple) and isinstance(it, ast.Call)
            and getattr(it.func, "id", None) == "enumerate" and len(target.elts) == 2
            and isinstance(target.elts[1], ast.Name)):
        return target.elts[1].id
    return None


def _form_of_call(loop: ast.For, var: str):
    for stmt in ast.walk(loop):
        value = getattr(stmt, "value", None)
        if not (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name) and value.func.id == var):
            continue
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        if isinstance(target, ast.Tuple):  # ``hidden_states, attn = layer(...)``
            return True, (tuple, len(target.elts))
        if isinstance(target, ast.Name):
            indices = _constant_indices(loop, target.id)
            return True, ((tuple, max(indices) + 1) if indices else None)
        return False, None
    return False, None


def _constant_indices(loop: ast.For, name: str) -> list[int]:
    """The constant indices ``name[i]`` reads in the loop's body."""
    return [n.slice.value for n in ast.walk(loop)
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
            and n.value.id == name and isinstance(n.slice, ast.Constant)
            and isinstance(n.slice.value, int)]
