"""specav: speculative decoding with adaptive verification.

    from specav import LLM, SamplingParams

`import specav` stays light: `LLM` (which imports torch and the engine) loads on first use.
"""

from specav.config import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from specav.llm import LLM

        return LLM
    raise AttributeError(f"module 'specav' has no attribute {name!r}")
