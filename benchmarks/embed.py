"""Embeddings: tokenloom's `LLM(runner="pooling").embed` against transformers (the same weights,
float32: the model's final hidden states, last token, normalized, as sentence-transformers' last
token pooling computes them) on the same prompts, alternating rounds in one process; prompts
per second and the ratio. The default model is the embedded SmolLM2 (its GGUF; `--quantization
none` for the float path); transformers runs a padded batch of `--hf-batch` prompts at a time
(left padding: every prompt's last token is the batch's last column).

    PYTHONPATH=src .venv/bin/python benchmarks/embed.py --num-prompts 64 --prompt-len 128 --rounds 3
    PYTHONPATH=src .venv/bin/python benchmarks/embed.py --quantization none
    # and vLLM's CPU build, embedding the same prompts (float32; alternating with the others)
    PYTHONPATH=src .venv/bin/python benchmarks/embed.py --vllm-python /tmp/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

from tokenloom import LLM
from tokenloom.bench.common import load_hf_model, random_prompt_ids
from tokenloom.bench.machine import format_machine, machine_info


def hf_embed(model, prompts: list[list[int]], batch: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            part = prompts[i : i + batch]
            width = max(map(len, part))
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(part):  # left padding: the last column is every prompt's last token
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
            out.append(F.normalize(hidden.float(), dim=-1))
    return torch.cat(out)


class VllmEmbedder:
    """vLLM's CPU build in a subprocess (bound to the usable cores, its libgomp preloaded, as the
    throughput bench runs it), embedding the prompts it is sent."""

    def __init__(self, python: str, dtype: str) -> None:
        from tokenloom.bench.vllm_baseline import _libgomp, export_hf_checkpoint

        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        gomp = _libgomp(python)
        if gomp:
            env["LD_PRELOAD"] = gomp
        spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"model": export_hf_checkpoint(None), "dtype": dtype}, spec)
        spec.close()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_embed_script.py")
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([python, script, spec.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.version = self._answer()["version"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("VLLM_EMBED "):
                return json.loads(line[len("VLLM_EMBED "):])
        self.log.seek(0)
        raise RuntimeError("vLLM exited: " + self.log.read()[-2000:])

    def embed(self, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        answer = self._answer()
        return answer["elapsed_s"], torch.tensor(answer["vectors"])

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu installed: embed with it too")
    ap.add_argument("--vllm-dtype", default="float32")
    args = ap.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    print(format_machine(machine_info()))
    llm = LLM(runner="pooling", quantization=quantization, dtype="float32", enable_prefix_caching=False)
    hf, _ = load_hf_model(None, "float32", "cpu")
    vllm = VllmEmbedder(args.vllm_python, args.vllm_dtype) if args.vllm_python else None
    if vllm is not None:
        print(f"vLLM {vllm.version} ({args.vllm_dtype})")
    tokenizer = llm.get_tokenizer()
    cfg = llm.llm_engine.model_config
    print(f"tokenloom: {llm.llm_engine.info.quantization}; transformers float32, batches of {args.hf_batch}")
    rates: dict[str, list[float]] = {"tokenloom": [], "transformers": [], "vllm": []}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        prompts = random_prompt_ids(tokenizer, cfg.vocab_size, args.num_prompts, args.prompt_len, seed=r)
        t = time.perf_counter()
        ours = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                    use_tqdm=False)])
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        ref = hf_embed(hf, prompts, args.hf_batch)
        t_hf = time.perf_counter() - t
        cos = F.cosine_similarity(ours, ref, dim=1).min().item()
        line = (f"round {r}{' (warm-up)' if not r else ''}: tokenloom {args.num_prompts / t_ours:.1f} prompts/s "
                f"({t_ours:.2f} s), transformers {args.num_prompts / t_hf:.1f} ({t_hf:.2f} s) {t_hf / t_ours:.2f}x")
        if vllm is not None:
            t_vllm, theirs = vllm.embed(prompts)
            line += (f", vLLM {args.num_prompts / t_vllm:.1f} ({t_vllm:.2f} s) {t_vllm / t_ours:.2f}x, "
                     f"min cosine to vLLM {F.cosine_similarity(ours, theirs, dim=1).min().item():.5f}")
            if r:
                rates["vllm"].append(args.num_prompts / t_vllm)
        if r:
            rates["tokenloom"].append(args.num_prompts / t_ours)
            rates["transformers"].append(args.num_prompts / t_hf)
        print(line + f", min cosine to transformers {cos:.5f}")
    ours, theirs = statistics.median(rates["tokenloom"]), statistics.median(rates["transformers"])
    summary = (f"median: tokenloom {ours:.1f} prompts/s ({ours * args.prompt_len:.0f} tok/s), transformers "
               f"{theirs:.1f} prompts/s: {ours / theirs:.2f}x")
    if rates["vllm"]:
        v = statistics.median(rates["vllm"])
        summary += f"; vLLM {v:.1f} prompts/s: {ours / v:.2f}x"
    print(summary)
    llm.shutdown()
    if vllm is not None:
        vllm.close()


if __name__ == "__main__":
    main()
