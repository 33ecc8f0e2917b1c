"""``mixprec.torch.autocast``: PyTorch training (and eager inference) under mixprec's four
lists, with the same op names, user changes and exclusions as the converter.

A ``TorchFunctionMode`` sees each call of a torch function once, above autograd, so the
casts it inserts are differentiable and parameters stay float32 master weights. For each
function that the registry's torch table (:mod:`mixprec.core.torch_ops`) maps onto an ONNX
op type:

* ALLOW: float32 tensor arguments are cast to the low dtype;
* DENY: low tensor arguments are cast to float32 (so are training's float32 functions that
  have no ONNX op type);
* INFER and CLEAR: the call follows its inputs: all low stays low, all float32 stays
  float32, a mix runs in float32;
* inside an excluded submodule's ``forward``: float32, whatever the list.

What differs from the ONNX painter: decisions are made per call at run time, from the
dtypes that arrive, not over a graph. DENY still spreads downstream, through the data:
an INFER/CLEAR op fed by a float32 DENY output runs in float32 until an ALLOW op casts
down again; but nothing spreads upstream, the range-based rules (a wide Softmax axis, a
long reduction) are replaced by training's defaults (softmax, norms, exp/log/pow and
reductions in float32), and Python composites that the table does not name run as one
call in the dtype their inputs arrive in (except the composites of
:data:`~mixprec.core.torch_ops.TORCH_OP_BY_OP`, run op by op when asked). Functions the
table does not name are passed through untouched (not counted).

Nested entries: each torch call is decided (and counted) once, by the innermost entry,
as with ``torch.autocast``: the same object entered twice (a decorated function called
inside its own ``with``) counts a call once, and an inner autocast object's lists win
over an outer one's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FunctionType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.core.errors import MixprecError
from mixprec.core.ops import parse_dtype
from mixprec.core.policy import OpClass, Policy, default_policy
from mixprec.core.torch_ops import (
    TORCH_FUNCTIONS,
    TORCH_OP_BY_OP,
    TRAINING_ALLOW,
    TRAINING_DENY,
    TRAINING_FP32_FUNCTIONS,
)
from mixprec.torch._amp_report import AmpReport

__all__ = ["autocast", "training_policy"]

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_LISTS = {
    "allow": OpClass.ALLOW,
    "deny": OpClass.DENY,
    "infer": OpClass.INFER,
    "clear": OpClass.CLEAR,
}
_FP32 = "float32 in training"


def _resolve(dotted: str) -> Any:
    """The object a dotted name names (``torch.Tensor.add``), or None when this torch
    has no such function."""
    module, _, rest = dotted.partition(".")
    obj: Any = importlib.import_module(module)
    for part in rest.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _table() -> dict[Any, tuple[str, str]]:
    """Function object -> (op type, dotted name), for every name this torch has."""
    found: dict[Any, tuple[str, str]] = {}
    for op, names in TORCH_FUNCTIONS.items():
        for name in names:
            func = _resolve(name)
            if func is not None:
                found.setdefault(func, (op, name))
    for name in TRAINING_FP32_FUNCTIONS:
        func = _resolve(name)
        if func is not None:
            found.setdefault(func, ("", name))
    return found


_TABLE: dict[Any, tuple[str, str]] | None = None


def training_policy(dtype: str) -> Policy:
    """The converter's default lists for ``dtype`` with training's moves
    (:data:`~mixprec.core.torch_ops.TRAINING_DENY`, ``TRAINING_ALLOW``)."""
    base = default_policy(dtype)
    return base.with_changes(add={OpClass.DENY: TRAINING_DENY, OpClass.ALLOW: TRAINING_ALLOW})


def _changes(options: Mapping[str, Iterable[str]]) -> tuple[dict, dict]:
    """``allow_add=...`` style options as (add, remove) by list, names checked."""
    known = sorted(TORCH_FUNCTIONS)
    add: dict[OpClass, list[str]] = {}
    remove: dict[OpClass, list[str]] = {}
    for key, names in options.items():
        lst, _, kind = key.partition("_")
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in TORCH_FUNCTIONS:
                raise MixprecError(
                    f"{key}: {name!r} names no op of the torch table; known: {', '.join(known)}"
                )
        (add if kind == "add" else remove)[_LISTS[lst]] = names
    return add, remove


#: ``busy``: a mixprec mode is deciding a call on this thread. The call it makes then
#: reaches the modes below it (outer entries): they pass it on untouched, so that each
#: call is decided and counted once, by the innermost entry.
_STATE = threading.local()


class _Mode(TorchFunctionMode):
    def __init__(self, amp: autocast) -> None:
        super().__init__()
        self.amp = amp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "busy", False):
            return func(*args, **kwargs)
        _STATE.busy = True
        try:
            entry = self.amp.entries.get(func)
            if entry is None:
                return func(*args, **kwargs)
            return self.amp.run_call(entry, func, args, kwargs)
        finally:
            _STATE.busy = False


@functools.cache
def _arg_index(func: Any, arg: str) -> int:
    return list(inspect.signature(func).parameters).index(arg)


def _asked(func: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the call asks for :data:`TORCH_OP_BY_OP`'s argument of ``name``."""
    arg, default = TORCH_OP_BY_OP[name]
    if arg in kwargs:
        return bool(kwargs[arg])
    index = _arg_index(func, arg)
    return bool(args[index]) if index < len(args) else default


