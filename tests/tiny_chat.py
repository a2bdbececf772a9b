"""A tiny byte-level tokenizer with a chat template, and a scripted tiny model, for text and server tests.

byte_tokenizer(): token id b < 256 is the byte b (GPT-2's byte-level alphabet, no merges), so any
text encodes and a multi-byte UTF-8 character always spans several tokens; then three special
tokens and a Qwen-style chat template.

scripted_model(script): a real tiny Qwen2 (PackedCausalLM-loadable) whose greedy continuation of
a token t is the token after t in `script` (attention and MLP outputs are zero, so the residual
stream is the last token's embedding and the output head maps it to its successor). Its output
is known in advance, which is what text tests need; batching tests use random models instead.
"""

from __future__ import annotations

import torch

from specav.detokenize import bytes_to_unicode

ENDOFTEXT, IM_START, IM_END = 256, 257, 258
BYTE_VOCAB = 259
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def script_ids(text: str) -> list[int]:
    """Byte tokens of `text`; each byte may appear once (the scripted model maps a token to one successor)."""
    ids = list(text.encode("utf-8"))
    if len(set(ids)) != len(ids):
        raise ValueError(f"script {text!r} repeats a byte; the scripted model needs each token once")
    return ids


def scripted_model(script: list[int], vocab: int = BYTE_VOCAB, end: int = IM_END, hidden: int = 64,
                   margin: float = 12.0, seed: int = 0):
    """A tiny Qwen2 whose argmax after script[i] is script[i + 1] (after the last, `end`).

    Logit margins are about `margin`, so sampling at temperature 1 follows the script too, mostly.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                         bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    embed = embed / embed.norm(dim=-1, keepdim=True) * hidden ** 0.5  # RMS 1: the final norm leaves it
    head = torch.zeros(vocab, hidden)
    for t, nxt in zip(script, script[1:] + [end]):
        head[nxt] += embed[t] * (margin / hidden)  # logit of nxt after t ~ margin, others ~ N(0, margin^2 / hidden)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    return model


def save_chat_checkpoint(directory, model) -> str:
    """Write `model` with the byte tokenizer (and its chat template) as a local Hugging Face directory."""
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory)
