"""Inputs and outputs of a torch module: named flat tensors in, a JSON tree out.

The exported ONNX graph takes and returns flat lists of tensors. This module names a
call's inputs after ``forward``'s parameters and records the nesting of its outputs
(tensors inside tuples, lists, dicts, dataclasses such as ``transformers`` ModelOutputs,
named tuples) as a JSON-ready tree, so that the converted module can rebuild the same
structure, even after :func:`mixprec.torch.load` in a process that lacks the classes.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mixprec.core.errors import MixprecError

__all__ = [
    "bind_inputs",
    "flatten_outputs",
    "leaf_paths",
    "register_dataclasses",
    "unflatten_outputs",
]

Tree = dict[str, Any]
_CONSTANTS = (bool, int, float, str, type(None))


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise MixprecError(
            f"input {name!r} is a {type(value).__name__}, not a torch.Tensor: only tensor "
            "inputs can be exported; bind other arguments in a wrapper module "
            "(e.g. functools.partial or a small nn.Module around the model)",
            stage="export",
        )
    return value


def bind_inputs(
    forward: Callable[..., Any], args: Sequence[object], kwargs: Mapping[str, object]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` per input, positional first, then keyword in the given order.

    Names are ``forward``'s parameter names (what the dynamo exporter calls the graph
    inputs); ``*args`` elements are named ``args_0``, ``args_1``, ...

    Raises:
        MixprecError: an argument is not a tensor, or does not fit the signature.
    """
    names: list[str] = []
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for param in params:
        if len(names) >= len(args):
            break
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            names.extend(f"{param.name}_{i}" for i in range(len(args) - len(names)))
        elif param.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(param.name)
    if params:
        try:
            inspect.signature(forward).bind(*args, **kwargs)
        except TypeError as exc:
            raise MixprecError(f"example inputs do not fit forward(): {exc}") from None
    names.extend(f"input_{i}" for i in range(len(names), len(args)))
    names.extend(kwargs)
    values = [*args, *kwargs.values()]
    return [(name, _check_tensor(name, value)) for name, value in zip(names, values, strict=True)]


def flatten_outputs(value: object) -> tuple[list[torch.Tensor], Tree]:
    """The tensors of a nested output, depth first, and the tree that rebuilds it.

    Raises:
        MixprecError: the output holds something that is neither a tensor, a container
            of them, nor a JSON constant (int, float, bool, str, None).
    """
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(value, leaves, "output")


def _class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _flatten(value: object, leaves: list[torch.Tensor], where: str) -> Tree:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return {"kind": "tensor"}
    if isinstance(value, _CONSTANTS):
        return {"kind": "constant", "value": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # ModelOutput is a dataclass and a dict: its fields that are None are not items.
        keys = [f.name for f in dataclasses.fields(value)]
        items = [getattr(value, k) for k in keys]
        children = [_flatten(v, leaves, f"{where}.{k}") for k, v in zip(keys, items, strict=True)]
        return {"kind": "dataclass", "class": _class_path(value), "keys": keys, "items": children}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        keys = list(value._fields)
        children = [_flatten(v, leaves, f"{where}.{k}") for k, v in zip(keys, value, strict=True)]
        return {"kind": "namedtuple", "class": _class_path(value), "keys": keys, "items": children}
    if isinstance(value, tuple | list):
        children = [_flatten(v, leaves, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"kind": type(value).__name__, "items": children}
    if isinstance(value, Mapping):
        keys = list(value)
        if not all(isinstance(k, str | int) for k in keys):
            raise MixprecError(f"{where}: dict keys must be str or int, got {keys!r}")
        children = [_flatten(value[k], leaves, f"{where}[{k!r}]") for k in keys]
        return {"kind": "dict", "keys": keys, "items": children}
    raise MixprecError(
        f"{where} is a {type(value).__name__}: outputs must be tensors, tuples, lists, dicts "
        "or dataclasses of them, or constants",
        stage="export",
    )


def register_dataclasses(value: object) -> list[str]:
    """Register the dataclass types in an output with torch's pytree, for torch.export.

    torch.export flattens outputs with ``torch.utils._pytree`` and refuses a dataclass it
    does not know (transformers registers its ModelOutputs; user classes usually are
    not). Returns the classes registered.
    """
    from torch.utils import _pytree

    done: list[str] = []

    def walk(v: object) -> None:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            cls = type(v)
            if cls not in _pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(cls, serialized_type_name=_class_path(v))
                done.append(_class_path(v))
            children: Any = [getattr(v, f.name) for f in dataclasses.fields(v)]
        elif isinstance(v, Mapping):
            children = list(v.values())
        elif isinstance(v, tuple | list):
            children = list(v)
        else:
            return
        for child in children:
            walk(child)

    walk(value)
    return done


def _import_class(path: str) -> type | None:
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


def unflatten_outputs(tree: Tree, leaves: Sequence[torch.Tensor]) -> object:
    """Rebuild the structure ``tree`` describes from the flat ``leaves``.

    Dataclasses and named tuples are rebuilt as their class when it can be imported, as a
    dict (dataclass) or tuple (named tuple) otherwise.
    """
    it = iter(leaves)
    out = _unflatten(tree, it)
    if next(it, None) is not None:
        raise MixprecError("more output tensors than the recorded output structure holds")
    return out


def _unflatten(tree: Tree, it: Any) -> object:
    kind = tree["kind"]
    if kind == "tensor":
        try:
            return next(it)
        except StopIteration:
            raise MixprecError("fewer output tensors than the output structure holds") from None
    if kind == "constant":
        return tree["value"]
    children = [_unflatten(child, it) for child in tree["items"]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        return dict(zip(tree["keys"], children, strict=True))
    cls = _import_class(tree["class"])
    fields = dict(zip(tree["keys"], children, strict=True))
    if kind not in ("namedtuple", "dataclass"):
        raise MixprecError(f"unknown output tree node {kind!r}")
    if cls is not None:
        try:
            return cls(**fields)
        except TypeError:  # a class whose constructor does not take its fields
            pass
    return tuple(children) if kind == "namedtuple" else fields


def leaf_paths(tree: Tree, prefix: str = "output") -> list[str]:
    """A readable path per tensor leaf, in flattening order: ``output['logits']``, ..."""
    kind = tree["kind"]
    if kind == "tensor":
        return [prefix]
    if kind == "constant":
        return []
    if kind in ("tuple", "list"):
        keys: list[Any] = list(range(len(tree["items"])))
    else:
        keys = tree["keys"]
    paths: list[str] = []
    for key, child in zip(keys, tree["items"], strict=True):
        step = f".{key}" if kind in ("dataclass", "namedtuple") else f"[{key!r}]"
        paths.extend(leaf_paths(child, prefix + step))
    return paths
