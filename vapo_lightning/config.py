"""The algorithm's switches and the optimiser settings, with VAPO's defaults (§5.1).

Every VAPO technique is a switch here (or a callback: value pretraining), so vanilla PPO,
GRPO, DAPO and each "VAPO without X" ablation are configs of the same trainer
(configs/*.yaml). Defaults are the paper's; the table in
docs/algorithm.md#defaults-the-papers-training-setup-51 sets each beside the paper's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning.pytorch.utilities import rank_zero_warn


class SetupError(ValueError):
    """A setting that cannot work, found before any work starts: one line naming the field
    and what to change (the CLI prints it without a traceback)."""


__all__ = ["Algorithm", "Generation", "Optim", "VLLMOptions"]


@dataclass
class Algorithm:
    """VAPO's techniques and PPO's knobs. Attribute docstrings become `--help` text."""

    advantage: Literal["gae", "group"] = "gae"
    """'gae': value-based advantages from the critic (PPO, VAPO). 'group': critic-free
    (R - mean_group) / std_group broadcast to every token (GRPO, DAPO)."""
    gamma: float = 1.0
    """Discount; 1 throughout the paper."""
    decoupled_gae: bool = True
    """Decoupled GAE (§4.1): the critic's targets use lam_critic; off: the actor's lambda."""
    lam_critic: float = 1.0
    """Critic lambda (1.0: unbiased Monte-Carlo reward-to-go)."""
    length_adaptive_gae: bool = True
    """Length-adaptive GAE (§4.2, Eq. 5): lambda_actor = 1 - 1/(alpha * l) per sequence."""
    alpha: float = 0.05
    """Eq. 5's alpha."""
    lam_actor: float = 0.95
    """The actor's fixed lambda when length_adaptive_gae is off (VC-PPO: 0.95)."""
    whiten_advantages: bool = True
    """Whiten advantages over the valid tokens of the rollout batch (verl's default)."""
    group_std: bool = True
    """advantage='group': divide by the group's std (GRPO); off: mean-centred only."""
    clip_low: float = 0.2
    """epsilon_low of the clipped ratio (§4.3)."""
    clip_high: float = 0.28
    """epsilon_high (Clip-Higher, §4.3, Eq. 8); 0.2 for symmetric PPO clipping."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (verl's clip_ratio_c; not in the paper)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """'token': token-level loss (§4.2, Eq. 7); 'sequence': vanilla PPO's sample-level mean."""
    nll_coef: float = 0.1
    """mu of the positive-example LM loss (§4.3, Eq. 10); 0 disables it."""
    value_clip: float | None = 0.2
    """Value-loss clipping range; None disables it."""
    entropy_coef: float = 0.0
    """Entropy bonus (not used by the paper)."""
    kl_coef: float = 0.0
    """KL penalty to the initial policy (not used by the paper; keeps a frozen copy if > 0)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    critic_updates_per_step: int = 1
    """Critic optimiser steps on each mini-batch before its actor step (SAO, arXiv
    2607.07508, uses 2); the value clip stays around V_old."""
    mini_batch_size: int = 32
    """Responses per optimiser step (per device); must divide prompts × n (by default 8 × 16:
    4 optimiser steps per rollout; the paper's 512 of 512 × 16 make 16)."""
    micro_batch_size: int = 8
    """Responses per forward/backward (gradient accumulation); must divide mini_batch_size."""
    max_tokens_per_micro_batch: int | None = None
    """Micro-batches by tokens instead (verl's ppo_max_token_len_per_gpu, NeMo-RL's dynamic
    batching): as many responses as fit in this many tokens (rows × the longest prompt +
    response), so the activations and the (tokens, vocabulary) logits stay the same size as
    answers lengthen; every rank makes as many micro-batches as the neediest. None: by
    micro_batch_size."""
    share_prompts: bool = True
    """Run each prompt once for the min(n, micro_batch_size) responses to it that share a
    micro-batch (`vapo_lightning.packing`): the same logits, values and gradients, less work
    the longer the prompts; needs an attention that takes a 4-D mask (sdpa, eager), and n and
    micro_batch_size multiples of one another. On the CPU the micro-batch's rows also lie end
    to end, without padding, after the start all its prompts share (once)."""
    one_pass: bool = True
    """When every step is one epoch over one mini-batch (prompts_per_step × n <=
    mini_batch_size, ppo_epochs 1, no KL reference), take pi_old from the actor update's own
    first forward, detached, instead of a no-grad pass (verl's on-policy shortcut): the same
    gradients, one forward of the policy fewer. Decided once, at setup."""
    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling: drop groups whose responses all agree and sample fresh
    prompts, at most this many extra rounds; 0 disables it."""
    dynamic_sampling_metric: Literal["correct", "reward"] = "correct"
    """What dynamic sampling's groups must differ in: 'correct', the verifiers' verdicts (the
    DAPO paper's "accuracy equal to 1 or 0"; verl's filter_groups.metric=acc), so a group of
    all-wrong answers that only shaping rewards (an overlong penalty, a format bonus) tell
    apart is dropped; 'reward', the total reward."""
    max_bad_steps: int = 3
    """Stop after this many consecutive updates with a non-finite loss or gradient."""
    rollout_is: Literal["none", "tis"] = "none"
    """Rollout correction for an inference engine's numerics (generation.engine=vllm):
    'tis' multiplies each token's policy loss by min(pi_old / pi_engine, rollout_is_cap)
    (truncated importance sampling, verl's rollout correction); 'none': off."""
    rollout_is_cap: float = 2.0
    """C of truncated importance sampling."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where pi_old comes from when it is not the actor's own first forward (`one_pass`):
    'recompute', a no-grad forward of the policy over the rollout (verl's default); 'rollout',
    the engine's log-prob of each token it sampled (verl's bypass mode): one forward of the
    policy fewer per step, and the PPO ratio is then taken against the policy that really
    sampled, its numerics (bf16, a KV cache, another engine) included."""
    critic_gate: float | None = None
    """Beyond the paper, off by default: EVPO's gate (arXiv 2604.19485). Each step, the
    critic's explained variance on the fresh batch (V_old against the λ = γ = 1 return, over
    every rank's tokens, before the critic learns from the batch) must exceed this for the
    actor to take the critic's GAE advantages; otherwise the step's advantages use the group
    mean as baseline (GRPO's (R - mean) / std of the prompt's group, on every token), so a
    critic that explains nothing cannot add its noise. EVPO's threshold: 0."""

    def __post_init__(self) -> None:
        checks = {
            "gamma": 0 <= self.gamma <= 1,
            "lam_critic": 0 <= self.lam_critic <= 1,
            "lam_actor": 0 <= self.lam_actor <= 1,
            "alpha": self.alpha > 0,
            "clip_low": 0 < self.clip_low < 1,
            "clip_high": self.clip_high > 0,
            "nll_coef": self.nll_coef >= 0,
            "ppo_epochs": self.ppo_epochs >= 1,
            "critic_updates_per_step": self.critic_updates_per_step >= 1,
            "mini_batch_size": self.mini_batch_size >= 1,
            "micro_batch_size": 1 <= self.micro_batch_size <= self.mini_batch_size,
            "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch is None
            or self.max_tokens_per_micro_batch >= 1,
            "dynamic_sampling_rounds": self.dynamic_sampling_rounds >= 0,
            "rollout_is": self.rollout_is in ("none", "tis"),
            "rollout_is_cap": self.rollout_is_cap >= 1,
            "old_logprobs": self.old_logprobs in ("recompute", "rollout"),
            "dynamic_sampling_metric": self.dynamic_sampling_metric in ("correct", "reward"),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"model.algorithm: invalid {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"model.algorithm.micro_batch_size={self.micro_batch_size} must divide "
                f"mini_batch_size={self.mini_batch_size}"
            )
        if self.critic_gate is not None and self.advantage != "gae":
            raise ValueError("model.algorithm.critic_gate gates a critic: it needs advantage='gae'")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError("model.algorithm.clip_ratio_c must be > 1 (verl uses 3.0) or None")

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    def old_logprob_source(self, batch: int | None, reference_policy: bool) -> str:
        """Where pi_old comes from for a run whose steps have `batch` responses (None: not
        known, as outside `fit`): 'first_forward' with `one_pass` when every step is one
        epoch over one mini-batch and no reference policy is kept (the policy then is pi_old
        until the update's one step), else `old_logprobs` ('recompute' or 'rollout')."""
        on_policy = batch is not None and batch <= self.mini_batch_size and self.ppo_epochs == 1
        return "first_forward" if self.one_pass and on_policy and not reference_policy else self.old_logprobs

    @property
    def reads_rollout_logprobs(self) -> bool:
        """Whether the update reads the engine's log-probs (pi_old or rollout correction)."""
        return self.old_logprobs == "rollout" or self.rollout_is != "none"

    def check_batch(self, prompts_per_step: int | None, n: int) -> None:
        """The rollout batch (prompts × n) splits into mini-batches; GRPO / DAPO have groups."""
        batch = None if prompts_per_step is None else prompts_per_step * n
        if batch is not None and batch % self.mini_batch_size:
            raise SetupError(
                f"model.algorithm.mini_batch_size={self.mini_batch_size} must divide the rollout "
                f"batch data.prompts_per_step × model.generation.n = {prompts_per_step} × {n} = {batch}"
            )
        c = min(n, self.micro_batch_size)
        if self.share_prompts and n > 1 and (n % c or self.micro_batch_size % c):
            rank_zero_warn(
                f"model.algorithm.share_prompts: micro_batch_size={self.micro_batch_size} and "
                f"model.generation.n={n} are not multiples of one another, so every response "
                "runs its prompt through the models on its own"
            )
        if self.advantage == "group" and n < 2:
            raise SetupError("model.algorithm.advantage='group' (GRPO/DAPO) needs model.generation.n >= 2")
        if self.critic_gate is not None and n < 2:
            raise SetupError(
                "model.algorithm.critic_gate falls back to the group mean: it needs model.generation.n >= 2"
            )


@dataclass
class Optim:
    """AdamW for each model, linear warm-up then constant (§5.1)."""

    actor_lr: float = 1e-6
    critic_lr: float = 2e-6
    warmup_steps: int = 10
    """Rollout steps of linear LR warm-up."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm) for each model."""

    def __post_init__(self) -> None:
        if self.actor_lr < 0 or self.critic_lr < 0 or self.warmup_steps < 0 or self.max_grad_norm <= 0:
            raise ValueError("model.optim: learning rates and warmup_steps >= 0, max_grad_norm > 0")


@dataclass
class VLLMOptions:
    """The vLLM engine's own settings (`generation.engine=vllm`), one engine per training
    process, colocated with the models. Attribute docstrings become `--help` text."""

    gpu_memory_utilization: float = 0.5
    """Share of the device's memory the engine may take (weights, KV cache, CUDA graphs)
    while it samples; with `sleep` it gives it back while the models train. On the CPU
    backend: the share of host memory it reserves."""
    tensor_parallel_size: int = 1
    """Devices the engine shards one policy over (a policy that does not fit one device);
    consecutive ranks form one engine."""
    dtype: str = "auto"
    """Engine weights' dtype: 'auto' follows the trainer's precision (bf16-mixed -> bfloat16,
    otherwise float32), or 'bfloat16' / 'float16' / 'float32'."""
    enforce_eager: bool = False
    """No CUDA graphs (faster start, slower decoding); always on for the CPU backend."""
    enable_prefix_caching: bool = True
    """Share the KV cache of a prompt between its n samples."""
    sleep: bool = True
    """On a GPU, release the engine's memory while the models train (vLLM sleep mode) and
    take it back for the next rollout. The KV cache is freed; before an actor update the weights
    are discarded (level 2: the update replaces them, the next rollout loads the new ones),
    while the actor is frozen (value pretraining) and after validation they are offloaded to
    host memory (level 1)."""
    max_num_seqs: int = 256
    """Sequences decoded at once (continuous batching)."""
    kv_cache_gib: int = 1
    """CPU backend only: GiB of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("generation.vllm.gpu_memory_utilization must lie in (0, 1]")
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1 or self.kv_cache_gib < 1:
            raise ValueError("generation.vllm: tensor_parallel_size, max_num_seqs and kv_cache_gib must be >= 1")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"generation.vllm.dtype={self.dtype!r}: auto, bfloat16, float16 or float32")


@dataclass
class Generation:
    """How responses are sampled (§5.1: temperature 1.0; eval top-p 0.7)."""

    n: int = 16
    """Group sampling: responses per prompt (§4.3; paper 16)."""
    max_new_tokens: int = 512
    """Responses stop here and are flagged truncated (still terminal: no bootstrap)."""
    min_new_tokens: int = 0
    """Force at least this many tokens (equal to max_new_tokens for fixed-length benchmarks)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs of the update use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0: all of them."""
    engine: Literal["native", "vllm"] | None = None
    """'native': this package's decoding loop over the Hugging Face forward (CPU runs, tests);
    'vllm': a vLLM engine in every training process, colocated with the models, given the
    trainer's weights after each actor update (`engines.vllm`). None: 'native' for
    model.generation; for model.val_generation, model.generation's engine."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """The vLLM engine's settings (engine='vllm')."""
    max_batch_size: int | None = None
    """Sequences per `generate` call; bounds the KV cache (None: the whole rollout at once)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the tokenizer's EOS (e.g. Qwen's <|im_end|>)."""
    gather_weights: bool = True
    """FSDP: gather the policy's full weights once per rollout (one copy per device in the
    parameter dtype while sampling) instead of all-gathering every layer at every decoding
    step; false where the full weights do not fit beside the sharded training state."""
    max_turns: int = 4
    """With model.tools: tool calls per response; past them a call's end is ordinary text."""
    max_observation_tokens: int = 256
    """With model.tools: tokens of one observation; a longer output is cut and says so.
    Observations count against max_new_tokens."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("generation.n and generation.max_new_tokens must be >= 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("generation.max_batch_size must be >= 1 (or null)")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError("generation.min_new_tokens must lie in [0, max_new_tokens]")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("generation.temperature and top_k must be >= 0 and top_p in (0, 1]")
        if self.max_turns < 0 or self.max_observation_tokens < 1:
            raise ValueError("generation.max_turns must be >= 0, max_observation_tokens >= 1")
        if self.engine not in (None, "native", "vllm"):
            raise ValueError(f"generation.engine={self.engine!r}: 'native' or 'vllm'")
        if isinstance(self.vllm, dict):  # from a checkpoint's hyper-parameters
            self.vllm = VLLMOptions(**self.vllm)
