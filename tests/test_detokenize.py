"""Incremental detokenization: whole characters only, the same text as a full decode, bounded work per token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specav.detokenize import CONTEXT_TOKENS, REPLACEMENT, StreamDetokenizer, WindowDetokenizer, make_detokenizer
from tests.tiny_chat import ENDOFTEXT, IM_END, IM_START, byte_tokenizer
from tests.tiny_models import tiny_tokenizer

DECODERS = [StreamDetokenizer, WindowDetokenizer]
TOKENIZER = byte_tokenizer()


def run(decoder, tokenizer, ids, context=()):
    d = decoder(tokenizer, list(context))
    chunks = [d.push(t) for t in ids]
    return chunks, d.finish()


def full_decode_tail(tokenizer, ids, context=()):
    before = tokenizer.decode(list(context), skip_special_tokens=True)
    return tokenizer.decode(list(context) + list(ids), skip_special_tokens=True)[len(before):]


def test_a_fast_tokenizer_gets_the_tokenizers_library_decoder():
    assert isinstance(make_detokenizer(TOKENIZER), StreamDetokenizer)

    class Slow:  # a tokenizer with decode only
        def decode(self, ids, skip_special_tokens=True):
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    assert isinstance(make_detokenizer(Slow()), WindowDetokenizer)


@pytest.mark.parametrize("decoder", DECODERS)
def test_multi_byte_characters_split_across_tokens_come_out_whole(decoder):
    text = "Grüße, 東京! café €5 🙂"
    ids = TOKENIZER.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: every multi-byte character is split
    chunks, tail = run(decoder, TOKENIZER, ids)
    assert not any(REPLACEMENT in c for c in chunks)
    assert "".join(chunks) + tail == text and tail == ""
    # a character's text appears exactly when its last byte arrives
    assert chunks[ids.index(0xBC)] == "ü" and chunks[ids.index(0xBC) - 1] == ""


@pytest.mark.parametrize("decoder", DECODERS)
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 255), st.sampled_from([ENDOFTEXT, IM_START, IM_END])), max_size=40),
       context=st.lists(st.integers(32, 126), max_size=8))
def test_streamed_text_equals_a_full_decode_of_any_byte_sequence(decoder, ids, context):
    """Random bytes include invalid UTF-8: held back while they could still form a character, shown
    as U+FFFD once they cannot, or at the end (finish), exactly as a full decode shows them."""
    chunks, tail = run(decoder, TOKENIZER, ids, context)
    assert "".join(chunks) + tail == full_decode_tail(TOKENIZER, ids, context)


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_prompt_context_decides_word_spacing(decoder):
    """A word-piece decoder joins words with spaces: the first output word follows the prompt's last."""
    tok = tiny_tokenizer()
    chunks, tail = run(decoder, tok, [7, 1, 8, 9], context=[5, 6])
    assert "".join(chunks) + tail == " w5 w6 w7" == full_decode_tail(tok, [7, 1, 8, 9], [5, 6])
    chunks, tail = run(decoder, tok, [7, 8], context=[])
    assert "".join(chunks) == "w5 w6"


def test_work_per_token_does_not_grow_with_the_output():
    """The window decoder decodes at most CONTEXT_TOKENS + the held tokens per push, however long the output."""
    seen = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = TOKENIZER.encode("東京 " * 200)
    d = WindowDetokenizer(Counting(), [])
    assert "".join(d.push(t) for t in ids) == "東京 " * 200
    assert max(seen) <= CONTEXT_TOKENS + 3  # three-byte characters: at most two held tokens plus the new one
