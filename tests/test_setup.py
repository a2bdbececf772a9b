"""Installing: scripts/setup.sh stops loudly on a failing pip and marks nothing installed; benchmark-only
dependencies are an extra, and a benchmark missing one says what to install."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fake_checkout(tmp_path: Path, pip_exit: int) -> Path:
    """A copy of scripts/setup.sh and pyproject.toml with a .venv whose pip exits with `pip_exit`."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "pip").write_text(f"#!/bin/sh\necho 'WARNING: Location x is ignored' >&2\n"
                                 f"[ {pip_exit} -ne 0 ] && echo 'ERROR: No matching distribution' >&2\nexit {pip_exit}\n")
    (bin_dir / "python").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("pip_exit", [1, 0])
def test_pip_failure_stops_setup_and_success_marks_it_installed(tmp_path, pip_exit):
    root = fake_checkout(tmp_path, pip_exit)
    result = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)
    stamp = root / ".venv" / ".specav-installed"
    assert "WARNING: Location" not in result.stderr
    if pip_exit:
        assert result.returncode == 1
        assert "ERROR: No matching distribution" in result.stderr and "failed (exit status 1)" in result.stderr
        assert not stamp.exists()
    else:
        assert result.returncode == 0, result.stderr
        assert stamp.exists() and "dependencies installed" in result.stderr


def test_a_missing_benchmark_dependency_says_what_to_install(monkeypatch):
    import importlib

    from specav.bench import optional

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name == "psutil" else real(name, *a))
    with pytest.raises(SystemExit, match=r"specav bench forward needs psutil.*pip install 'psutil>=5.9'.*\[bench\]"):
        optional.require("psutil", "specav bench forward")


def test_psutil_is_a_benchmark_extra_and_python_is_not_capped():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("psutil") for dep in project["dependencies"])
    assert any(dep.startswith("psutil") for dep in project["optional-dependencies"]["bench"])
    assert project["requires-python"] == ">=3.11"
