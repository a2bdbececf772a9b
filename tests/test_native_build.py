"""The native kernels' build and choice: the safe probe and its fallbacks, the cache, the build lock.

Builds here compile a one-line C++ file (a fake variant), so they take a second, not the real
kernels' 40; the choice between the real variants reuses their cached builds and probes.
"""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specav.models import native
from specav.models.native import build, probe, schedule, selftest
from specav.models.native.variants import BY_NAME, VARIANTS, Variant

ROOT = Path(__file__).resolve().parents[1]
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
_names = itertools.count()


@pytest.fixture
def fake(tmp_path):
    """A variant of one tiny source (a fresh name per test: torch renames a rebuilt extension)."""
    source = tmp_path / "fake.cpp"
    source.write_text('extern "C" int specav_fake() { return 7; }\n')
    variant = Variant(f"fake{os.getpid()}x{next(_names)}", (), ())
    return variant, [source]


def build_fake(fake, root: Path) -> Path:
    variant, sources = fake
    return build.build(variant, root, sources=sources, headers=[])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# ---------------------------------------------------------------- choosing a variant

def test_a_machine_without_the_wide_units_runs_the_avx2_path():
    """The feature bits masked as on an AVX2-only CPU: the AVX-512 variant is not even built, the
    AVX2 one (built and self-tested here, in a child, if not already) is chosen."""
    flags = probe.cpu_flags()
    if BY_NAME["avx2"].missing(flags):
        pytest.skip(f"this CPU lacks {BY_NAME['avx2'].missing(flags)}")
    chosen, reasons = native.choose(flags - AVX512)
    assert chosen is BY_NAME["avx2"]
    assert reasons == {"avx512vnni": "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni"}
    assert native.variant_ops("avx2", flags - AVX512).isa().startswith("avx2")


def test_this_machine_runs_its_best_variant():
    flags = probe.cpu_flags()
    best = next(v for v in VARIANTS if not v.missing(flags))
    assert native.selected() is best, native.unavailable_reason()
    assert native.ops() is getattr(torch.ops, best.namespace)


def fake_children(outcomes: dict[str, str], calls: list[str]):
    """A child command per variant: "sigill" dies as a faulting instruction would, "wrong" reports a
    failed self-test, "build" a failed build, "ok" passes."""
    scripts = {
        "sigill": "import os, signal; os.kill(os.getpid(), signal.SIGILL)",
        "wrong": "print('{\"ok\": false, \"stage\": \"selftest\", \"reason\": \"its self-test failed: off by 3%\"}'); exit(1)",
        "build": "print('{\"ok\": false, \"stage\": \"build\", \"reason\": \"no compiler\"}'); exit(1)",
        "ok": "print('{\"ok\": true}')",
    }

    def child(variant: Variant, root: Path | None) -> list[str]:
        calls.append(variant.name)
        return [sys.executable, "-c", scripts[outcomes[variant.name]]]

    return child


@pytest.mark.parametrize("failure,reason", [("sigill", "killed by SIGILL"), ("wrong", "off by 3%")])
def test_a_variant_that_fails_its_self_test_is_never_used(tmp_path, failure, reason):
    calls = []
    child = fake_children({"avx512vnni": failure, "avx2": "ok"}, calls)
    every_flag = set().union(*(v.cpu_flags for v in VARIANTS))

    def probe_here(variant, flags):
        return probe.probe(variant, flags, root=tmp_path, child=child)

    chosen, reasons = native.choose(every_flag, probe=probe_here)
    assert chosen is BY_NAME["avx2"] and reason in reasons["avx512vnni"]
    assert calls == ["avx512vnni", "avx2"]
    # The failure is kept beside the build: later processes neither retry nor use the variant.
    calls.clear()
    chosen, reasons = native.choose(every_flag, probe=probe_here)
    assert chosen is BY_NAME["avx2"] and reason in reasons["avx512vnni"] and "avx512vnni" not in calls


