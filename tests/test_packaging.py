"""The kernels/ folder ships as `batchllm_kernels`, never as a top-level `kernels`: that name is
Hugging Face's kernels package, which transformers imports, and ours must not stand in its way,
installed or run from the repository root (the cwd first on sys.path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THEIRS = '"""Stands for Hugging Face\'s kernels: a regular package named kernels."""\nWHOSE = 1\n'


@pytest.mark.slow  # Python in a process of its own
def test_a_kernels_package_later_on_the_path_beats_our_folder(tmp_path: Path) -> None:
    """From the repository root, `import kernels` finds an installed kernels package (here one
    on PYTHONPATH, after the cwd), while ours imports as batchllm_kernels from this tree. With
    an __init__.py at kernels/'s top, ours would be found first."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(THEIRS)
    code = ("import kernels, batchllm_kernels.cpu.build as b\n"
            "print(getattr(kernels, 'WHOSE', None), b.__file__)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["1", str(ROOT / "kernels" / "cpu" / "build.py")]


def _wheel(tmp: Path) -> Path:
    """The wheel of a copy of this tree (built outside it: setuptools writes build/ beside
    pyproject.toml)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    for folder in ("batchllm", "kernels"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, text=True)
    wheel, = (tmp / "dist").glob("batchllm-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_holds_every_file_under_batchllm_kernels_and_no_kernels(tmp_path) -> None:
    """Every .py of batchllm/ and kernels/ and the C sources are in the wheel (the package list
    in pyproject.toml is written out by hand), kernels/ as batchllm_kernels; installed, it
    imports from the install."""
    pytest.importorskip("setuptools")
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"batchllm", "batchllm_kernels"}
    ours = {p.relative_to(ROOT).as_posix() for folder in ("batchllm", "kernels")
            for pattern in ("*.py", "*.c", "*.h") for p in (ROOT / folder).rglob(pattern)}
    shipped = {("batchllm_kernels" + n[len("kernels"):]) if n.startswith("kernels/") else n
               for n in ours}
    assert shipped - names == set()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    code = "import batchllm_kernels.cpu.build as b; print(b.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True)
    assert out.stdout.strip() == str(site / "batchllm_kernels" / "cpu" / "build.py")
