"""The job's typed fields: one frozen dataclass per section of the job file (version 1).

Every field is checked and normalized in one place: `_check_fields`, run by each section's
`__post_init__`, so a config built from YAML, from `--set` overrides or directly in Python gets
the same checks, the same messages and the same normalized values (kv_cache_memory "4GiB" is
stored as 4294967296 bytes). Every message starts with the field's path, e.g.
"engine.page_size: expected a positive integer, got -1".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar

from batchllm.config import checks as c
from batchllm.config.errors import ConfigError


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
        except c.Bad as e:
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
    path: str = _spec(c.string, "smollm2-135m-instruct")
    dtype: str = _spec(c.one_of("auto", "float32", "bfloat16", "float16"), "auto")
    device: str = _spec(c.one_of("auto", "cuda", "cpu", hints={"gpu": "cuda"}), "auto")
    max_model_len: int | None = _spec(c.optional(c.positive_int), None)
    revision: str | None = _spec(c.optional(c.string), None)  # hub ids: a branch, tag or commit
    # null: as the checkpoint is; fp8: bf16/fp32 weights quantized to e4m3 at load
    quantization: str | None = _spec(c.optional(c.one_of("fp8")), None)


@dataclass(frozen=True)
class InputConfig(_Section):
    """id_column: an input column named "id" is optional (absent: rows are identified by their
    index); a column given any other name must exist; null always uses the row index."""

    SECTION: ClassVar[str] = "input"
    path: str = _spec(c.file_path)
    id_column: str | None = _spec(c.optional(c.string), "id")
    prompt_column: str = _spec(c.string, "prompt")
    messages_column: str | None = _spec(c.optional(c.string), None)
    chat_template: bool = _spec(c.boolean, True)
    system_prompt: str | None = _spec(c.optional(c.string), None)
    # auto: by extension (.parquet, .jsonl / .ndjson, .csv); openai-batch: OpenAI Batch requests
    format: str = _spec(c.one_of("auto", "parquet", "jsonl", "csv", "openai-batch"), "auto")

    def _cross_checks(self) -> list[str]:
        if self.chat_template:
            return []
        return [f"input.{name}: needs chat_template: true"
                for name in ("messages_column", "system_prompt") if getattr(self, name)]


@dataclass(frozen=True)
class OutputConfig(_Section):
    SECTION: ClassVar[str] = "output"
    path: str = _spec(c.file_path)
    mode: str = _spec(c.one_of("error", "overwrite", "resume"), "error")
    include_prompt: bool = _spec(c.boolean, False)
    include_token_ids: bool = _spec(c.boolean, False)
    format: str = _spec(c.one_of("parquet", "openai-batch"), "parquet")  # openai-batch: JSONL
    prometheus: str | None = _spec(c.optional(c.prom_file), None)  # node_exporter textfile


@dataclass(frozen=True)
class SamplingConfig(_Section):
    SECTION: ClassVar[str] = "sampling"
    max_tokens: int = _spec(c.positive_int)
    temperature: float = _spec(lambda v: c.number(v, "a number >= 0", lambda x: x >= 0), 0.0)
    top_p: float = _spec(lambda v: c.number(v, "a number in (0, 1]", lambda x: 0 < x <= 1), 1.0)
    top_k: int = _spec(c.non_negative_int, 0)
    seed: int = _spec(c.non_negative_int, 0)
    stop: tuple[str, ...] = _spec(c.stop, ())
    ignore_eos: bool = _spec(c.boolean, False)
    n: int = _spec(c.int_in(1, 128), 1)  # samples per row (batchllm.sampling_params.MAX_N)
    logprobs: int = _spec(c.int_in(0, 20), 0)  # top alternatives per generated token
    # structured output, at most one of the three (an input column of the same name overrides
    # all three for its row): a schema inline or the path of a JSON file, stored as JSON text
    json_schema: str | None = _spec(c.json_schema, None)
    regex: str | None = _spec(c.optional(c.string), None)
    choice: tuple[str, ...] | None = _spec(c.choices, None)

    def _cross_checks(self) -> list[str]:
        given = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(given) > 1:
            return [(f"sampling.{given[1]}: sampling.{given[0]} is set too; give at most one of "
                    "json_schema, regex and choice")]
        if given:  # every row would fail: the job's own constraint is checked before it starts
            from batchllm.constraints import compile_problem

            kind = given[0]
            spec = getattr(self, kind)
            why = compile_problem(kind, json.dumps(list(spec)) if kind == "choice" else spec)
            if why:
                return [f"sampling.{kind}: the {kind.replace('_', ' ')} does not compile: {why}"]
        return []


@dataclass(frozen=True)
class EngineConfig(_Section):
    SECTION: ClassVar[str] = "engine"
    page_size: int = _spec(c.positive_int, 16)
    kv_cache_memory: float | int = _spec(c.kv_memory, 0.9)  # a fraction, or bytes
    max_num_seqs: int = _spec(c.positive_int, 256)
    max_batched_tokens: int = _spec(c.positive_int, 8192)
    prefix_sharing: bool = _spec(c.boolean, True)
    workers: int = _spec(c.positive_int, 1)
    ray_address: str | None = _spec(c.optional(c.string), None)
    # workers > 1: "tree": the driver plans the whole job and cuts the plan; "partition": Ray
    # tasks tokenize and range-partition the rows, each worker plans its part; "auto": tree up
    # to 1,000,000 input rows
    sharding: str = _spec(c.one_of("auto", "tree", "partition"), "auto")
    # decode steps replayed as CUDA graphs (on CUDA; elsewhere there is nothing to capture)
    cuda_graphs: bool = _spec(c.boolean, True)
    kv_cache_dtype: str = _spec(c.one_of("auto", "fp8"), "auto")  # fp8: e4m3, scaled per head
    tensor_parallel: int = _spec(c.positive_int, 1)  # devices one model is split over
    # plan step N+1 while step N runs: auto (on for CUDA) | true | false; same outputs either way
    overlap: str | bool = _spec(c.auto_or_boolean, "auto")
    # seconds without progress before a Ray worker is replaced
    worker_timeout: float = _spec(lambda v: c.number(v, "a number of seconds > 0",
                                                     lambda x: x > 0), 600.0)


@dataclass(frozen=True)
class PlannerConfig(_Section):
    SECTION: ClassVar[str] = "planner"
    order: str = _spec(c.one_of("prefix-tree", "input"), "prefix-tree")


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingConfig))
SECTIONS = {"model": ModelConfig, "input": InputConfig, "output": OutputConfig,
            "sampling": SamplingConfig, "engine": EngineConfig, "planner": PlannerConfig}
TOP_KEYS = ("name", "version", *SECTIONS)  # the keys of a job file


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
        if self.sampling.choice is not None:
            d["sampling"]["choice"] = list(self.sampling.choice)
        return d


def section_keys(cls: type) -> list[str]:
    """The keys a section of the job file takes."""
    return [f.name for f in dataclasses.fields(cls) if "check" in f.metadata]
