"""Model layer: load a checkpoint, run a packed varlen forward, manage per-request KV caches."""

from specav.models.kv_cache import KVCache
from specav.models.loader import Checkpoint, CheckpointError, check_same_vocabulary, load_checkpoint
from specav.models.packed import ForwardOutput, PackedCausalLM

__all__ = ["Checkpoint", "CheckpointError", "ForwardOutput", "KVCache", "PackedCausalLM",
           "check_same_vocabulary", "load_checkpoint"]
