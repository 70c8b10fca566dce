"""A short check for a machine with one GPU: FSDP2 + bf16 on a model built from a config.

One process, world size 1, the same code path as `--trainer.strategy=fsdp
--trainer.precision=bf16-mixed`: `distributed.shard` (fully_shard per decoder layer, then the
root, MixedPrecisionPolicy bf16 / fp32 reduce) on a policy and a critic built with the
project's builders, then one critic and one actor AdamW step on random tokens, sharded
generation with the trainer's sampler (tokens/s), and peak memory. Prints one JSON line.

    python scripts/gpu_check.py                # GPU, ~0.5B-class Llama shapes
    python scripts/gpu_check.py --cpu --tiny   # smoke test on CPU (gloo), seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo, fp32) as a smoke test")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (for --cpu)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh

    from vapo_lightning.distributed import _mixed_precision, shard
    from vapo_lightning.engines.sampler import gathered_weights, sample_responses
    from vapo_lightning.models import ModelSpec, build_critic, build_policy
    from vapo_lightning.tokenization import train_bpe

    device = torch.device("cpu" if args.cpu else "cuda:0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))

    tok = train_bpe([f"{a} + {b} = {a + b}" for a in range(50) for b in range(50)], 512)
    shape = (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
        if args.tiny
        else {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
        }  # Qwen2.5-0.5B-like
    )
    spec = ModelSpec(
        config={
            "model_type": "llama",
            "max_position_embeddings": 4096,
            "vocab_size": 32000,
            **shape,
        },
        tokenizer=None,
        gradient_checkpointing=not args.cpu,
    )
    torch.manual_seed(0)
    policy = build_policy(spec, tok)
    critic = build_critic(None, policy, tok)
    if not args.cpu:
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = _mixed_precision("32-true" if args.cpu else "bf16-mixed")
    for m in (policy, critic):
        shard(m, mesh, mp)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    B, P, T = args.batch, args.prompt_len, args.new_tokens
    ids = torch.randint(10, 32000, (B, P + T), device=device)
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    report["params_M"] = round(sum(p.numel() for p in policy.parameters()) / 1e6, 1)
    for name, model in (("critic", critic), ("policy", policy)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=False).logits
        loss = out[..., 0].float().pow(2).mean() if name == "critic" else out.float().logsumexp(-1).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync(device)
        report[f"{name}_step_s"] = round(time.perf_counter() - t0, 3)
        report[f"{name}_grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        report["param_dtype_in_forward"] = str(out.dtype)
        del out, loss, opt

    policy.eval()
    prompt = ids[:, :P]
    sync(device)
    t0 = time.perf_counter()
    with (
        torch.autocast(device.type, torch.bfloat16, enabled=not args.cpu),  # as in training
        gathered_weights(policy),  # as `rollout.generate` samples (generation.gather_weights)
    ):
        gen = sample_responses(
            policy,
            prompt,
            torch.ones_like(prompt),
            max_new_tokens=T,
            min_new_tokens=T,
            stop_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
        )
    sync(device)
    seconds = time.perf_counter() - t0
    report["gen_tokens_per_s"] = round(gen.shape[1] * B / seconds, 1)
    if device.type == "cuda":
        report["peak_gpu_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report["peak_host_rss_MB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(report))
    dist.destroy_process_group()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
