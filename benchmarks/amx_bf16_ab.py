"""The bf16 float path with our AMX matmul and the fused decode step against the same path on
oneDNN's packed matmuls (`TOKENLOOM_AMX_BF16=0`): two engines in one process, generating the same
workload in alternating rounds, output tokens/s per round and their ratio.

    PYTHONPATH=src python benchmarks/amx_bf16_ab.py BATCH OUTPUT_LEN ROUNDS   # e.g. 64 128 6
"""
import os, sys, time, random, statistics
from tokenloom import LLM, SamplingParams
B, n_out, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
engines = {}
for name, env in (("amx", "1"), ("onednn", "0")):
    os.environ["TOKENLOOM_AMX_BF16"] = env
    engines[name] = LLM(multiprocess=False, quantization=None, enable_prefix_caching=False)
    print(name, engines[name].llm_engine.engine_core.info.cpu.split("->")[1].split(", C kernels")[0])
random.seed(0)
def prompts(n): return [{"prompt_token_ids": [random.randint(100, 40000) for _ in range(128)]} for _ in range(n)]
sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0)
for e in engines.values(): e.generate(prompts(8), SamplingParams(max_tokens=4), use_tqdm=False)
res = {k: [] for k in engines}
for r in range(rounds):
    for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
        t = time.perf_counter(); engines[name].generate(prompts(B), sp, use_tqdm=False); res[name].append(B * n_out / (time.perf_counter() - t))
for k, v in res.items(): print(k, "out tok/s", [round(x) for x in v], "median", round(statistics.median(v)))
print("ratio amx/onednn per round", [round(a / b, 3) for a, b in zip(res["amx"], res["onednn"])], "median", round(statistics.median(res["amx"]) / statistics.median(res["onednn"]), 3))
