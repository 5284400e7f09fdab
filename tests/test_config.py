"""Job file -> JobConfig: defaults, exact error messages, overrides, and a fuzz that random YAML
gives either a JobConfig or a ConfigError, never another exception."""

import importlib.util

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchllm.config import (
    ConfigError,
    EngineConfig,
    JobConfig,
    SamplingConfig,
    job_from_dict,
    load_job,
    parse_size,
)
from batchllm.scale.cluster import require_ray

MINIMAL = {"input": {"path": "in.parquet"}, "output": {"path": "out.parquet"},
           "sampling": {"max_tokens": 8}}


def _error(d, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        job_from_dict(d, overrides)
    return str(e.value)


def _with(section: str, **values) -> dict:
    d = {k: dict(v) for k, v in MINIMAL.items()}
    d.setdefault(section, {}).update(values)
    return d


def test_defaults_follow_design():
    job = job_from_dict(MINIMAL)
    assert job.name == "job" and job.version == 1
    assert (job.model.path, job.model.dtype, job.model.device) == ("smollm2-135m-instruct",
                                                                    "auto", "auto")
    assert job.model.max_model_len is None
    assert (job.input.id_column, job.input.prompt_column, job.input.messages_column) == (
        "id", "prompt", None)
    assert job.input.chat_template is True and job.input.system_prompt is None
    assert (job.output.mode, job.output.include_prompt, job.output.include_token_ids) == (
        "error", False, False)
    assert job.sampling == SamplingConfig(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0,
                                          seed=0, stop=(), ignore_eos=False)
    assert job.engine == EngineConfig(page_size=16, kv_cache_memory=0.9, max_num_seqs=256,
                                      max_batched_tokens=8192, prefix_sharing=True, workers=1,
                                      ray_address=None)
    assert job.planner.order == "prefix-tree"


def test_frozen_and_to_dict():
    job = job_from_dict(_with("sampling", stop=["###"]))
    with pytest.raises(AttributeError):
        job.sampling.max_tokens = 3
    d = job.to_dict()
    assert d["sampling"]["stop"] == ["###"]
    assert job_from_dict(d, default_name="x") == job


def test_load_job_file(tmp_path):
    path = tmp_path / "legal.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "engine": {"kv_cache_memory": "4GiB"},
                                    "input": {"path": "in.parquet", "id_column": "id"}}))
    job = load_job(path)
    assert job.name == "legal"  # the file stem
    assert job.engine.kv_cache_memory == 4 * 2**30 and job.input.id_column == "id"


FRACTION_OR_SIZE = "expected a fraction in (0, 1] or a size such as '4GiB'"
ERRORS = [
    (_with("sampling", temprature=0.5),
     "sampling.temprature: unknown key; did you mean temperature?"),
    ({**MINIMAL, "sampling": {}}, "sampling.max_tokens: required field is missing"),
    ({"output": {"path": "o"}, "sampling": {"max_tokens": 1}},
     "input.path: required field is missing"),
    (_with("engine", page_size="abc"), "engine.page_size: expected a positive integer, got 'abc'"),
    (_with("engine", page_size=0), "engine.page_size: expected a positive integer, got 0"),
    (_with("engine", max_num_seqs=True),
     "engine.max_num_seqs: expected a positive integer, got True"),
    (_with("sampling", max_tokens=0), "sampling.max_tokens: expected a positive integer, got 0"),
    (_with("sampling", temperature=-0.1), "sampling.temperature: expected a number >= 0, got -0.1"),
    (_with("sampling", temperature=float("inf")),
     "sampling.temperature: expected a number >= 0, got inf"),  # a finite number, as per row
    (_with("sampling", top_p=0), "sampling.top_p: expected a number in (0, 1], got 0"),
    (_with("sampling", top_p=1.5), "sampling.top_p: expected a number in (0, 1], got 1.5"),
    (_with("sampling", top_k=-1), "sampling.top_k: expected an integer >= 0, got -1"),
    (_with("sampling", stop=[""]), "sampling.stop: expected a list of non-empty strings, got ['']"),
    (_with("sampling", ignore_eos="yes"), "sampling.ignore_eos: expected true or false, got 'yes'"),
    (_with("model", dtype="bf16"), ("model.dtype: expected one of auto, float32, bfloat16, "
                                   "float16, got 'bf16'; did you mean bfloat16?")),
    (_with("model", device="gpu"),
     "model.device: expected one of auto, cuda, cpu, got 'gpu'; did you mean cuda?"),
    (_with("output", mode="overwite"), ("output.mode: expected one of error, overwrite, resume, "
                                       "got 'overwite'; did you mean overwrite?")),
    (_with("planner", order="prefix_tree"), ("planner.order: expected one of prefix-tree, input, "
                                            "got 'prefix_tree'; did you mean prefix-tree?")),
    (_with("engine", kv_cache_memory=1.5), f"engine.kv_cache_memory: {FRACTION_OR_SIZE}, got 1.5"),
    (_with("engine", kv_cache_memory="4 gigs"),
     f"engine.kv_cache_memory: {FRACTION_OR_SIZE}, got '4 gigs'"),
    (_with("input", chat_template=False, system_prompt="Be brief."),
     "input.system_prompt: needs chat_template: true"),
    (_with("sampling", regex="([a-"), "sampling.regex: the regex does not compile: "),
    (_with("sampling", json_schema={"type": "objectz"}),
     "sampling.json_schema: the json schema does not compile: Invalid type: objectz"),
    ({**MINIMAL, "enigne": {}}, "enigne: unknown key; did you mean engine?"),
    ({**MINIMAL, "engine": [1]}, "engine: expected a mapping, got [1]"),
    ({**MINIMAL, "version": 2}, "version: this batchllm reads job files of version 1, got 2"),
    ({**MINIMAL, "name": 5}, "name: expected a non-empty string, got 5"),
]


