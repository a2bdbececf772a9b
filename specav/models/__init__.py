"""Model layer: load a checkpoint, run a packed varlen forward, manage per-request KV caches."""

from specav.models.cache import CacheError, cache_root
from specav.models.checkpoint_info import CheckpointInfo, GenerationDefaults, generation_defaults, inspect_checkpoint
from specav.models.kv_cache import KVCache
from specav.models.loader import (Checkpoint, CheckpointError, check_checkpoint, check_same_vocabulary,
                                  load_checkpoint)
from specav.models.packed import ForwardOutput, PackedCausalLM

__all__ = ["CacheError", "Checkpoint", "CheckpointError", "CheckpointInfo", "ForwardOutput", "GenerationDefaults",
           "KVCache", "PackedCausalLM", "cache_root", "check_checkpoint", "check_same_vocabulary",
           "generation_defaults", "inspect_checkpoint", "load_checkpoint"]
