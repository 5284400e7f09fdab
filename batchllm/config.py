"""Job file (YAML, version 1) -> frozen JobConfig.

Every field is checked in one place: `_check_fields`, run by each section's `__post_init__`, so a
config built from YAML, from `--set` overrides or directly in Python gets the same checks and the
same messages. Every message starts with the field's path, e.g.
"sampling.temprature: unknown key; did you mean temperature?".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from batchllm.config_checks import (
    _Bad,
    _boolean,
    _did_you_mean,
    _file_path,
    _kv_memory,
    _non_negative_int,
    _number,
    _one_of,
    _optional,
    _positive_int,
    _show,
    _stop,
    _string,
)
from batchllm.config_checks import parse_size as parse_size  # noqa: PLC0414 - re-exported: part of the API


class ConfigError(Exception):
    """The job cannot start: the job file, an override or the input is invalid.

    `errors` holds one message per problem; str(error) joins them with newlines.
    """

    def __init__(self, *errors: str) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(errors))


def _spec(check, default: Any = MISSING, **kw) -> Any:
    """A dataclass field with its check in the metadata."""
    return field(default=default, metadata={"check": check}, **kw)


def _check_fields(obj: Any) -> None:
    """Check and normalize every field of a section; raise ConfigError listing all problems."""
    errors = []
    for f in dataclasses.fields(obj):
        if "check" not in f.metadata:
            continue
        try:
            object.__setattr__(obj, f.name, f.metadata["check"](getattr(obj, f.name)))
        except _Bad as e:
            errors.append(f"{obj.SECTION}.{f.name}: {e}")
    errors = errors or obj._cross_checks()  # cross checks assume every field is valid
    if errors:
        raise ConfigError(*errors)


class _Section:
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _check_fields(self)

    def _cross_checks(self) -> list[str]:
        return []


@dataclass(frozen=True)
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"
    path: str = _spec(_string, "smollm2-135m-instruct")
    dtype: str = _spec(_one_of("auto", "float32", "bfloat16", "float16"), "auto")
    device: str = _spec(_one_of("auto", "cuda", "cpu", hints={"gpu": "cuda"}), "auto")
    max_model_len: int | None = _spec(_optional(_positive_int), None)


@dataclass(frozen=True)
class InputConfig(_Section):
    """id_column: an input column named "id" is optional (absent: rows are identified by their
    index); a column given any other name must exist; null always uses the row index."""

    SECTION: ClassVar[str] = "input"
    path: str = _spec(_file_path)
    id_column: str | None = _spec(_optional(_string), "id")
    prompt_column: str = _spec(_string, "prompt")
    messages_column: str | None = _spec(_optional(_string), None)
    chat_template: bool = _spec(_boolean, True)
    system_prompt: str | None = _spec(_optional(_string), None)

    def _cross_checks(self) -> list[str]:
        if self.chat_template:
            return []
        return [f"input.{name}: needs chat_template: true"
                for name in ("messages_column", "system_prompt") if getattr(self, name)]


@dataclass(frozen=True)
class OutputConfig(_Section):
    SECTION: ClassVar[str] = "output"
    path: str = _spec(_file_path)
    mode: str = _spec(_one_of("error", "overwrite", "resume"), "error")
    include_prompt: bool = _spec(_boolean, False)
    include_token_ids: bool = _spec(_boolean, False)


@dataclass(frozen=True)
class SamplingConfig(_Section):
    SECTION: ClassVar[str] = "sampling"
    max_tokens: int = _spec(_positive_int)
    temperature: float = _spec(lambda v: _number(v, "a number >= 0", lambda x: x >= 0), 0.0)
    top_p: float = _spec(lambda v: _number(v, "a number in (0, 1]", lambda x: 0 < x <= 1), 1.0)
    top_k: int = _spec(_non_negative_int, 0)
    seed: int = _spec(_non_negative_int, 0)
    stop: tuple[str, ...] = _spec(_stop, ())
    ignore_eos: bool = _spec(_boolean, False)


@dataclass(frozen=True)
class EngineConfig(_Section):
    SECTION: ClassVar[str] = "engine"
    page_size: int = _spec(_positive_int, 16)
    kv_cache_memory: float | str = _spec(_kv_memory, 0.9)
    max_num_seqs: int = _spec(_positive_int, 256)
    max_batched_tokens: int = _spec(_positive_int, 8192)
    prefix_sharing: bool = _spec(_boolean, True)
    workers: int = _spec(_positive_int, 1)
    ray_address: str | None = _spec(_optional(_string), None)
    # workers > 1: "tree": the driver plans the whole job and cuts the plan; "partition": Ray
    # tasks tokenize and range-partition the rows, each worker plans its part; "auto": tree up
    # to 1,000,000 input rows
    sharding: str = _spec(_one_of("auto", "tree", "partition"), "auto")

    def _cross_checks(self) -> list[str]:
        if self.workers > 1 and importlib.util.find_spec("ray") is None:
            return [f"engine.workers: {self.workers} workers need Ray; pip install batchllm[ray]"]
        return []


@dataclass(frozen=True)
class PlannerConfig(_Section):
    SECTION: ClassVar[str] = "planner"
    order: str = _spec(_one_of("prefix-tree", "input"), "prefix-tree")


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingConfig))
_SECTIONS = {"model": ModelConfig, "input": InputConfig, "output": OutputConfig,
             "sampling": SamplingConfig, "engine": EngineConfig, "planner": PlannerConfig}


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """One job: every section of the job file, checked."""

    name: str
    input: InputConfig
    output: OutputConfig
    sampling: SamplingConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    version: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples as lists), in the job file's shape."""
        d = dataclasses.asdict(self)
        d["sampling"]["stop"] = list(self.sampling.stop)
        return d


