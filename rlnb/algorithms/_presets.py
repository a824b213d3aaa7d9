"""The published algorithms as :class:`Algorithm` presets, each with its formula and
source (paper, and the TRL / verl option it matches). Notation: ``R_i`` sample i's
reward, ``mean_g``/``std_g`` its group's, ``r_t = pi(y_t) / pi_prox(y_t)`` the PPO
ratio, ``w_t`` the mismatch weight, ``A`` the advantage, ``|y_i|`` the tokens trained
on in sample i."""

from __future__ import annotations

import dataclasses
import difflib
from types import MappingProxyType

from rlnb._errors import UnknownNameError
from rlnb.algorithms._algorithm import Algorithm

__all__ = ["DEFAULT", "PRESETS", "Preset", "algorithms", "preset"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named :class:`Algorithm` with what it is: ``summary`` (one line), ``formula``
    and ``source`` (the paper, and the TRL / verl settings it matches)."""

    name: str
    algorithm: Algorithm
    summary: str
    formula: str
    source: str


_ALL = (
    Preset(
        "grpo",
        Algorithm(),
        "GRPO as rlnb has always run it: group mean/std (population), token PPO-clip 0.2, token-mean",
        "A_i = (R_i - mean_g) / (std_g + 1e-6), std over G (0 for a flat group); "
        "loss = sum_t -w_t min(r_t A, clip(r_t, 0.8, 1.2) A) / (tokens in the update); "
        "w_t = min(pi_prox/pi_behav, 2)",
        "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 (which averages per sequence first). "
        "TRL: loss_type='bnpo'/'dapo' (token-mean), scale_rewards='group', but Bessel's std; "
        "verl: adv_estimator=grpo, loss_agg_mode=token-mean, but Bessel's std and dual clip c=3",
    ),
    Preset(
        "dr_grpo",
        Algorithm(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm"),
        "Dr. GRPO: centred rewards (no std), loss summed and divided by a constant (samples x max length)",
        "A_i = R_i - mean_g; loss = sum_i sum_t -w_t min(r_t A, clip(r_t) A) / (N * L_max)",
        "Liu et al. 2025, Understanding R1-Zero-Like Training, arXiv:2503.20783. "
        "TRL: loss_type='dr_grpo', scale_rewards='none'; verl: norm_adv_by_std_in_grpo=False, "
        "loss_agg_mode=seq-mean-token-sum-norm (verl divides by L_max only)",
    ),
    Preset(
        "dapo",
        Algorithm(
            std="bessel",
            clip_high=0.28,
            drop_flat_groups=True,
            dynamic_sampling=True,
            mask_truncated=True,
        ),
        "DAPO: clip-higher 0.2/0.28, token-mean, dynamic sampling of groups with signal, truncated masked",
        "A_i = (R_i - mean_g) / (std_g + 1e-6), Bessel's std; "
        "loss = sum_t -w_t min(r_t A, clip(r_t, 0.8, 1.28) A) / tokens; flat groups dropped and refilled; "
        "completions cut at the length limit not trained on (DAPO's overlong filtering)",
        "Yu et al. 2025, DAPO, arXiv:2503.14476. TRL: loss_type='dapo', epsilon_high=0.28, "
        "mask_truncated_completions=True; verl: clip_ratio_high=0.28, filter_groups.enable=True",
    ),
    Preset(
        "gspo",
        Algorithm(std="bessel", loss="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"),
        "GSPO: sequence-level ratio (geometric mean over tokens), clipped at 3e-4/4e-4, sequence-mean",
        "s_i = exp(mean_t (log pi - log pi_prox)); loss_i = -w min(s_i A_i, clip(s_i, 1-3e-4, 1+4e-4) A_i); "
        "token form: s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)]; loss = mean_i",
        "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071. "
        "TRL: importance_sampling_level='sequence', epsilon=3e-4, epsilon_high=4e-4; "
        "verl: policy_loss.loss_mode=gspo, clip_ratio_low=3e-4, clip_ratio_high=4e-4, "
        "loss_agg_mode=seq-mean-token-mean",
    ),
    Preset(
        "cispo",
        Algorithm(std="bessel", loss="cispo", clip_low=1.0, clip_high=4.0),
        "CISPO: REINFORCE weighted by the clipped, detached IS ratio (at most 5), token-mean",
        "loss = sum_t -w_t sg[clip(r_t, 0, 5)] A log pi(y_t) / tokens",
        "MiniMax 2025, MiniMax-M1, arXiv:2506.13585; bound 5 as ScaleRL, arXiv:2510.13786. "
        "TRL: loss_type='cispo', epsilon_high=5.0 (an absolute bound: clip_high=4.0 here); "
        "verl: policy_loss.loss_mode=cispo",
    ),
    Preset(
        "rloo",
        Algorithm(advantage="rloo"),
        "RLOO: leave-one-out baseline, R_i minus the mean of the group's others",
        "A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g) (0 for a group of one); ppo_clip 0.2, token-mean",
        "Ahmadian et al. 2024, Back to Basics, arXiv:2402.14740. TRL: RLOOTrainer; verl: adv_estimator=rloo",
    ),
    Preset(
        "reinforce_pp",
        Algorithm(advantage="reinforce_pp", std="bessel", kl_in="reward", kl_estimator="k1"),
        "REINFORCE++: rewards whitened over the batch's tokens (no group baseline), KL in the reward",
        "A_i = (R_i - mu_B) / sqrt(var_B + 1e-8), mu_B and var_B weighted by |y_i| (Bessel's); "
        "with kl_coef > 0, R_i -= kl_coef sum_t (log pi_prox - log pi_ref); ppo_clip 0.2, token-mean",
        "Hu 2025, REINFORCE++, arXiv:2501.03262. verl: adv_estimator=reinforce_plus_plus, use_kl_in_reward",
    ),
    Preset(
        "reinforce_pp_baseline",
        Algorithm(advantage="reinforce_pp_baseline", std="bessel"),
        "REINFORCE++ with a group baseline: centred by the group mean, then whitened over the batch",
        "A_i = (x_i - mu_B) / sqrt(var_B + 1e-8), x_i = R_i - mean_g, batch statistics weighted by |y_i|",
        "Hu 2025, REINFORCE++, arXiv:2501.03262. verl: adv_estimator=reinforce_plus_plus_baseline",
    ),
    Preset(
        "ppo",
        Algorithm(advantage="gae", critic="model", gamma=1.0, lam=0.95, value_clip=0.2, dual_clip=3.0),
        "PPO with a critic: GAE(1, 0.95) on a learned value model, clipped value loss, dual-clip at c=3",
        "delta_t = r_t + gamma V(s_t+1) - V(s_t), A_t = sum_l (gamma lam)^l delta_t+l, whitened over the batch's "
        "tokens; loss_t = -w_t min(r_t A_t, clip(r_t, 0.8, 1.2) A_t), and for A_t < 0 at most -3 A_t; token-mean; "
        "critic: 0.5 max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2), R = A + V_old, its own AdamW",
        "Schulman et al. 2017, arXiv:1707.06347; GAE: Schulman et al. 2016, arXiv:1506.02438; dual clip: "
        "Ye et al. 2020, arXiv:1912.09729. verl: adv_estimator=gae, clip_ratio_c=3.0; TRL: PPOTrainer "
        "(gamma 1, lam 0.95, cliprange_value 0.2)",
    ),
    Preset(
        "sapo",
        Algorithm(std="bessel", loss="sapo", aggregation="seq_mean_token_mean"),
        "SAPO: a smooth sigmoid gate on the ratio in place of the hard clip (tau 1.0 / 1.05)",
        "loss_t = -w_t (4 / tau) sigmoid(tau (r_t - 1)) A, tau = 1.0 for A > 0 and 1.05 otherwise; "
        "sequence-mean of token-means",
        "Gao et al. 2025, Soft Adaptive Policy Optimization, arXiv:2511.20347. TRL: loss_type='sapo'; "
        "verl: policy_loss.loss_mode=sapo",
    ),
    Preset(
        "gpg",
        Algorithm(advantage="gpg", loss="reinforce"),
        "GPG: plain REINFORCE on centred rewards, rescaled by the share of samples with signal",
        "A_i = alpha (R_i - mean_g), alpha = N / (N - M), M the samples in flat groups; "
        "loss = sum_t -w_t A log pi(y_t) / tokens",
        "Chu et al. 2025, GPG, arXiv:2504.02546. verl: adv_estimator=gpg, policy_loss.loss_mode=gpg "
        "(verl counts nonzero rewards for M)",
    ),
    Preset(
        "opo",
        Algorithm(advantage="opo"),
        "OPO: the length-weighted mean reward of the group as baseline (the optimal one for outcome rewards)",
        "A_i = R_i - sum_j |y_j| R_j / sum_j |y_j|; ppo_clip 0.2, token-mean",
        "Hao et al. 2025, On-Policy RL with Optimal Reward Baseline, arXiv:2505.23585. verl: adv_estimator=opo",
    ),
)

PRESETS = MappingProxyType({p.name: p for p in _ALL})
# rlnb's loss as it has always been, so that existing runs do not change.
DEFAULT = "grpo"


def algorithms() -> list[tuple[str, str]]:
    """The presets as (name, one line), in the order of the docs' table."""
    return [(p.name, p.summary) for p in _ALL]


def preset(name: str) -> Algorithm:
    """The :class:`Algorithm` of preset ``name`` (see :data:`PRESETS`); raises
    :class:`~rlnb.UnknownNameError` naming the presets for an unknown one."""
    found = PRESETS.get(name) if isinstance(name, str) else None
    if found is None:
        near = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise UnknownNameError(f"no algorithm preset {name!r}: {hint}the presets are {', '.join(PRESETS)}")
    return found.algorithm
