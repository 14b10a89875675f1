"""``key=value`` overrides of a :class:`moejax.config.Config`: each value parsed against its
field's type, every override refused before any compute where its key is unknown (with the
keys it most likely meant and the allowed ones) or its value is not allowed (with the allowed
values), each section rebuilt and validated once with all of its changes; and
:func:`describe`, one line per settable key (the commands' ``--help``)."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Literal, get_args, get_origin

from moejax.config import Config, ConfigError, _is_optional, _resolved_hints

__all__ = ["apply_overrides", "close_names", "describe", "unread_reason"]


def _type_desc(tp) -> str:
    optional, inner = _is_optional(tp)
    origin = get_origin(inner)
    if origin is Literal:
        desc = "one of " + ", ".join(repr(a) for a in get_args(inner))
    elif origin is tuple:
        args = get_args(inner)
        each = _type_desc(args[0]) if len(args) == 2 and args[1] is Ellipsis else "values"
        desc = f"comma list in parentheses, each {each}"
    else:
        desc = getattr(inner, "__name__", str(inner))
    return desc + (" or none" if optional else "")


def describe(cfg: Config, prefix: str = "") -> list[str]:
    """One line per settable key of ``cfg``: ``key = default  (allowed values)``."""
    lines, hints = [], _resolved_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            lines.extend(describe(value, prefix + f.name + "."))
        else:
            lines.append(f"  {prefix}{f.name} = {value!r}  ({_type_desc(hints.get(f.name))})")
    return lines


def _allowed_keys(cfg: Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            keys.extend(_allowed_keys(value, prefix + f.name + "."))
        else:
            keys.append(prefix + f.name)
    return keys


def close_names(word: str, names, n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` spelt close to ``word``, closest first: what a refusal of a
    mistyped name suggests (a key, a runner key, a study)."""
    return difflib.get_close_matches(word, list(names), n=n, cutoff=0.75)


# an error lists every allowed key up to this many; past it, each section as one entry
_LISTED_KEYS = 24


def _allowed_text(cfg: Config, prefix: str = "") -> str:
    """``"allowed keys: ..."``: every key of ``cfg`` where they are few, else its own keys
    and each section as ``name.* (N keys)``, so the error stays readable."""
    keys = _allowed_keys(cfg, prefix)
    if len(keys) <= _LISTED_KEYS:
        return "allowed keys: " + ", ".join(keys)
    parts = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            parts.append(f"{prefix}{f.name}.* ({len(_allowed_keys(value))} keys)")
        else:
            parts.append(prefix + f.name)
    if len(parts) == len(keys):  # no section to fold
        return "allowed keys: " + ", ".join(keys)
    return (f"allowed keys ({len(keys)}; the command's --help lists each with its default): "
            + ", ".join(parts))


def _near_keys(key: str, allowed: list[str], most: int = 5) -> list[str]:
    """The allowed keys a mistyped ``key`` most likely meant, best first: those that end in
    the whole of ``key`` (it named a key of a section without the section), then those with
    its last part (the same setting in another section, closest first); failing both, the
    close spellings of its last part in the closest section, then in any section, then of
    the whole key."""
    section, _, name = key.rpartition(".")
    near = [k for k in allowed if k.endswith("." + key)]
    near += sorted((k for k in allowed if k.rpartition(".")[2] == name),
                   key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())
    if not near:  # a misspelling: the closest section's closest keys, else any close key
        sections = {k.rpartition(".")[0] for k in allowed}
        best = section if section in sections else (close_names(section, sections, n=1)
                                                    or [None])[0]
        for keys in ([k for k in allowed if k.rpartition(".")[0] == best], allowed):
            close = close_names(name, {k.rpartition(".")[2] for k in keys})
            near = [k for c in close for k in keys if k.rpartition(".")[2] == c]
            if near:
                break
        else:
            near = close_names(key, allowed)
    return list(dict.fromkeys(near))[:most]


