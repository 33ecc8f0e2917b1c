"""Configuration: explicit arguments > environment variables > defaults.

Environment variables are read here and nowhere else. They mirror TensorFlow/ITEX's
auto-mixed-precision variables; list values are comma-separated op types or patterns.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mixprec.core.errors import MixprecError
from mixprec.core.policy import OpClass, Policy, default_policy, normalize_dtype

__all__ = [
    "BATCH_PARENT_ENV",
    "ENV_VARS",
    "LOG_LEVEL_ENV",
    "THREADS_ENV",
    "ConvertConfig",
    "ListChanges",
    "check_budget",
    "check_choice",
    "ort_log_severity",
    "resolve_policy",
]

ENV_PREFIX = "MIXPREC_"
_LIST_ENV = {
    OpClass.ALLOW: "ALLOWLIST",
    OpClass.DENY: "DENYLIST",
    OpClass.INFER: "INFERLIST",
    OpClass.CLEAR: "CLEARLIST",
}
#: Caps every ONNX Runtime session's intra-op threads (``mixprec batch`` sets it in each
#: worker so that N workers share the cores instead of each taking all of them).
THREADS_ENV = "MIXPREC_THREADS"
#: The pid of a batch worker's parent: the worker ends when that process does.
BATCH_PARENT_ENV = "MIXPREC_BATCH_PARENT"
#: How much of ONNX Runtime's own log reaches stderr: nothing below fatal by default (its
#: errors come back as exceptions, which mixprec turns into one line), else error, warning,
#: info or verbose.
LOG_LEVEL_ENV = "MIXPREC_LOG_LEVEL"
_ORT_SEVERITY = {"verbose": 0, "info": 1, "warning": 2, "error": 3, "fatal": 4}
ENV_VARS: tuple[str, ...] = (
    "MIXPREC_DTYPE",
    *(f"MIXPREC_{name}_{kind}" for name in _LIST_ENV.values() for kind in ("ADD", "REMOVE")),
    "MIXPREC_EXCLUDE_NODES",
    "MIXPREC_FORCE_ALL",
    "MIXPREC_LOG_PATH",
    THREADS_ENV,
    BATCH_PARENT_ENV,
    LOG_LEVEL_ENV,
)
# Read by the test suite and the bench, not by the converter; accepted here.
_OTHER_VARS = frozenset({"MIXPREC_CORPUS", "MIXPREC_BENCH_CACHE"})


def ort_log_severity(env: Mapping[str, str] | None = None) -> int:
    """ONNX Runtime's log severity from :data:`LOG_LEVEL_ENV` (default 4, fatal only: ORT's
    errors come back as exceptions, which mixprec turns into its own one-line messages)."""
    text = (os.environ if env is None else env).get(LOG_LEVEL_ENV, "").strip().lower()
    return _ORT_SEVERITY.get(text, 4)


@dataclass(frozen=True)
class ListChanges:
    """Op types to add to / remove from each list; ``None`` means "not given"."""

    add: Mapping[OpClass, Sequence[str] | None]
    remove: Mapping[OpClass, Sequence[str] | None]


def _split(value: str, var: str) -> list[str]:
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise MixprecError(f"{var}={value!r}: empty item in comma-separated list")
    return items


def _env_bool(var: str, env: Mapping[str, str]) -> bool | None:
    raw = env.get(var)
    if raw is None or raw == "":
        return None
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise MixprecError(f"{var}={raw!r}: expected 1/0/true/false")


def resolve_policy(
    target_dtype: str | None,
    changes: ListChanges,
    *,
    exclude_nodes: Sequence[str] | None,
    force_all: bool | None,
    output_fp32_ops: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Policy:
    """Build the policy from explicit arguments, then ``MIXPREC_*`` variables, then defaults."""
    env = os.environ if env is None else env
    for var in env:
        if var.startswith(ENV_PREFIX) and var not in ENV_VARS and var not in _OTHER_VARS:
            raise MixprecError(f"unknown environment variable {var}; known: {', '.join(ENV_VARS)}")
    dtype = target_dtype if target_dtype is not None else env.get("MIXPREC_DTYPE") or "float16"
    policy = default_policy(normalize_dtype(dtype))
    # Environment lists first, explicit lists second, so an explicit argument wins even
    # when it names an op that an environment variable moved to another list.
    env_add: dict[OpClass, list[str]] = {}
    env_remove: dict[OpClass, list[str]] = {}
    add: dict[OpClass, list[str]] = {}
    remove: dict[OpClass, list[str]] = {}
    for cls, name in _LIST_ENV.items():
        for kind, given, out, from_env in (
            ("ADD", changes.add.get(cls), add, env_add),
            ("REMOVE", changes.remove.get(cls), remove, env_remove),
        ):
            var = f"MIXPREC_{name}_{kind}"
            if given is not None:
                out[cls] = list(given)
            elif env.get(var):
                from_env[cls] = _split(env[var], var)
    policy = policy.with_changes(env_add, env_remove)
    if exclude_nodes is None:
        raw = env.get("MIXPREC_EXCLUDE_NODES")
        exclude_nodes = _split(raw, "MIXPREC_EXCLUDE_NODES") if raw else []
    if force_all is None:
        force_all = _env_bool("MIXPREC_FORCE_ALL", env) or False
    return policy.with_changes(
        add,
        remove,
        exclude_nodes=exclude_nodes,
        force_all=force_all,
        output_fp32_ops=output_fp32_ops,
    )


def check_budget(name: str, value: object, high: float = 1.0) -> float | None:
    """A guard budget (``guard_drop``, ``guard_rel_l2``, ...) in (0, ``high``), or None.

    Anything else, a string included, is one clear error naming the option.

    Example:
        >>> check_budget("guard_drop", 0.02)
        0.02
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MixprecError(f"{name} must be a number in (0, {high:g}), not {value!r}")
    if not 0.0 < float(value) < high:
        raise MixprecError(f"{name} must lie in (0, {high:g}), got {value!r}")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """One clear error naming the option when ``value`` is not one of ``choices``."""
    if value not in choices:
        listed = ", ".join(str(c) for c in choices)
        raise MixprecError(f"{name} must be one of {listed}, not {value!r}")


