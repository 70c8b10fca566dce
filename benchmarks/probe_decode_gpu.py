"""GPU probe (ad hoc, kept as it ran): decode time per step of `sample_responses` on the
quickstart SFT model, 16 prompts x 8 samples, up to 160 new tokens, fp32 vs bf16 autocast,
stopping at EOS ("max") or forced to the full length ("fixed"), then a profile of 40 bf16
steps. It found that SDPA picked cuDNN's attention under bf16 once rows had left the batch,
re-planning it at every step (benchmarks/results/gpu.md). Run on a CUDA machine from the
repo root: `python3 benchmarks/probe_decode_gpu.py` (benchmarks/gpu_check.sh runs it).
"""
import json, sys, time, torch
sys.path.insert(0, ".")
from vapo_lightning.generation import sample_responses
from vapo_lightning.models import ModelSpec, build_policy, load_tokenizer
tok = load_tokenizer("vapo_lightning/assets/quickstart_sft")
policy = build_policy(ModelSpec(name_or_path="vapo_lightning/assets/quickstart_sft"), tok).cuda().eval()
rows = [json.loads(l) for l in open("vapo_lightning/assets/arithmetic/train.jsonl")][:16]
prompts = [r["prompt"] for r in rows for _ in range(8)]
enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
kw = dict(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, temperature=1.0)
def run(label, ctx, **extra):
    for i in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        with ctx():
            out = sample_responses(policy, enc.input_ids, enc.attention_mask, **kw, **extra)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"{label}: {dt:.3f} s, {out.shape[1]} steps, {1000*dt/out.shape[1]:.2f} ms/step", flush=True)
import contextlib
amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
for T in (160,):
    run(f"fp32 max{T}", contextlib.nullcontext, max_new_tokens=T)
    run(f"fp32 fixed{T}", contextlib.nullcontext, max_new_tokens=T, min_new_tokens=T)
    run(f"autocast-bf16 max{T}", amp, max_new_tokens=T)
    run(f"autocast-bf16 fixed{T}", amp, max_new_tokens=T, min_new_tokens=T)
    run(f"fp32 max{T} no-compaction", contextlib.nullcontext, max_new_tokens=T, compact_fraction=2.0)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    with amp():
        sample_responses(policy, enc.input_ids, enc.attention_mask, **kw, max_new_tokens=40)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=18))