def test_a_failed_build_is_retried_later(tmp_path):
    """A build failure is not kept: installing the compiler must be enough."""
    calls = []
    outcomes = {"avx2": "build"}
    child = fake_children(outcomes, calls)
    flags = set(BY_NAME["avx2"].cpu_flags)
    first = probe.probe(BY_NAME["avx2"], flags, root=tmp_path, child=child)
    assert not first.ok and first.reason == "no compiler"
    outcomes["avx2"] = "ok"
    assert probe.probe(BY_NAME["avx2"], flags, root=tmp_path, child=child).ok and calls == ["avx2", "avx2"]


def test_the_self_test_catches_a_wrong_kernel():
    """Negative control of the child's own check: a matmul off by 0.1% fails it."""
    ops = native.ops()

    class Off:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def kq_matmul(x, weights, qtypes, biases):
            return [y * 1.001 for y in ops.kq_matmul(x, weights, qtypes, biases)]

    import numpy as np

    selftest.check_matmul(ops, np.random.default_rng(0))
    with pytest.raises(AssertionError, match="relative error"):
        selftest.check_matmul(Off(), np.random.default_rng(0))


# ---------------------------------------------------------------- the build and its cache

def test_build_reports_progress_once_and_reuses_the_library(tmp_path, fake, capfd):
    library = build_fake(fake, tmp_path)
    err = capfd.readouterr().err
    assert f"building the native kernels ({fake[0].name}) in {tmp_path}" in err
    assert f"built the native kernels ({fake[0].name}) in " in err
    assert library.exists() and library.parent.parent == tmp_path
    assert build_fake(fake, tmp_path) == library
    assert capfd.readouterr().err == ""  # found built: prints nothing


def test_the_build_lives_under_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECAV_CACHE", str(tmp_path / "elsewhere"))
    assert build.build_directory(BY_NAME["avx2"]).parent == tmp_path / "elsewhere" / "native"


