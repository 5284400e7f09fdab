"""pyarrow without its import of pandas, in a process that hands it no pandas objects.

The first time pyarrow converts Python values (`pa.array([...])`, a compute function given a
Python number) it checks whether they are pandas objects, and to check it imports pandas where
pandas is installed (Ray's dependency; common anywhere): 0.25 s of the short bench job's 6 s
here, pandas 3.1. `settle()` makes that first check while pandas cannot be imported, so that
pyarrow notes "no pandas" for those implicit checks; an explicit use (`Table.to_pandas`) still
imports pandas, pyarrow trying again there (pyarrow's pandas-shim.pxi, 14 to 26).

For `batchllm run` on one process only (cli.py): Ray Data hands pyarrow pandas objects, and a
Python caller's process may too.
"""

from __future__ import annotations

import sys

import pyarrow as pa


def settle() -> bool:
    """pyarrow's check for pandas made without importing it; False where pandas is imported
    already (nothing left to save)."""
    if "pandas" in sys.modules:
        return False
    sys.meta_path.insert(0, _NoPandas)  # `import pandas` raises meanwhile
    try:
        pa.array([0])  # the first conversion of a Python value: the check
    finally:
        sys.meta_path.remove(_NoPandas)
    return True


class _NoPandas:
    """A finder that refuses pandas (None in sys.modules would not do: pyarrow's Cython import
    takes the None as the module)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("pandas: not imported while pyarrow checks", name=name)