@functools.cache
def _unguarded(func: Any) -> Any:
    """A copy of the Python function ``func`` whose own ``has_torch_function`` check
    answers False, so that its body runs under the mode that called it and the mode
    sees its inner calls one by one; None when ``func`` has no such check."""
    code = getattr(func, "__code__", None)
    if code is None or "has_torch_function" not in code.co_names:
        return None
    scope = dict(func.__globals__, has_torch_function=lambda *_: False)
    copy = FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _op_by_op(amp: autocast, body: Any, args: Any, kwargs: Any) -> Any:
    """``body`` run with a fresh mode of ``amp`` deciding each of its inner calls."""
    _STATE.busy = False
    try:
        with _Mode(amp):
            return body(*args, **kwargs)
    finally:
        _STATE.busy = True


def _cast_all(value: Any, src: Callable[[torch.dtype], bool], dst: torch.dtype) -> Any:
    """``value`` (a tensor, or a list/tuple of them) with its floating tensors whose
    dtype ``src`` accepts cast to ``dst``."""
    if isinstance(value, torch.Tensor):
        return value.to(dst) if src(value.dtype) else value
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_cast_all(v, src, dst) for v in value)
    return value


#: Norms take a low input with float32 weights and statistics as they are (PyTorch
#: computes them in float32 and updates the running statistics in place).
_NORMS = frozenset(
    {"BatchNormalization", "LayerNormalization", "GroupNormalization", "InstanceNormalization"}
)


def _float_dtypes(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, activations: bool = False
) -> set[torch.dtype]:
    """The floating dtypes among the tensor arguments (with ``activations``: parameters
    left out, as the painter decides on activations and converts weights along)."""
    found = set()
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            if (
                isinstance(item, torch.Tensor)
                and item.is_floating_point()
                and not (activations and isinstance(item, torch.nn.Parameter))
            ):
                found.add(item.dtype)
    return found


def _is_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def _up(args: Sequence[Any], kwargs: Mapping[str, Any], low: torch.dtype) -> tuple[Any, Any]:
    """The arguments with their ``low`` floating tensors cast to float32."""

    def is_low(d: torch.dtype) -> bool:
        return d == low

    return (
        tuple(_cast_all(a, is_low, torch.float32) for a in args),
        {k: _cast_all(v, is_low, torch.float32) for k, v in kwargs.items()},
    )


def _low_params(value: Any, low: torch.dtype) -> Any:
    if isinstance(value, torch.nn.Parameter) and value.dtype == torch.float32:
        return value.to(low)
    return value


