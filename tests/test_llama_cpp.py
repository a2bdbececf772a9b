"""The llama.cpp peer's pure parts: flag choice, cache key, fault detection, source unpacking, parsers.

Nothing here compiles or runs llama.cpp; the outputs parsed are excerpts of what the tools
printed on this project's machines (llama.cpp 0c1e570, vendored in llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import io
import json
import signal
import tarfile

import pytest

from specav.bench.llama_cpp import (COMMIT_FILE, VARIANTS, LlamaCppBuildError, candidate_variants, cache_key,
                                    cpu_flags, is_fault, unpack_vendored)
from specav.bench.llama_cpp_tools import (completion_command, parse_bench_json, parse_completion_log,
                                          parse_speculative_log, speculative_command)

AVX2_ONLY = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 avx2 bmi2"
AVX512 = AVX2_ONLY + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16"
AMX = AVX512 + " amx_bf16 amx_tile amx_int8"


def cpuinfo(flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n" \
           f"processor\t: 1\nflags\t\t: {flags} extra_on_cpu1\n"


def test_cpu_flags_reads_the_first_processor():
    flags = cpu_flags(cpuinfo(AVX2_ONLY))
    assert {"avx2", "fma", "bmi2"} <= flags and "extra_on_cpu1" not in flags
    assert cpu_flags("no flags line") == frozenset()


@pytest.mark.parametrize("flags, expected", [
    (AVX2_ONLY, ["native", "avx2"]),
    (AVX512, ["native", "avx512-vnni", "avx2"]),
    (AMX, ["native", "avx512-vnni", "avx2"]),  # AMX never gets an explicit variant: native is the only one
    ("fpu sse sse2", ["native"]),  # no AVX2: only what the compiler's native flags make of it
])
def test_variants_follow_the_cpu_flags_native_first(flags, expected):
    assert [v.name for v in candidate_variants(cpu_flags(cpuinfo(flags)))] == expected


def test_explicit_variants_turn_native_and_amx_off():
    for variant in VARIANTS[1:]:
        assert "-DGGML_NATIVE=OFF" in variant.cmake_flags
        assert all(f"-DGGML_AMX_{unit}=OFF" in variant.cmake_flags for unit in ("TILE", "INT8", "BF16"))
    by_name = {v.name: v for v in VARIANTS}
    assert "-DGGML_AVX512_VNNI=ON" in by_name["avx512-vnni"].cmake_flags
    assert "-DGGML_AVX512=OFF" in by_name["avx2"].cmake_flags


def test_cache_key_names_the_build_and_changes_with_what_shapes_it():
    native, avx2 = VARIANTS[0], VARIANTS[-1]
    key = cache_key("0.3.36", native, "g++ 12.2.0")
    assert key.startswith("0.3.36-native-") and key == cache_key("0.3.36", native, "g++ 12.2.0")
    others = {cache_key("0.3.37", native, "g++ 12.2.0"), cache_key("0.3.36", avx2, "g++ 12.2.0"),
              cache_key("0.3.36", native, "g++ 13.1.0")}
    assert key not in others and len(others) == 3


@pytest.mark.parametrize("code, fault", [
    (-int(signal.SIGILL), True), (-int(signal.SIGSEGV), True), (-int(signal.SIGBUS), True),
    (128 + int(signal.SIGILL), True),  # through a shell
    (-int(signal.SIGABRT), False),  # an assertion is not an instruction the CPU refuses
    (0, False), (1, False), (-int(signal.SIGTERM), False)])
def test_is_fault(code, fault):
    assert is_fault(code) is fault


def _tarball(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_unpack_vendored_keeps_only_the_source_and_records_the_commit(tmp_path):
    commit = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    sdist = _tarball(tmp_path / "llama_cpp_python-0.3.36.tar.gz", {
        "llama_cpp_python-0.3.36/pyproject.toml": b"[project]",
        "llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp/HEAD": commit.encode() + b"\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": b"project(llama.cpp)",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/src/llama.cpp": b"int x;"})
    source = unpack_vendored(sdist, tmp_path / "out")
    assert (source / "CMakeLists.txt").exists() and (source / "src" / "llama.cpp").exists()
    assert not (source / ".git").exists()
    assert (source / COMMIT_FILE).read_text() == commit
    assert not (tmp_path / "out" / "llama_cpp_python-0.3.36" / "pyproject.toml").exists()
    empty = _tarball(tmp_path / "empty.tar.gz", {"llama_cpp_python-0.3.36/pyproject.toml": b""})
    with pytest.raises(LlamaCppBuildError, match="no vendor/llama.cpp"):
        unpack_vendored(empty, tmp_path / "out2")


# ---------------------------------------------------------------- the tools' output

BENCH_JSON = json.dumps([
    {"n_prompt": 5, "n_gen": 0, "n_depth": 128, "samples_ns": [523632812, 525771882, 530000000], "avg_ts": 9.53},
    {"n_prompt": 16, "n_gen": 0, "n_depth": 128, "samples_ns": [1103746045, 599692254, 600000000], "avg_ts": 20.6},
    {"n_prompt": 0, "n_gen": 16, "n_depth": 128, "samples_ns": [4591758104, 2247990552, 800000000], "avg_ts": 5.3}])

COMPLETION_LOG = """\
0.08.604.186 I common_perf_print:        load time =    3388.76 ms
0.08.604.199 I common_perf_print: prompt eval time =    3388.47 ms /    26 tokens (  130.33 ms per token,     7.67 tokens per second)
0.08.604.211 I common_perf_print:        eval time =    3681.06 ms /     7 runs   (  525.87 ms per token,     1.90 tokens per second)
0.08.604.222 I common_perf_print:       total time =    7093.88 ms /    33 tokens
"""

SPECULATIVE_LOG = """\
0.18.822.068 I encoded   26 tokens in    3.320 seconds, speed:    7.831 t/s
0.18.822.087 I decoded   11 tokens in    8.329 seconds, speed:    1.321 t/s
0.18.822.113 I n_draft   = 4
0.18.822.126 I n_predict = 11
0.18.822.139 I n_drafted = 11
0.18.822.151 I n_accept  = 7
0.18.822.165 I accept    = 63.636%
0.18.822.310 I common_perf_print: prompt eval time =   10278.59 ms /    42 tokens (  244.73 ms per token,     4.09 tokens per second)
"""


def test_parse_bench_json_takes_medians_per_test():
    rates = parse_bench_json(BENCH_JSON)
    assert rates.depth == 128
    assert rates.decode_ms == pytest.approx(2247.990552 / 16)
    assert rates.batch_ms == pytest.approx({5: 525.771882, 16: 600.0})
    assert rates.decode_tps == pytest.approx(16e3 / 2247.990552)
    records = json.loads(BENCH_JSON)
    with pytest.raises(ValueError, match="several depths"):
        parse_bench_json(json.dumps(records + [dict(records[0], n_depth=0)]))
    with pytest.raises(ValueError, match="no token-generation"):
        parse_bench_json(json.dumps(records[:2]))


def test_parse_completion_log():
    run = parse_completion_log(COMPLETION_LOG)
    assert (run.tokens, run.seconds, run.prompt_tokens) == (7, pytest.approx(3.68106), 26)
    assert run.tokens_per_s == pytest.approx(7 / 3.68106)
    with pytest.raises(ValueError, match="eval time"):
        parse_completion_log("nothing")


def test_parse_speculative_log():
    run = parse_speculative_log(SPECULATIVE_LOG)
    assert (run.tokens, run.seconds, run.prompt_tokens, run.drafted, run.accepted) == (11, 8.329, 26, 11, 7)
    with pytest.raises(ValueError, match="accepted"):
        parse_speculative_log(SPECULATIVE_LOG.replace("n_accept", "n_acc"))


def test_commands_are_greedy_static_k_and_read_the_prompt_verbatim(tmp_path):
    from pathlib import Path

    from specav.bench.llama_cpp import LlamaCppTools

    tools = LlamaCppTools(tmp_path, "0.3.36", "native", ("-DGGML_NATIVE=ON",), "unknown")
    spec = speculative_command(tools, Path("t.gguf"), Path("d.gguf"), Path("p.txt"), 48, 4, 2)
    pairs = dict(zip(spec[1::2], spec[2::2])) | dict(zip(spec[2::2], spec[3::2]))
    assert pairs["--temp"] == "0" and pairs["--spec-draft-n-max"] == "4" and pairs["--spec-draft-p-min"] == "0"
    assert pairs["--spec-type"] == "draft-simple" and pairs["-td"] == "2" and pairs["-t"] == "2"
    assert "--no-escape" in spec and "--ignore-eos" in spec
    completion = completion_command(tools, Path("t.gguf"), Path("p.txt"), 48, 2)
    assert {"--no-escape", "-no-cnv", "--ignore-eos"} <= set(completion)
    assert completion[0].endswith("bin/llama-completion")