def resolve_log_dir(log_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None):
    env = os.environ if env is None else env
    if log_dir is not None:
        return log_dir
    return env.get("MIXPREC_LOG_PATH") or None


#: Option names of :func:`mixprec.convert` that edit the policy lists.
LIST_OPTIONS: tuple[str, ...] = tuple(
    f"{cls.value}_{kind}"
    for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR)
    for kind in ("add", "remove")
)
_POLICY_OPTIONS = frozenset({*LIST_OPTIONS, "exclude_nodes", "force_all", "output_fp32_ops"})
_OBSERVERS = ("absmax", "minmax", "histogram")


@dataclass(frozen=True)
class ConvertConfig:
    """Everything a conversion is told, resolved and validated once.

    Build it with :meth:`resolve` (explicit options > ``MIXPREC_*`` > defaults) and
    change it with :meth:`replace`; stages read it and never change it.

    Attributes:
        policy: the resolved op lists, rules, exclusions and modes.
        keep_io_types: keep graph inputs/outputs float32 (True), or only the named ones.
        calibrate: run the FP32 model in ONNX Runtime and use the measured ranges.
        observer: what calibration records per tensor: "absmax", "minmax" or "histogram".
        shapes: concrete shapes for symbolic input dims, by input name.
        range_threshold: |x| limit for activations (None: a quarter of the target's max).
        fold_batchnorm: fold BatchNormalization into the preceding Conv/Gemm first.
        upgrade_opset: for bfloat16, raise the opset to 22 when the lists need it.
        clip_weights: clip out-of-range weights instead of keeping their consumers FP32.
        check: hold the result to ``onnx.checker.check_model(full_check=True)``.
        log_dir: folder for the graphs before/after and the paint buckets.
    """

    policy: Policy
    keep_io_types: bool | frozenset[str] = True
    calibrate: bool = True
    observer: str = "absmax"
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    range_threshold: float | None = None
    fold_batchnorm: bool = True
    upgrade_opset: bool = True
    clip_weights: bool = False
    check: bool = True
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise MixprecError(f"policy must be a Policy, not {type(self.policy).__name__}")
        for name in ("calibrate", "fold_batchnorm", "upgrade_opset", "clip_weights", "check"):
            _require_bool(name, getattr(self, name))
        if not isinstance(self.observer, str) or self.observer not in _OBSERVERS:
            raise MixprecError(
                f"unknown observer {self.observer!r}; use one of: {', '.join(_OBSERVERS)}"
            )
        threshold = self.range_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
        ):
            raise TypeError(f"range_threshold must be a number, not {type(threshold).__name__}")
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise MixprecError(f"range_threshold must be > 0 and finite, got {threshold!r}")
        if self.shapes is None:
            object.__setattr__(self, "shapes", {})
        if not isinstance(self.shapes, Mapping):
            raise TypeError(
                f"shapes must be a dict of input name to dims, not {type(self.shapes).__name__}"
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for name, dims in dict(self.shapes).items():
            if not isinstance(name, str):
                raise TypeError(f"shapes keys must be input names (str), not {name!r}")
            if isinstance(dims, str | bytes) or not isinstance(dims, Iterable):
                raise TypeError(f"shape of {name!r} must be a list of ints, got {dims!r}")
            try:
                fixed = tuple(_as_dim(d) for d in dims)
            except (TypeError, ValueError):
                raise MixprecError(f"shape of {name!r} must be integers, got {dims!r}") from None
            if any(d <= 0 for d in fixed):
                raise MixprecError(f"shape of {name!r} must be positive, got {list(fixed)}")
            shapes[str(name)] = fixed
        object.__setattr__(self, "shapes", MappingProxyType(shapes))
        keep = self.keep_io_types
        if not isinstance(keep, bool):
            if isinstance(keep, str | bytes) or not isinstance(keep, Iterable):
                raise MixprecError(
                    "keep_io_types must be a bool or a list of input/output names, "
                    f"not {type(keep).__name__} {keep!r}"
                )
            names = list(keep)
            bad = [k for k in names if not isinstance(k, str) or not k]
            if bad:
                raise MixprecError(f"keep_io_types must hold input/output names, got {bad[0]!r}")
            object.__setattr__(self, "keep_io_types", frozenset(names))
        if self.log_dir is not None:
            if not isinstance(self.log_dir, str | os.PathLike):
                raise TypeError(f"log_dir must be a path, not {type(self.log_dir).__name__}")
            object.__setattr__(self, "log_dir", Path(self.log_dir))

    @property
    def target(self) -> str:
        return self.policy.target

    @classmethod
    def resolve(
        cls,
        target_dtype: str | None = None,
        *,
        policy: Policy | None = None,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> ConvertConfig:
        """A config from :func:`mixprec.convert`'s keyword options, env and defaults.

        Raises:
            MixprecError: an unknown option or an invalid value.
        """
        names = {f.name for f in fields(cls)} - {"policy"}
        unknown = sorted(set(options) - names - _POLICY_OPTIONS)
        if unknown:
            raise MixprecError(f"unknown option(s): {', '.join(unknown)}")
        if target_dtype is not None and not isinstance(target_dtype, str):
            raise TypeError(
                "target_dtype must be a str such as 'fp16' or 'bf16', "
                f"not {type(target_dtype).__name__} {target_dtype!r}"
            )
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a Policy (e.g. mixprec.default_policy('fp16')), "
                f"not {type(policy).__name__} {policy!r}"
            )
        if env is not None and not isinstance(env, Mapping):
            raise TypeError(f"env must be a mapping of str to str, not {type(env).__name__}")
        policy_opts = {k: options.pop(k) for k in list(options) if k in _POLICY_OPTIONS}
        _check_policy_options(policy_opts)
        if policy is None:
            policy = _policy_from_options(target_dtype, policy_opts, env)
        elif policy_opts:
            given = ", ".join(sorted(policy_opts))
            raise MixprecError(f"give either policy= or list options ({given}), not both")
        log_dir = resolve_log_dir(options.pop("log_dir", None), env)
        if log_dir is not None and not isinstance(log_dir, str | os.PathLike):
            raise TypeError(f"log_dir must be a path, not {type(log_dir).__name__} {log_dir!r}")
        return cls(policy=policy, log_dir=Path(log_dir) if log_dir else None, **options)

    def replace(self, **changes: Any) -> ConvertConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy.to_dict(),
            "keep_io_types": (
                self.keep_io_types
                if isinstance(self.keep_io_types, bool)
                else sorted(self.keep_io_types)
            ),
            "calibrate": self.calibrate,
            "observer": self.observer,
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "range_threshold": self.range_threshold,
            "fold_batchnorm": self.fold_batchnorm,
            "upgrade_opset": self.upgrade_opset,
            "clip_weights": self.clip_weights,
            "check": self.check,
            "log_dir": str(self.log_dir) if self.log_dir else None,
        }


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r}")


