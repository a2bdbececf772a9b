"""Incremental detokenization: the text of a growing token sequence, one token at a time.

Owns: turning each new output token into the text it completes, in work independent of how
long the output already is (re-decoding the whole output every step is O(n^2)), and holding
back the bytes of a character split across tokens until the character is complete (a
multi-byte UTF-8 character spread over two steps must never reach a stream as U+FFFD).

Two decoders, picked by what the tokenizer offers:

    stream   a Hugging Face fast tokenizer: the tokenizers library's own incremental decoder
             (`tokenizers.decoders.DecodeStream`), which runs the tokenizer's decoder pipeline
             over a sliding window and yields a chunk once it decodes to whole characters.
    window   any tokenizer with `decode`: the same sliding-window rule written out (decode the
             last few emitted tokens plus the new ones, emit what extends the window's text,
             wait while it ends in U+FFFD).

Both start from the prompt's last tokens as context, so a token whose text depends on what
precedes it (a SentencePiece word-start space) decodes as it reads in the full sequence.
`finish()` flushes what is still held back at the end of a request: bytes that never formed a
character come out as U+FFFD, as a full decode would show them.

`token_bytes` gives one token's own bytes (what OpenAI's logprobs report): for a byte-level
tokenizer, the bytes its token string stands for, even when they are not a whole character.

Must not know: requests, stop strings, models.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

CONTEXT_TOKENS = 6  # prompt tokens the decoder starts from, and the window the window decoder keeps
REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        ...

    def finish(self) -> str:
        """The text still held back (incomplete bytes as U+FFFD); call once, at the end."""
        ...


def make_detokenizer(tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> Detokenizer:
    """The stream decoder for a fast tokenizer, else the window decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    factory: Callable[..., Detokenizer] = StreamDetokenizer if backend is not None else WindowDetokenizer
    return factory(tokenizer, context_ids, skip_special_tokens)


class StreamDetokenizer:
    """`tokenizers.decoders.DecodeStream` over the tokenizer's backend."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(context_ids)[-CONTEXT_TOKENS:]
        self.stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.emitted: list[int] = context  # the last tokens whose text is out (a window for finish)
        self.held: list[int] = []  # tokens pushed since the last chunk

    def push(self, token_id: int) -> str:
        chunk = self.stream.step(self.backend, int(token_id))
        self.held.append(int(token_id))
        if chunk is None:
            return ""
        self.emitted = (self.emitted + self.held)[-CONTEXT_TOKENS:]
        self.held = []
        return chunk

    def finish(self) -> str:
        if all(t in self.special for t in self.held):
            return ""
        return _tail(self.tokenizer, self.emitted, self.held, self.skip_special_tokens)


class WindowDetokenizer:
    """The sliding-window rule for tokenizers without an incremental decoder."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.emitted = list(context_ids)[-CONTEXT_TOKENS:]
        self.held: list[int] = []

    def push(self, token_id: int) -> str:
        self.held.append(int(token_id))
        text = _tail(self.tokenizer, self.emitted, self.held, self.skip_special_tokens)
        if text.endswith(REPLACEMENT):
            return ""  # the last character is not complete yet
        self.emitted = (self.emitted + self.held)[-CONTEXT_TOKENS:]
        self.held = []
        return text

    def finish(self) -> str:
        return _tail(self.tokenizer, self.emitted, self.held, self.skip_special_tokens) if self.held else ""


def _tail(tokenizer, context: list[int], new: list[int], skip_special_tokens: bool) -> str:
    """Text that `new` adds after `context` (both token ids)."""
    before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens) if context else ""
    return tokenizer.decode(context + new, skip_special_tokens=skip_special_tokens)[len(before):]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes of one token: exact for byte-level tokenizers, else its decoded text in UTF-8."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in repr(backend.decoder):
        piece = backend.id_to_token(int(token_id))
        if piece is not None and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
    return tokenizer.decode([int(token_id)]).encode("utf-8")
