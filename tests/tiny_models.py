"""Tiny randomly initialised Llama / Qwen2 models for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


def tiny_hf_model(family: str = "qwen2", seed: int = 0, vocab: int = VOCAB, layers: int = 2,
                  dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer, 64-wide model with grouped-query attention (4 heads, 2 KV heads)."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  pad_token_id=0)
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=10000.0, **common))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    else:
        raise ValueError(family)
    # Larger-than-default weights so distributions are peaked enough to be interesting.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.to(dtype).eval()


def tiny_tokenizer(vocab: int = VOCAB, prefix: str = "w"):
    """A word-level tokenizer over `vocab` tokens: <pad>, <eos>, then words prefix0, prefix1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>"] + [f"{prefix}{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def save_tiny_checkpoint(directory, family: str = "qwen2", seed: int = 0, prefix: str = "w",
                         vocab: int = VOCAB) -> str:
    """Write a tiny model and tokenizer as a local Hugging Face directory; return its path."""
    model = tiny_hf_model(family, seed=seed, vocab=vocab)
    model.save_pretrained(directory)
    tiny_tokenizer(vocab, prefix).save_pretrained(directory)
    return str(directory)


def tiny_pair(vocab: int = VOCAB, noise: float = 0.05, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(target, drafter) PackedCausalLMs: the drafter is the target with perturbed weights, one layer
    fewer, and the Llama layout, so it agrees often but not always."""
    from specav.models.packed import PackedCausalLM

    target = tiny_hf_model("qwen2", seed=seed, vocab=vocab, layers=2, dtype=dtype)
    drafter = tiny_hf_model("qwen2", seed=seed, vocab=vocab, layers=2, dtype=dtype)
    drafter.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen).to(dtype) * noise)
    return PackedCausalLM(target), PackedCausalLM(drafter)


def cheap_drafting_profile():
    """A cost profile where drafting pays at once: a target token 1 s, a verified slot 0.01 s, a drafter row 0.01 s."""
    from specav.verification.cost_model import CostCurve, CostProfile

    return CostProfile(CostCurve.fit({1: 1.0, 64: 1.63}), CostCurve.fit({1: 0.01, 128: 0.5}))


def adaptive_engine(target, drafter, profile, k: int = 4, max_batch_size: int = 4):
    """An engine with adaptive verification on `drafter` (a Drafter), priced by `profile`."""
    from specav.config import EngineConfig, SpeculativeConfig
    from specav.engine.engine import Engine

    spec = SpeculativeConfig(num_speculative_tokens=k, enable_adaptive_verification=True)
    return Engine(target, tiny_tokenizer(target.vocab_size), drafter,
                  EngineConfig(speculative=spec, max_batch_size=max_batch_size), cost_profile=profile)


def make_engine(target, drafter=None, k: int = 4, max_batch_size: int = 8, eos_ids=(), tokenizer=None):
    from specav.config import EngineConfig, SpeculativeConfig
    from specav.drafting import DraftModelDrafter
    from specav.engine.engine import Engine

    spec = SpeculativeConfig(num_speculative_tokens=k) if drafter is not None else None
    config = EngineConfig(speculative=spec, max_batch_size=max_batch_size)
    d = DraftModelDrafter(drafter) if drafter is not None else None
    return Engine(target, tokenizer or tiny_tokenizer(target.vocab_size), d, config, eos_ids)
