"""The job file: its typed, checked fields (sections.py, with the field checks in checks.py) and
its reading from YAML with `--set` overrides (loader.py). Torch-free."""

from batchllm.config.checks import parse_size
from batchllm.config.errors import ConfigError
from batchllm.config.loader import job_from_dict, load_job
from batchllm.config.sections import (
    SAMPLING_FIELDS,
    EngineConfig,
    InputConfig,
    JobConfig,
    ModelConfig,
    OutputConfig,
    PlannerConfig,
    SamplingConfig,
)

__all__ = [
    "SAMPLING_FIELDS", "ConfigError", "EngineConfig", "InputConfig", "JobConfig", "ModelConfig",
    "OutputConfig", "PlannerConfig", "SamplingConfig", "job_from_dict", "load_job", "parse_size",
]