def _split_top_level(body: str) -> list[str]:
    """Split at the commas outside brackets: ``"(1,2),(3,4)"`` -> ``["(1,2)", "(3,4)"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return parts


def _parse_scalar(text: str, tp, key: str):
    optional, inner = _is_optional(tp)
    if optional and text.lower() in ("none", "null"):
        return None
    origin = get_origin(inner)
    if origin is Literal:
        allowed = get_args(inner)
        for a in allowed:
            if str(a) == text or (isinstance(a, str) and a.lower() == text.lower()):
                return a
        raise ConfigError(
            f"{key}={text!r} is not allowed; allowed values: " + ", ".join(repr(a) for a in allowed)
        )
    if inner is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r}: expected a bool (true/false)")
    if inner is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected an int") from None
    if inner is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected a float") from None
    if inner is str:
        return text
    if origin in (tuple, list):
        args = get_args(inner)
        body = text.strip()
        if body.startswith(("(", "[")):
            body = body[1:-1]
        parts = [p.strip() for p in _split_top_level(body) if p.strip()]
        fixed = origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis)
        if fixed:
            if len(parts) != len(args):
                raise ConfigError(f"{key}={text!r}: expected {len(args)} values, got "
                                  f"{len(parts)}")
            return tuple(_parse_scalar(p, t, key) for p, t in zip(parts, args))
        elem = args[0] if args else str
        return tuple(_parse_scalar(p, elem, key) for p in parts)
    # Fallback: JSON literal.
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _collect(
    cfg: Config, path: list[str], text: str, full_key: str, changes: dict, prefix: str = ""
) -> None:
    """Parse one override into the nested ``changes`` dict (validated later, all at once)."""
    names = {f.name for f in dataclasses.fields(cfg)}
    head = path[0]
    if head not in names:
        near = _near_keys(full_key, _allowed_keys(cfg, prefix))
        guess = ""
        if near:
            names = [repr(k) for k in near]
            said = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
            guess = f" (did you mean {said}?)"
        raise ConfigError(f"unknown config key {full_key!r}{guess}; "
                          + _allowed_text(cfg, prefix))
    value = getattr(cfg, head)
    if len(path) > 1:
        if not isinstance(value, Config):
            raise ConfigError(f"unknown config key {full_key!r}: {head!r} has no sub-keys")
        sub = changes.setdefault(head, {})
        if not isinstance(sub, dict):  # pragma: no cover - same key given as value and section
            raise ConfigError(f"{full_key!r} conflicts with an earlier override")
        _collect(value, path[1:], text, full_key, sub, prefix + head + ".")
        return
    if isinstance(value, Config):
        raise ConfigError(f"{full_key!r} is a config section; set one of its keys; "
                          + _allowed_text(value, full_key + "."))
    hints = _resolved_hints(type(cfg))
    changes[head] = (_parse_scalar(text, hints.get(head, str), full_key), full_key, text)


def _rebuild(cfg: Config, changes: dict) -> Config:
    kwargs = {}
    for name, change in changes.items():
        if isinstance(change, dict):
            kwargs[name] = _rebuild(getattr(cfg, name), change)
        else:
            kwargs[name] = change[0]
    try:
        return dataclasses.replace(cfg, **kwargs)
    except ConfigError as e:
        raise ConfigError(f"overrides rejected ({', '.join(_given(changes))}): {e}") from None


def _given(changes: dict):
    """Every ``key='value'`` of a (nested) set of changes, as given."""
    for change in changes.values():
        if isinstance(change, dict):
            yield from _given(change)
        else:
            yield f"{change[1]}={change[2]!r}"


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Apply ``key=value`` strings (dotted keys for nested configs) to ``cfg``.

    All overrides are parsed first and each config section is rebuilt (and validated) once
    with all of its changes, so the order of interdependent keys does not matter; a key given
    twice is refused (which value was meant?)."""
    changes: dict = {}
    given: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"bad override {item!r}: expected key=value; "
                              + _allowed_text(cfg))
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that were not UTF-8 (surrogate-escaped)
            raise ConfigError(f"{key}=...: the value is not valid UTF-8 text; give it in "
                              "UTF-8") from None
        if key in given:
            raise ConfigError(f"{key} is given twice ({key}={given[key]} and {item}); give "
                              "each key once")
        given[key] = text
        _collect(cfg, key.split("."), text.strip(), key, changes)
    new = _rebuild(cfg, changes)
    for key, text in given.items():
        _check_read(new, key, text)
    return new


def _check_read(cfg: Config, key: str, text: str) -> None:
    """Refuse override ``key=text`` where it sets a field (or a field inside a section) that
    the config's other settings leave unread (:meth:`Config.unread_fields`)."""
    found = unread_reason(cfg, key)
    if found is not None:
        where, why = found
        raise ConfigError(f"{key}={text!r}: {where} is {why}, so the value would be "
                          "recorded but not run; drop the key or set what reads it")


def unread_reason(cfg: Config, key: str) -> tuple[str, str] | None:
    """``(the unread field key goes through, why)`` where dotted ``key`` sets a field that
    ``cfg``'s other settings leave unread (:meth:`Config.unread_fields`), else None."""
    node, path, parts = cfg, [], key.split(".")
    for i, part in enumerate(parts):
        rest = ".".join(parts[i:])
        for field, why in node.unread_fields().items():
            if rest == field or rest.startswith(field + "."):
                return ".".join([*path, field]), why
        node, path = getattr(node, part), [*path, part]
        if not isinstance(node, Config):
            return None
    return None