def _keys_of(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if "check" in f.metadata]


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
    top = ["name", "version", *_SECTIONS]
    if parts[0] not in top:
        raise ConfigError(f"{where}: {parts[0]}: unknown key; {_did_you_mean(parts[0], top)}")
    if parts[0] in _SECTIONS and len(parts) != 2:
        raise ConfigError(f"{where}: expected {parts[0]}.<key>=value")
    if parts[0] not in _SECTIONS:
        if len(parts) != 1:
            raise ConfigError(f"{where}: {parts[0]} has no sub-keys")
        raw[parts[0]] = value
        return
    keys = _keys_of(_SECTIONS[parts[0]])
    if parts[1] not in keys:
        raise ConfigError(f"{where}: {key.strip()}: unknown key; {_did_you_mean(parts[1], keys)}")
    section = raw.get(parts[0])
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"{parts[0]}: expected a mapping, got {_show(section)}")
    raw[parts[0]] = {**(section or {}), parts[1]: value}


def job_from_dict(d: Any, overrides: list[str] | tuple[str, ...] = (),
                  default_name: str = "job") -> JobConfig:
    """Build a JobConfig from a parsed job file plus "section.key=value" overrides."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping of sections (model, input, ...), got {_show(d)}")
    raw = dict(d)
    for item in overrides:
        _apply_override(raw, item)
    errors: list[str] = []
    top = ["name", "version", *_SECTIONS]
    errors += [f"{_show(k) if not isinstance(k, str) else k}: unknown key; "
               f"{_did_you_mean(k, top)}" for k in raw if k not in top]
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        errors.append(f"name: expected a non-empty string, got {_show(name)}")
    version = raw.get("version", 1)
    if version != 1 or isinstance(version, bool):
        errors.append(f"version: this batchllm reads job files of version 1, got {_show(version)}")
    sections: dict[str, Any] = {}
    for sname, cls in _SECTIONS.items():
        values = raw.get(sname)
        values = {} if values is None else values
        if not isinstance(values, dict):
            errors.append(f"{sname}: expected a mapping, got {_show(values)}")
            continue
        keys = _keys_of(cls)
        errors += [f"{sname}.{k}: unknown key; {_did_you_mean(k, keys)}"
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
                raise ConfigError(f"{_show(key)}: key given twice (line {line})")
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
                          f"sampling, ...), got {_show(data)}")
    return job_from_dict(data, overrides, default_name=path.stem)
