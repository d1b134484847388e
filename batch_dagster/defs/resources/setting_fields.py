"""Resource fields that hold a setting.

A field names the setting's variable; its default and its description come from the setting's one declaration in
settings.py. `from_settings` fills every such field of a resource. A variable that is set reaches its field as a
`dg.EnvVar`, so the Dagster UI shows the variable's name rather than its value.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import dagster as dg
from pydantic import Field
from pydantic_core import PydanticUndefined

from batch_dagster import settings as s

R = TypeVar("R", bound=dg.ConfigurableResource)
_VARIABLE = "variable"  # the key of a field's variable in its json_schema_extra


def setting(name: str, *, default: Any = PydanticUndefined, as_text: bool = False) -> Any:
    """A resource field holding the setting of the variable `name`.

    Its default is the setting's; a setting derived from others (BATCH_DATABASE_URL from BATCH_DATA_DIR) has none,
    unless `default` says what the field holds without it. `as_text`: the field holds the variable's text (a secret
    list, such as BATCH_API_KEYS, parsed where it is used), so a set variable can reach it as a `dg.EnvVar`.
    """
    variable = s.declared(name)
    if default is PydanticUndefined and not s.is_derived(name):
        default = variable.text() if as_text else _as_field_value(s.default(name))
    return Field(default=default, description=variable.meaning, json_schema_extra={_VARIABLE: name})


def _as_field_value(value: Any, text: bool = False) -> Any:
    """A setting's value as a resource field holds it: paths as text, sequences as lists (or comma-joined text)."""
    if isinstance(value, tuple):
        return ",".join(value) if text else list(value)
    return str(value) if isinstance(value, Path) else value


def _env_var(name: str, annotation: Any) -> Any:
    """A `dg.EnvVar` of `name` for a field of type `annotation` (an `EnvVar.int` for an int), or None when the
    field's type takes none (a list, a float, a Literal: pydantic checks an EnvVar as the text of its name)."""
    kinds = set(get_args(annotation)) - {type(None)} if get_origin(annotation) in (Union, types.UnionType) \
        else {annotation}
    if kinds == {str}:
        return dg.EnvVar(name)
    return dg.EnvVar.int(name) if kinds == {int} else None


def from_settings(cls: type[R], settings: s.Settings, **given: Any) -> R:
    """The resource `cls` with each field that holds a setting filled from `settings` (and the `given` values).

    A variable that is set, and whose text is its value, reaches a text or int field as a `dg.EnvVar` (an int field:
    an `EnvVar.int`): the Dagster UI then shows the variable's name, never its value (a secret's). The others hold
    the setting's value.
    """
    values = dict(given)
    for field_name, info in cls.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        name = extra.get(_VARIABLE)
        if not isinstance(name, str) or field_name in given:
            continue
        variable = s.declared(name)
        env_var = _env_var(name, info.annotation) if s.is_set(name) and variable.text_is_value else None
        values[field_name] = env_var if env_var is not None else _as_field_value(
            getattr(settings, variable.field), text=info.annotation is str)
    return cls(**values)
