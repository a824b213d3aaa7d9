"""Learning: the Learner (one update by the algorithm of its config, from
:mod:`rlnb.algorithms`), the Trainer that runs the step loop, and GRPO's advantages
and PPO-clip loss as standalone functions (``grpo_advantages``, ``policy_loss``:
the default algorithm's, to compute by hand)."""

from rlnb.config import LearnConfig
from rlnb.learn._learner import Learner, TrainBatch, collate
from rlnb.learn._loss import LossTerms, grpo_advantages, policy_loss
from rlnb.learn._progress import progress_bar
from rlnb.learn._rank_group import LearnerStatistics, RankedLearner, RankStatistics
from rlnb.learn._trainer import Callback, Trainer, TrainingStatistics
from rlnb.learn._warmup import Warmup
from rlnb.learn._whatif import BatchOrigin, KeptBatch, WhatIf, advantages_of, vocabulary_digest, what_if

__all__ = [
    "BatchOrigin",
    "Callback",
    "KeptBatch",
    "LearnConfig",
    "LearnerStatistics",
    "Learner",
    "LossTerms",
    "RankStatistics",
    "RankedLearner",
    "TrainBatch",
    "Trainer",
    "TrainingStatistics",
    "Warmup",
    "WhatIf",
    "advantages_of",
    "collate",
    "grpo_advantages",
    "policy_loss",
    "progress_bar",
    "vocabulary_digest",
    "what_if",
]
