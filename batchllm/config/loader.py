"""Job file (YAML) and `--set section.key=value` overrides -> a checked JobConfig.

Unknown keys are errors naming the field's path and the closest known key, e.g.
"sampling.temprature: unknown key; did you mean temperature?".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import yaml

from batchllm.config.checks import did_you_mean, show
from batchllm.config.errors import ConfigError
from batchllm.config.sections import SECTIONS, TOP_KEYS, JobConfig, section_keys


def _apply_override(raw: dict, item: str) -> None:
    key, eq, text = item.partition("=")
    parts = key.strip().split(".")
    where = f"--set {item}"
    if not eq or not all(parts):
        raise ConfigError(f"{where}: expected section.key=value, e.g. sampling.max_tokens=64")
    try:  # a value starting with "#" would be a YAML comment: take it as text (stop=###)
        value = text.strip() if text.lstrip().startswith("#") else yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - PyYAML raises more than YAMLError (dates, tags)
        raise ConfigError(f"{where}: the value is not valid YAML") from None
    if parts[0] not in TOP_KEYS:
        raise ConfigError(f"{where}: {parts[0]}: unknown key; "
                          f"{did_you_mean(parts[0], list(TOP_KEYS))}")
    if parts[0] in SECTIONS and len(parts) != 2:
        raise ConfigError(f"{where}: expected {parts[0]}.<key>=value")
    if parts[0] not in SECTIONS:
        if len(parts) != 1:
            raise ConfigError(f"{where}: {parts[0]} has no sub-keys")
        raw[parts[0]] = value
        return
    keys = section_keys(SECTIONS[parts[0]])
    if parts[1] not in keys:
        raise ConfigError(f"{where}: {key.strip()}: unknown key; {did_you_mean(parts[1], keys)}")
    section = raw.get(parts[0])
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"{parts[0]}: expected a mapping, got {show(section)}")
    raw[parts[0]] = {**(section or {}), parts[1]: value}


def job_from_dict(d: Any, overrides: list[str] | tuple[str, ...] = (),
                  default_name: str = "job") -> JobConfig:
    """Build a JobConfig from a parsed job file plus "section.key=value" overrides."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping of sections (model, input, ...), got {show(d)}")
    raw = dict(d)
    for item in overrides:
        _apply_override(raw, item)
    errors: list[str] = []
    errors += [f"{show(k) if not isinstance(k, str) else k}: unknown key; "
               f"{did_you_mean(k, list(TOP_KEYS))}" for k in raw if k not in TOP_KEYS]
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        errors.append(f"name: expected a non-empty string, got {show(name)}")
    version = raw.get("version", 1)
    if version != 1 or isinstance(version, bool):
        errors.append(f"version: this batchllm reads job files of version 1, got {show(version)}")
    sections: dict[str, Any] = {}
    for sname, cls in SECTIONS.items():
        values = raw.get(sname)
        values = {} if values is None else values
        if not isinstance(values, dict):
            errors.append(f"{sname}: expected a mapping, got {show(values)}")
            continue
        keys = section_keys(cls)
        errors += [f"{sname}.{k}: unknown key; {did_you_mean(k, keys)}"
                   for k in values if k not in keys]
        required = [f.name for f in dataclasses.fields(cls) if f.default is MISSING]
        missing = [k for k in required if k not in values]
        errors += [f"{sname}.{k}: required field is missing" for k in missing]
        if missing or any(k not in keys for k in values):
            continue
        try:
            sections[sname] = cls(**values)
        except ConfigError as e:
            errors += e.errors
    if errors:
        raise ConfigError(*errors)
    return JobConfig(name=name, version=1, **sections)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; let SafeLoader report it
                break
            if duplicate:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"{show(key)}: key given twice (line {line})")
        return super().construct_mapping(node, deep=deep)


def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job file; apply "section.key=value" overrides (values parsed as YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: job file not found")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the job file: {e}")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(*(f"{path}: {m}" for m in e.errors))
    except Exception as e:  # noqa: BLE001 - PyYAML raises more than YAMLError (dates, tags)
        raise ConfigError(f"{path}: not valid YAML: {str(e)[:300]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of sections (model, input, output, "
                          f"sampling, ...), got {show(data)}")
    return job_from_dict(data, overrides, default_name=path.stem)
