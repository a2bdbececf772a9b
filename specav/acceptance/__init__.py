"""Acceptance prediction: slot features, the online estimator, and the Scorer protocol."""

from specav.acceptance.estimator import (
    NewtonStep,
    OnlineAcceptanceEstimator,
    RefitOutcome,
    RefitResult,
    newton_step,
    survival,
)
from specav.acceptance.features import (
    FEATURES,
    FeatureSpec,
    LossyFeatureError,
    SlotFeatures,
    compute_slot_features,
    entropy,
    features_from_tails,
    logit_q_max,
    q_max,
    q_sampled,
    require_lossless,
    top2_margin,
)
from specav.acceptance.scorer import Scorer, make_scorer

__all__ = [
    "FEATURES", "FeatureSpec", "LossyFeatureError", "NewtonStep", "OnlineAcceptanceEstimator",
    "RefitOutcome", "RefitResult", "Scorer", "SlotFeatures", "compute_slot_features", "entropy",
    "features_from_tails", "logit_q_max", "make_scorer", "newton_step", "q_max", "q_sampled", "require_lossless",
    "survival", "top2_margin",
]
