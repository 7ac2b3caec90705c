"""The one strict loader: YAML (or a mapping) in, a validated :class:`Config` out, or a
:class:`ConfigError` naming each bad key with its value, file and line."""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schedkit.config.base import LocatedValueError
from schedkit.config.locator import ConfigOrigin, line_of, load_yaml
from schedkit.config.root import Config
from schedkit.config.runner import runner_error
from schedkit.errors import ConfigError


def format_validation_error(err: ValidationError, source: str, root: yaml.Node | None = None) -> str:
    """Render a pydantic error as one line per problem: key, value, file and line."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        value, message = e.get("input"), e["msg"].removeprefix("Value error, ")
        located = (e.get("ctx") or {}).get("error")
        if isinstance(located, LocatedValueError):
            loc, value = (*loc, *located.loc), located.value
        runner = runner_error(loc, e)
        if runner is not None:
            loc, value, message = runner
        key = ".".join(str(p) for p in loc) or "<root>"
        where = source
        line = line_of(root, loc)
        if line is not None:
            where = f"{source}:{line}"
        if e["type"] == "extra_forbidden" and runner is None:
            near = difflib.get_close_matches(str(loc[-1]), _sibling_keys(loc), n=1)
            lines.append(f"{where}: unknown key '{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
        else:
            lines.append(f"{where}: {key} = {value!r}: {message}")
    return "\n".join(lines)


def _sibling_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys a config section at ``loc[:-1]`` takes, where the path leads through
    plain models (empty where it does not: a union, a list or mapping of sections)."""
    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        while typing.get_origin(model) is typing.Annotated:
            model = typing.get_args(model)[0]
        if not isinstance(model, type):
            return []
    return list(getattr(model, "model_fields", {}))


def config_from_dict(data: dict[str, Any] | None, source: str = "<dict>") -> Config:
    """Validate a plain mapping into a :class:`Config` (ConfigError on any mistake)."""
    try:
        return Config.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from e


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: The file is missing, is not YAML, or fails validation; the message
            names key, value, file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from e
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start})") from None
    data, root = load_yaml(text, str(path))
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        config = Config.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), root)) from e
    config = _beside(config, path.parent)
    config._origin = ConfigOrigin(str(path), root)
    return config


def _beside(config: Config, folder: Path) -> Config:
    """``config`` with a relative ``runner.profile`` path that names a file next to the
    config file made that file's path (as a trace's path is looked up there first); a
    bundled profile's name, or a path found only from the working directory, stays."""
    profile = getattr(config.runner, "profile", None)
    if not isinstance(profile, str) or Path(profile).is_absolute() or not (folder / profile).is_file():
        return config
    found = str((folder / profile).resolve())
    return config.model_copy(update={"runner": config.runner.model_copy(update={"profile": found})})