def test_an_unwritable_cache_gives_a_clear_message(tmp_path, fake, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # where the cache should be a directory
    with pytest.raises(build.NativeBuildError, match=r"cannot be built in .*a-file.*SPECAV_CACHE"):
        build_fake(fake, blocker / "cache")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(build.NativeBuildError, match=r"\(Read-only file system\); make the cache writable"):
        build_fake(fake, tmp_path / "ro")


def test_an_unwritable_cache_falls_back_to_torch_kernels_with_a_warning(tmp_path):
    """A fresh process whose cache cannot be written: a warning naming the cache, then the model
    loads and runs on torch's kernels instead of crashing."""
    from tests.test_quant import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "a-file").write_text("")
    code = ("from specav.models import native\nfrom specav.models.quant import load_quantized\n"
            f"m = load_quantized({str(path)!r}, 'q4', None)\n"
            "y = m.forward([[1, 2, 3]], [m.new_cache()], [1]).logits\n"
            "kernels = {k for mod in m.hf_model.modules() for k in getattr(mod, 'packed', {})}\n"
            "print(native.available(), type(m.ops).__name__, sorted(kernels), bool(y.isfinite().all()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env(), "SPECAV_CACHE": str(tmp_path / "a-file" / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "native kernels unavailable" in done.stderr and "cannot be built in" in done.stderr
    assert "using torch's kernels" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout.startswith("False TorchLayerOps") and "kquant" not in done.stdout
    assert done.stdout.strip().endswith("True")  # finite logits


def _hold_lock(directory: Path) -> subprocess.Popen:
    """A process that takes the build lock, leaves torch's lock file as a build in progress does,
    and waits (to be killed)."""
    code = ("import sys, time\nfrom pathlib import Path\nfrom specav.models.native import build\n"
            f"d = Path({str(directory)!r})\n"
            "with build._build_lock(d):\n    (d / 'lock').write_text('')\n    print('locked', flush=True)\n"
            "    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env())
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_build_killed_midway_does_not_hold_the_next_run(tmp_path, fake, monkeypatch):
    variant, sources = fake
    directory = build.build_directory(variant, tmp_path, sources, [])
    directory.mkdir(parents=True)
    holder = _hold_lock(directory)
    monkeypatch.setattr(build, "LOCK_TIMEOUT_S", 2.0)
    # Negative control: while the owner lives, the next build waits, then gives up naming it.
    with pytest.raises(build.NativeBuildError, match="gave up waiting"):
        build_fake(fake, tmp_path)
    assert (directory / "build.lock").read_text().split()[0] == str(holder.pid)
    holder.kill()  # SIGKILL mid-build: torch's lock file stays behind
    holder.wait()
    assert (directory / "lock").exists()
    library = build_fake(fake, tmp_path)  # neither lock holds it: it builds at once
    assert library.exists() and not (directory / "lock").exists()


def test_a_lock_file_of_a_dead_pid_is_no_lock(tmp_path, fake, monkeypatch):
    variant, sources = fake
    directory = build.build_directory(variant, tmp_path, sources, [])
    directory.mkdir(parents=True)
    (directory / "build.lock").write_text("999999999 some-host 0\n")
    (directory / "lock").write_text("")  # torch's, from a build that died
    monkeypatch.setattr(build, "LOCK_TIMEOUT_S", 2.0)
    assert build_fake(fake, tmp_path).exists()


# ---------------------------------------------------------------- the loop schedule

class _ScheduleOps:
    """Stands in for a variant's ops where only set_schedule matters (measure_fn is injected)."""

    def __init__(self, default: int) -> None:
        self.current = default

    def set_schedule(self, s: int) -> int:
        before = self.current
        if s >= 0:
            self.current = s
        return before


def test_the_default_schedule_stays_unless_another_is_clearly_faster():
    # two cases each; schedule 3 the default
    assert schedule.choose({0: [1.0, 1.0], 1: [0.97, 0.99], 3: [1.0, 1.0]}, default=3) == 3  # 2% faster: noise
    assert schedule.choose({0: [0.7, 1.1], 1: [0.8, 0.9], 3: [1.0, 1.0]}, default=3) == 1  # 15% faster on average
    assert schedule.choose({0: [2.0, 2.0], 3: [1.0, 1.0]}, default=3) == 3


def test_the_schedule_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECAV_NATIVE_SCHEDULE", raising=False)
    calls = []

    def measure_fn(ops):
        calls.append(ops.current)
        return {0: [1.0], 1: [0.6], 2: [1.0], 3: [1.0]}

    ops = _ScheduleOps(default=3)
    assert schedule.apply(ops, tmp_path, {"avx2"}, measure_fn) == 1 and ops.current == 1
    later = _ScheduleOps(default=3)  # another process on the same machine
    assert schedule.apply(later, tmp_path, {"avx2"}, measure_fn) == 1 and later.current == 1
    assert calls == [3]
    other_machine = _ScheduleOps(default=3)
    schedule.apply(other_machine, tmp_path, {"avx2", "avx512f"}, measure_fn)
    assert len(calls) == 2


def test_a_forced_schedule_is_run_and_nothing_is_measured(tmp_path, monkeypatch):
    def measure_fn(ops):
        raise AssertionError("measured")

    monkeypatch.setenv("SPECAV_NATIVE_SCHEDULE", "2")
    ops = _ScheduleOps(default=3)
    assert schedule.apply(ops, tmp_path, {"avx2"}, measure_fn) == 2 and ops.current == 2
    monkeypatch.setenv("SPECAV_NATIVE_SCHEDULE", "9")
    with pytest.raises(ValueError, match="SPECAV_NATIVE_SCHEDULE=.9."):
        schedule.apply(ops, tmp_path, {"avx2"}, measure_fn)


@pytest.mark.skipif(not native.available(), reason="needs a native variant")
def test_measuring_times_every_schedule_and_leaves_the_schedule_as_it_was():
    ops = native.ops()
    before = ops.set_schedule(-1)
    times = schedule.measure(ops, repeats=1)
    assert set(times) == set(schedule.SCHEDULES)
    assert all(len(t) == len(schedule.SHAPES) * len(schedule.ROWS) and min(t) > 0 for t in times.values())
    assert ops.set_schedule(-1) == before
