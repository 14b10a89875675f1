"""Frozen, validated configuration dataclasses, their JSON form, and the checks they share.

Every config in moejax subclasses :class:`Config`:

* it is a frozen dataclass (``@config`` decorator = ``dataclass(frozen=True)``);
* ``Literal[...]`` fields are checked at construction, and subclasses add their own
  checks in ``validate()`` (raise :class:`ConfigError` naming the field and the fix);
* it serialises to plain JSON-able dicts (nested configs are tagged with their class
  path; only moejax modules, or modules already imported, are read back) and back;
* :func:`moejax.config_overrides.apply_overrides` (``cfg, ["model.d_model=256",
  "train.lr=1e-3"]``) returns a new config, refusing an unknown key or a bad value before
  any compute happens.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import numbers
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

from moejax.config_names import convention_error

__all__ = [
    "Config",
    "ConfigError",
    "config",
    "to_dict",
    "from_dict",
    "to_json",
    "from_json",
    "is_integer",
    "is_real",
    "check_count",
]

_IMPORTABLE_PREFIX = "moejax."  # other config classes must already be imported


class ConfigError(ValueError):
    """A configuration value or override is invalid; the message names key and fix."""


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool: a count, an id or an index, where a float would
    be truncated to another one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number, not a bool: a Python or numpy scalar, or a 0-d integer or floating
    array (numpy's or jax's, e.g. a hyperparameter ``optax.inject_hyperparams`` holds)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return getattr(value, "ndim", None) == 0 and kind in ("i", "u", "f")


def check_count(name: str, value, minimum: int) -> int:
    """``value`` as an int, refused where it is not an integer ``>= minimum`` (a float count
    would be truncated to another one, silently)."""
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def config(cls=None, *, kw_only: bool = False):
    """Decorator: make ``cls`` a frozen, keyword-only-friendly dataclass; ``kw_only=True``
    (``@config(kw_only=True)``): its fields keyword-only, so a base config of defaulted fields
    can be subclassed by configs with required ones."""
    if cls is None:
        return lambda c: dataclasses.dataclass(frozen=True, kw_only=kw_only)(c)
    return dataclasses.dataclass(frozen=True, kw_only=kw_only)(cls)


def _resolved_hints(cls) -> dict[str, Any]:
    """The field types of ``cls``, each class of its MRO resolved in its own module (a config
    may inherit fields from a config defined elsewhere)."""
    return typing.get_type_hints(cls, include_extras=False)


def _is_optional(tp) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return True, (args[0] if len(args) == 1 else typing.Union[tuple(args)])  # noqa: UP007
    return False, tp


def _check_value(owner: str, name: str, tp, value) -> None:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return
        raise ConfigError(f"{owner}.{name}: None is not allowed (expected {tp}).")
    origin = get_origin(inner)
    if origin is Literal:
        allowed = get_args(inner)
        if value not in allowed:
            raise ConfigError(
                f"{owner}.{name}={value!r} is not allowed; allowed values: "
                + ", ".join(repr(a) for a in allowed)
            )
    elif origin is tuple:
        args = get_args(inner)
        if len(args) == 2 and args[1] is Ellipsis and isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                _check_value(owner, f"{name}[{i}]", args[0], item)
    elif inner is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{owner}.{name}={value!r}: expected a bool (true/false).")
    elif inner is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{owner}.{name}={value!r}: expected an int.")
    elif inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{owner}.{name}={value!r}: expected a float.")


def _check_by_name(owner: str, name: str, value) -> None:
    why = convention_error(name, value)
    if why is not None:
        raise ConfigError(f"{owner}.{name}={value}: {why}")


class Config:
    """Base class of every moejax config (use together with the ``@config`` decorator).

    ``NONEMPTY``: names of tuple fields that must hold at least one item (a study that would
    otherwise compute nothing)."""

    NONEMPTY = ()  # (no annotation: a class attribute, not a field)

    def __post_init__(self):
        owner = type(self).__name__
        hints = _resolved_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type is not None and f.name in hints:
                _check_value(owner, f.name, hints[f.name], value)
            # Coerce lists to tuples so configs stay hashable / frozen.
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
            _check_by_name(owner, f.name, getattr(self, f.name))
        for name in self.NONEMPTY:
            if not getattr(self, name):
                raise ConfigError(f"{owner}.{name}=() is empty: give at least one value")
        self.validate()

    def validate(self) -> None:  # pragma: no cover - default is no extra checks
        """Subclass hook: raise :class:`ConfigError` for inconsistent values."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def unread_fields(self) -> dict[str, str]:
        """The fields (sections, values, or dotted keys inside a section) this config's other
        settings leave unread, each with why (the setting that would read it):
        :func:`apply_overrides` refuses a key through one, whose value would be recorded but
        never run. Default: none."""
        return {}

    def _read_only_with(self, selector: str, reads: dict[str, tuple]) -> dict[str, str]:
        """:meth:`unread_fields` of a choice: ``reads`` maps each field to the values of field
        ``selector`` that read it; those this config's value is not among are unread."""
        current = getattr(self, selector)
        return {f: f"read only with {selector}={' or '.join(repr(v) for v in values)} (this "
                   f"config has {selector}={current!r})"
                for f, values in reads.items() if current not in values}

    def _require(self, condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(f"{type(self).__name__}: {message}")

    @classmethod
    def _default(cls, name: str):
        """The default value of field ``name``."""
        return cls.__dataclass_fields__[name].default

    def _require_default_unless(self, read: bool, name: str, rule: str) -> None:
        """Refuse field ``name`` changed from its default where ``read`` is False: only
        ``rule`` reads it, so a value given would be recorded and ignored."""
        value, default = getattr(self, name), self._default(name)
        self._require(read or value == default,
                      f"{name}={value!r} is read only with {rule} (this config would ignore "
                      f"it); set {rule} or leave {name} at its default, {default!r}")

    def _checked(self, fn, *args):
        """``fn(*args)``, a value checked by a library function: its ``ValueError`` raised as
        this config's :class:`ConfigError`."""
        try:
            return fn(*args)
        except ValueError as e:
            raise ConfigError(f"{type(self).__name__}: {e}") from None


# ----------------------------------------------------------------------------------------
# Serialisation


def _class_path(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _import_class(path: str, extra_prefixes: tuple[str, ...] = ()):
    """The config class named by ``path``: from a ``moejax.`` module (imported on demand) or
    from a module the program has already imported (a study defining its own config), never
    by importing anything else."""
    module, _, name = path.rpartition(".")
    if not path.startswith((_IMPORTABLE_PREFIX, *extra_prefixes)):
        cls = getattr(sys.modules.get(module), name, None)
        if not _is_config_class(cls):
            raise ConfigError(
                f"refusing to build config class {path!r}: only Config classes from moejax "
                "modules or from modules already imported may be restored (import the module "
                "that defines it first)")
        return cls
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config class {path!r} cannot be imported: {e}") from e
    if not _is_config_class(cls):
        raise ConfigError(f"{path!r} is not a moejax Config class")
    return cls


def _is_config_class(cls) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, Config)


def find_configs(cfg: Config, cls: type, prefix: str = ""):
    """Yield ``(dotted key, sub-config)`` for every config of type ``cls`` in ``cfg``'s tree
    (``cfg`` itself included, as ``""``)."""
    if isinstance(cfg, cls):
        yield prefix.rstrip("."), cfg
        return
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            yield from find_configs(value, cls, f"{prefix}{f.name}.")


def to_dict(value) -> Any:
    """Config (or nested structure of configs) -> JSON-able structure with class tags."""
    if isinstance(value, Config):
        out = {"__config__": _class_path(value)}
        for f in dataclasses.fields(value):
            out[f.name] = to_dict(getattr(value, f.name))
        return out
    if isinstance(value, (tuple, list)):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_dict(v) for k, v in value.items()}
    return value


def from_dict(value, *, extra_prefixes: tuple[str, ...] = ()) -> Any:
    """Inverse of :func:`to_dict`. Only config classes from ``moejax.`` modules (plus
    ``extra_prefixes``, e.g. your own project's package) are ever imported; a class from any
    other module is taken only when that module is imported already."""
    rec = lambda v: from_dict(v, extra_prefixes=extra_prefixes)  # noqa: E731
    if isinstance(value, dict) and "__config__" in value:
        cls = _import_class(value["__config__"], extra_prefixes)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: rec(v) for k, v in value.items() if k != "__config__"}
        unknown = set(kwargs) - names
        if unknown:
            raise ConfigError(
                f"{cls.__name__}: unknown fields {sorted(unknown)} in stored config; "
                f"allowed: {sorted(names)}"
            )
        return cls(**kwargs)
    if isinstance(value, list):
        return tuple(rec(v) for v in value)
    if isinstance(value, dict):
        return {k: rec(v) for k, v in value.items()}
    return value


def to_json(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False)


def from_json(text: str, *, extra_prefixes: tuple[str, ...] = ()) -> Config:
    return from_dict(json.loads(text), extra_prefixes=extra_prefixes)
