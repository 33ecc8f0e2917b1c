"""Configuration: explicit arguments > environment variables > defaults.

Environment variables are read here and nowhere else. They mirror TensorFlow/ITEX's
auto-mixed-precision variables; list values are comma-separated op types or patterns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mixprec._errors import MixprecError
from mixprec._policy import OpClass, Policy, default_policy, normalize_dtype

__all__ = ["ENV_VARS", "ListChanges", "resolve_policy"]

ENV_PREFIX = "MIXPREC_"
_LIST_ENV = {
    OpClass.ALLOW: "ALLOWLIST",
    OpClass.DENY: "DENYLIST",
    OpClass.INFER: "INFERLIST",
    OpClass.CLEAR: "CLEARLIST",
}
ENV_VARS: tuple[str, ...] = (
    "MIXPREC_DTYPE",
    *(f"MIXPREC_{name}_{kind}" for name in _LIST_ENV.values() for kind in ("ADD", "REMOVE")),
    "MIXPREC_EXCLUDE_NODES",
    "MIXPREC_FORCE_ALL",
    "MIXPREC_LOG_PATH",
)
# Read by the test suite and the bench, not by the converter; accepted here.
_OTHER_VARS = frozenset({"MIXPREC_CORPUS", "MIXPREC_BENCH_CACHE"})


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
    import re

    for pattern in exclude_nodes:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise MixprecError(f"bad exclude pattern {pattern!r}: {exc}") from None
    return policy.with_changes(
        add,
        remove,
        exclude_nodes=exclude_nodes,
        force_all=force_all,
        output_fp32_ops=output_fp32_ops,
    )


def resolve_log_dir(log_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None):
    env = os.environ if env is None else env
    if log_dir is not None:
        return log_dir
    return env.get("MIXPREC_LOG_PATH") or None
