"""Drafters: propose up to K draft tokens per request, with the distributions they were sampled from."""

from specav.drafting.base import DRAFTERS, Drafter, make_drafter
from specav.drafting.deferred import DeferredDrafter
from specav.drafting.draft_model import DraftModelDrafter

__all__ = ["DRAFTERS", "DeferredDrafter", "Drafter", "DraftModelDrafter", "make_drafter"]