def _as_dim(d: object) -> int:
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"not an int: {d!r}")
    return int(d)


def _check_policy_options(options: Mapping[str, Any]) -> None:
    """Types of the list options, and no op added to two lists at once."""
    for name in (*LIST_OPTIONS, "exclude_nodes", "output_fp32_ops"):
        value = options.get(name)
        if value is None:
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            hint = f" such as [{value!r}]" if isinstance(value, str) else ""
            raise TypeError(
                f"{name} must be a list of {'patterns' if name == 'exclude_nodes' else 'op types'}"
                f"{hint}, not {type(value).__name__}"
            )
        items = list(value)
        for item in items:
            if not isinstance(item, str) or not item:
                raise TypeError(f"{name} must hold non-empty strings, got {item!r}")
    force_all = options.get("force_all")
    if force_all is not None:
        _require_bool("force_all", force_all)
    seen: dict[str, str] = {}
    for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR):
        name = f"{cls.value}_add"
        for op in options.get(name) or ():
            if op in seen and seen[op] != name:
                raise MixprecError(f"op {op!r} is in both {seen[op]} and {name}: pick one list")
            seen[op] = name


def _policy_from_options(
    target_dtype: str | None, options: Mapping[str, Any], env: Mapping[str, str] | None
) -> Policy:
    changes = ListChanges(
        add={
            cls: options.get(f"{cls.value}_add")
            for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR)
        },
        remove={
            cls: options.get(f"{cls.value}_remove")
            for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR)
        },
    )
    return resolve_policy(
        target_dtype,
        changes,
        exclude_nodes=options.get("exclude_nodes"),
        force_all=options.get("force_all"),
        output_fp32_ops=options.get("output_fp32_ops") or (),
        env=env,
    )