@pytest.mark.parametrize("d, message", ERRORS)
def test_error_messages(d, message):
    got = _error(d)
    assert got.startswith(message) if message.endswith(": ") else got == message


def test_the_jobs_own_constraints_that_compile_pass():
    for spec in ({"regex": "[a-z]+"}, {"json_schema": {"type": "object"}},
                 {"choice": ["yes", "no"]}):
        job_from_dict(_with("sampling", **spec))


def test_all_errors_reported_at_once():
    d = _with("sampling", temprature=1)
    d["engine"] = {"page_size": -1}
    assert _error(d).splitlines() == [
        "sampling.temprature: unknown key; did you mean temperature?",
        "engine.page_size: expected a positive integer, got -1"]


def test_workers_need_ray(monkeypatch):
    """The job file is valid either way; a run or a plan of it stops at once without Ray."""
    job = job_from_dict(_with("engine", workers=2))
    assert job.engine.workers == 2
    require_ray(job)  # Ray is installed with the test extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        require_ray(job)
    assert str(e.value) == "engine.workers: 2 workers need Ray; pip install batchllm[ray]"


def test_overrides():
    job = job_from_dict(MINIMAL, ["sampling.temperature=0.7", "engine.kv_cache_memory=512MiB",
                                  "sampling.stop=['###', END]", "output.mode=resume",
                                  "engine.ray_address=", "name=nightly", "sampling.seed = 3"])
    assert job.sampling.temperature == 0.7 and job.engine.kv_cache_memory == 512 * 2**20
    assert job.sampling.stop == ("###", "END") and job.output.mode == "resume"
    assert job.engine.ray_address is None and job.name == "nightly" and job.sampling.seed == 3
    assert job_from_dict(MINIMAL, ["sampling.stop=###"]).sampling.stop == ("###",)
    # an override can supply a required field the file lacks
    d = {k: v for k, v in MINIMAL.items() if k != "output"}
    assert job_from_dict(d, ["output.path=x.parquet"]).output.path == "x.parquet"


@pytest.mark.parametrize("item, message", [
    ("sampling.temprature=1", ("--set sampling.temprature=1: sampling.temprature: unknown key; "
                              "did you mean temperature?")),
    ("samplng.max_tokens=1",
     "--set samplng.max_tokens=1: samplng: unknown key; did you mean sampling?"),
    ("sampling.max_tokens",
     "--set sampling.max_tokens: expected section.key=value, e.g. sampling.max_tokens=64"),
    ("sampling=3", "--set sampling=3: expected sampling.<key>=value"),
    ("engine.page_size=abc", "engine.page_size: expected a positive integer, got 'abc'"),
    ("sampling.seed=2001-13-45", "--set sampling.seed=2001-13-45: the value is not valid YAML"),
])
def test_override_errors(item, message):
    assert _error(MINIMAL, [item]) == message


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: job file not found"):
        load_job(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a YAML mapping"):
        load_job(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="empty.yaml: expected a YAML mapping"):
        load_job(tmp_path / "empty.yaml")
    (tmp_path / "bad.yaml").write_text("input: {path: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_job(tmp_path / "bad.yaml")
    (tmp_path / "twice.yaml").write_text("sampling:\n  max_tokens: 1\n  max_tokens: 2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: 'max_tokens': key given twice \(line 3\)"):
        load_job(tmp_path / "twice.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.yaml: cannot read the job file"):
        load_job(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match="cannot read the job file"):
        load_job(tmp_path)  # a folder


def test_parse_size():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("1024") == 1024
    assert parse_size("2g") == 2 * 2**30
    for bad in ("", "GiB", "-1GiB", "4 parsecs", "0", "9" * 400 + "GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                     st.text(max_size=12), st.from_regex(r"\d{1,400}(\.\d)?[kmgtKMGT]?i?[bB]?",
                                                         fullmatch=True),
                     st.sampled_from(["auto", "cpu", "4GiB", "resume", "input", "prefix-tree",
                                      "x.parquet"]))
_keys = st.sampled_from(["name", "version", "model", "input", "output", "sampling", "engine",
                         "planner", "path", "max_tokens", "temperature", "page_size", "workers",
                         "kv_cache_memory", "stop", "mode", "dtype", "id_column", "order", "x"])
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_keys, inner, max_size=5), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=8), st.lists(st.text(max_size=20), max_size=2))
def test_fuzz_dicts(d, overrides):
    try:
        assert isinstance(job_from_dict(d, overrides), JobConfig)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200),
                 st.builds(lambda v: yaml.safe_dump(v), _values),
                 st.lists(st.sampled_from(["sampling:", "  max_tokens: 3", "input: {path: a}",
                                           "output:", "  path: b", "&a x", "*a", "<<: *a",
                                           "!!binary zz", "2001-13-45", "- [", "? [1]", ": ",
                                           "engine: {page_size: 0x10}", "\t", "!!python/none"]),
                          max_size=8).map("\n".join)))
def test_fuzz_yaml_files(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        assert isinstance(load_job(path), JobConfig)
    except ConfigError as e:
        assert str(e)