def _out_dtype(out: Any) -> str:
    first = out[0] if isinstance(out, list | tuple) and out else out
    return str(first.dtype).replace("torch.", "") if isinstance(first, torch.Tensor) else "-"


class autocast(contextlib.ContextDecorator):
    """Run the code inside under mixprec's lists (a context manager and a decorator).

    Args:
        dtype: "bf16" or "fp16" (any spelling mixprec accepts).
        module: the model; needed for ``exclude`` and for per-module counts.
        exclude: regexes over ``module.named_modules()`` names (``re.search``): every
            call made inside a matching submodule's ``forward`` runs in float32.
        force_all: every mapped op in the low dtype (losses included; unsafe).
        log_dir: write ``amp_report.json`` / ``.txt`` there when each ``with`` ends.
        **list_changes: ``allow_add`` ... ``clear_remove``: op types (the names of
            ``mixprec lists``) moved between the lists, as in :func:`mixprec.convert`; a
            name the torch table does not map is an error that lists the known ones.

    Example:
        >>> with mixprec.torch.autocast("bf16", module=model, exclude=[r"^head"]) as amp:
        ...     loss = loss_fn(model(x), y)                                # doctest: +SKIP
        >>> loss.backward()                                                # doctest: +SKIP
        >>> print(amp.report.format_table())                               # doctest: +SKIP
    """

    def __init__(
        self,
        dtype: str = "bf16",
        *,
        module: torch.nn.Module | None = None,
        exclude: Sequence[str] = (),
        force_all: bool = False,
        log_dir: str | None = None,
        **list_changes: Iterable[str],
    ) -> None:
        unknown = sorted(
            set(list_changes) - {f"{n}_{k}" for n in _LISTS for k in ("add", "remove")}
        )
        if unknown:
            raise TypeError(f"autocast() got unexpected keyword argument(s) {', '.join(unknown)}")
        target = parse_dtype(dtype, ("float16", "bfloat16"), what="autocast dtype")
        if exclude and module is None:
            raise MixprecError("autocast(exclude=...) needs module=: the names are its submodules'")
        self.low = _LOW[target]
        add, remove = _changes(list_changes)
        self.changes = {k: list(v) for k, v in list_changes.items()}
        self.policy = training_policy(target).with_changes(add, remove, force_all=force_all)
        self.module = module
        self.exclude = tuple(re.compile(p) for p in exclude)
        self.log_dir = log_dir
        self.report = AmpReport(target=target, policy=self.policy.to_dict())
        self.entries = self._entries()
        self._names: dict[int, tuple[str, bool]] = {}
        self._stack: list[str] = []
        self._excluded_depth = 0
        self._hooks: list[Any] = []
        self._modes: list[_Mode] = []

    def _entries(self) -> dict[Any, tuple[str, str, str, str]]:
        """Function -> (op, dotted name, list, kind): kind "low", "fp32" or "follow"."""
        global _TABLE
        if _TABLE is None:
            _TABLE = _table()
        entries = {}
        for func, (op, name) in _TABLE.items():
            if not op:
                kind, lst = ("low", "-") if self.policy.force_all else ("fp32", _FP32)
            else:
                cls = self.policy.op_class(op)
                lst = cls.value
                if self.policy.force_all or cls is OpClass.ALLOW:
                    kind = "low"
                elif cls is OpClass.DENY:
                    kind = "fp32"
                else:
                    kind = "follow"
            entries[func] = (op or name.rsplit(".", 1)[-1], name, lst, kind)
        return entries

    def run_call(self, entry: tuple[str, str, str, str], func: Any, args: Any, kwargs: Any) -> Any:
        op, name, lst, kind = entry
        rule = "force_all" if self.policy.force_all and kind == "low" else lst
        if self._excluded_depth:
            kind, rule = "fp32", "exclude"
        if name in TORCH_OP_BY_OP and _asked(func, name, args, kwargs):
            body = _unguarded(func)
            if body is not None:
                out = _op_by_op(self, body, args, kwargs)
                return self._count(op, name, lst, f"{TORCH_OP_BY_OP[name][0]}: op by op", out)
            kind, rule = "fp32", f"{TORCH_OP_BY_OP[name][0]} -> float32"
        low = self.low
        if kind == "low":
            args = tuple(_cast_all(a, _is_fp32, low) for a in args)
            kwargs = {k: _cast_all(v, _is_fp32, low) for k, v in kwargs.items()}
        elif kind == "fp32":
            args, kwargs = _up(args, kwargs, low)
        elif op not in _NORMS:  # follow the activations (a norm: as it comes)
            seen = _float_dtypes(args, kwargs, activations=True)
            if len(seen) > 1:
                args, kwargs = _up(args, kwargs, low)
                rule = f"{lst}: mixed inputs -> float32"
            elif low in seen:
                args = tuple(_low_params(a, low) for a in args)  # e.g. PReLU's weight
        return self._count(op, name, lst, rule, func(*args, **kwargs))

    def _count(self, op: str, name: str, lst: str, rule: str, out: Any) -> Any:
        where = self._stack[-1] if self._stack else ""
        self.report.counts[(op, name, where, _out_dtype(out), lst, rule)] += 1
        return out

    # --- modules: the innermost running one, and the exclusions ---------------------

    def _module_names(self) -> dict[int, tuple[str, bool]]:
        """id(submodule) -> (qualified name, excluded), once."""
        assert self.module is not None
        names = {}
        for name, sub in self.module.named_modules():
            excluded = bool(name) and any(p.search(name) for p in self.exclude)
            if excluded and name not in self.report.excluded:
                self.report.excluded.append(name)
            names[id(sub)] = (name, excluded)
        return names

    def _hook_modules(self) -> None:
        """Two global module hooks (cheaper than two per submodule on every entry)."""
        if not self._names:
            self._names = self._module_names()
        hooks = torch.nn.modules.module
        self._hooks.append(hooks.register_module_forward_pre_hook(self._enter_module))
        self._hooks.append(hooks.register_module_forward_hook(self._leave_module))

    def _enter_module(self, module: torch.nn.Module, *_: Any) -> None:
        info = self._names.get(id(module))
        if info is not None:
            self._stack.append(info[0])
            self._excluded_depth += info[1]

    def _leave_module(self, module: torch.nn.Module, *_: Any) -> None:
        info = self._names.get(id(module))
        if info is not None and self._stack:
            self._stack.pop()
            self._excluded_depth -= info[1]

    def __enter__(self) -> autocast:
        if self.module is not None and not self._modes:  # nested: the outer one's hooks
            self._hook_modules()
        mode = _Mode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        self._modes.pop().__exit__(*exc)
        if self._modes:
            return  # still inside an outer ``with`` (e.g. a decorated call within one)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._stack.clear()
        self._excluded_depth = 0
        if self.log_dir is not None:
            self.report.write_log_dir(self.log_dir)

    def checkpoint_contexts(self) -> tuple[Any, Any]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
        the recompute during backward runs under the same lists and exclusions (without
        it, it would run in float32 and torch would refuse the mismatched tensors)."""
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        hooks, stack, depth = self._hooks, self._stack, self._excluded_depth
        self._hooks, self._stack, self._excluded_depth = [], [], 0
        if self.module is not None:
            self._hook_modules()
        try:
            with _Mode(self):
                yield
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks, self._stack, self._excluded_depth = hooks, stack, depth

    def convert_options(self) -> dict[str, Any]:
        """The user's list changes as :func:`mixprec.torch.convert_module` /
        :func:`mixprec.convert` options (training's own defaults stay training's)."""
        options: dict[str, Any] = {k: v for k, v in self.changes.items() if v}
        options["dtype"] = "bf16" if self.low == torch.bfloat16 else "fp16"
        if self.exclude:
            options["exclude_modules"] = [p.pattern for p in self.exclude]
        if self.policy.force_all:
            options["force_all"] = True
        return options
