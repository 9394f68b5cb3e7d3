"""A config file read, validated and resolved against the files it names: `load_config`.

Validation is the config model's (pipeline/config.py); what needs the files is here: each
stream's paths expanded to its files and their format (`sources.resolve_stream_files`), a
format name checked against the format plug-ins, a relative tokenizer path made absolute.
The result is frozen into the config, so every process sees the same file list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.config import Config, ConfigError, TokenizerConfig
from pipeline.read.formats import registry
from pipeline.read.sources import resolve_stream_files


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        value = e.get("input")
        secret = "storage_options" in e["loc"]
        shown = "" if isinstance(value, dict | list) or secret else f", got {value!r}"
        lines.append(f"{key}: {msg}{shown}")
    return "; ".join(lines)


def parse_config(data: Any, base_dir: str | Path | None = None) -> Config:
    """Validate a mapping into a Config and resolve every stream's paths (which must match)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    known = registry()
    for name, s in cfg.streams.items():
        if s.format is not None and s.format not in known:
            raise ConfigError(
                f"streams.{name}.format: must be one of {', '.join(sorted(known))}, "
                f"got {s.format!r}"
            )
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    streams = {}
    for name, s in cfg.streams.items():
        try:
            files, fmt = resolve_stream_files(s, base)
        except ValueError as e:
            raise ConfigError(f"streams.{name}.paths: {e}") from None
        # Freeze the resolution into the config so every process sees the same file list.
        streams[name] = s.model_copy(update={"paths": files, "format": fmt})
    return cfg.model_copy(update={"streams": streams, "tokenizer": _resolve_tokenizer(cfg, base)})


def _resolve_tokenizer(cfg: Config, base: Path) -> TokenizerConfig:
    """A relative tokenizer path resolves like a stream's paths: the working directory, then
    the config's directory.

    Only a name that exists there is rewritten (to an absolute path, so every process on every
    node sees the same file); anything else stays a Hub name or 'default'.
    """
    name = cfg.tokenizer.name
    if name == "default" or "://" in name or Path(name).is_absolute():
        return cfg.tokenizer
    for local in (Path.cwd() / name, base / name):  # the order stream paths resolve in
        if local.exists():
            return cfg.tokenizer.model_copy(update={"name": str(local.resolve())})
    return cfg.tokenizer


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return parse_config(data, base_dir=path.parent)
