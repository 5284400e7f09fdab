"""batchllm/rows/pandas_probe.py: after settle(), pyarrow converts Python values without
importing pandas, and an explicit use of pandas still works. In a fresh interpreter each: the
test process may have imported pandas already."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

CONVERSIONS = """
import sys
import pyarrow as pa, pyarrow.compute as pc
{settle}
pa.array([1, 2]); pa.array(["a", None], pa.string()); pc.greater(pa.array([1]), 1)
pa.table({{"a": [1], "b": [[{{"x": 1}}]]}})
print("pandas" in sys.modules)
"""


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="needs pandas installed")
def test_conversions_after_settle_import_no_pandas() -> None:
    assert _run(CONVERSIONS.format(settle="")) == "True"  # what settle() saves: pyarrow imports it
    settled = "from batchllm.rows import pandas_probe; assert pandas_probe.settle()"
    assert _run(CONVERSIONS.format(settle=settled)) == "False"


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="needs pandas installed")
def test_an_explicit_use_of_pandas_still_works_after_settle() -> None:
    code = ("from batchllm.rows import pandas_probe; pandas_probe.settle()\n"
            "import pyarrow as pa\n"
            "print(type(pa.table({'a': [1, 2]}).to_pandas()).__name__)")
    assert _run(code) == "DataFrame"


def test_settle_leaves_an_imported_pandas_alone() -> None:
    code = ("import sys; sys.modules['pandas'] = object()\n"
            "from batchllm.rows import pandas_probe; print(pandas_probe.settle())")
    assert _run(code) == "False"
