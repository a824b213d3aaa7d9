"""Learning: GRPO advantages, the PPO-clip loss with off-policy correction, the Learner."""

from rlnb.config import LearnConfig
from rlnb.learn._learner import Learner, TrainBatch, collate
from rlnb.learn._loss import LossTerms, grpo_advantages, policy_loss

__all__ = ["LearnConfig", "Learner", "LossTerms", "TrainBatch", "collate", "grpo_advantages", "policy_loss"]
