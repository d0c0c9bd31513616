"""Encoder embeddings: tokenloom's `LLM(runner="pooling").embed` against sentence-transformers'
`SentenceTransformer.encode` on the same files (a bge-small-shaped BERT of random weights:
hidden 384, 12 layers, 12 heads, FFN 1536, vocabulary 30522, CLS pooling, normalized), the same
texts (`--num-texts` of `--text-len` tokens each, tokenization included on both sides), in one
process, alternating timed rounds so that the machine's load meets both alike. Texts per second,
the median of each and the ratio of the medians.

tokenloom runs in each `--dtype` given (auto: bfloat16 where the CPU multiplies it natively, its
default); sentence-transformers in float32 (its default) and, with `--st-bf16`, in bfloat16 too.

    PYTHONPATH=src .venv/bin/python benchmarks/encoder_bench.py --rounds 5
    PYTHONPATH=src .venv/bin/python benchmarks/encoder_bench.py --dtype float32 auto --st-bf16
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Not this folder: its kernels.py would shadow the `kernels` package that transformers imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from encoder_helpers import env_offline, make_tokenizer, save_sentence_transformer  # noqa: E402

from tokenloom import LLM  # noqa: E402
from tokenloom.bench.machine import format_machine, machine_info  # noqa: E402

BGE_SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
                 vocab_size=30522, max_position_embeddings=512)


def make_texts(tokenizer, n: int, length: int, seed: int = 0) -> list[str]:
    """`n` texts of random whole-word vocabulary entries that tokenize to `length` tokens each
    (special tokens included)."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and not w.startswith("##") and len(w) > 1]
    texts = []
    for _ in range(n):
        picked = [rng.choice(words) for _ in range(length - 2)]
        while len(tokenizer(" ".join(picked))["input_ids"]) > length:
            picked.pop()
        texts.append(" ".join(picked))
    return texts


def timed(fn, texts: list[str]) -> float:
    start = time.perf_counter()
    fn(texts)
    return time.perf_counter() - start


# long because: one flat script: build, check, alternate the rounds, print the table
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-texts", type=int, default=64)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", nargs="+", default=["auto", "float32"])
    ap.add_argument("--st-bf16", action="store_true", help="sentence-transformers in bfloat16 as well")
    args = ap.parse_args()
    with env_offline():
        _run(args)


def _run(args: argparse.Namespace) -> None:
    from sentence_transformers import SentenceTransformer

    print(format_machine(machine_info()))
    tmp = tempfile.mkdtemp(prefix="encoder_bench_")
    tokenizer = make_tokenizer("bert", vocab_size=2000)
    path = save_sentence_transformer("bert", os.path.join(tmp, "bge-small-shape"), pooling="cls",
                                     tokenizer=tokenizer, type_vocab_size=2, **BGE_SMALL)
    texts = make_texts(tokenizer, args.num_texts, args.text_len)
    lens = {len(tokenizer(t)["input_ids"]) for t in texts}
    print(f"{len(texts)} texts of {sorted(lens)} tokens; torch threads {torch.get_num_threads()}")

    engines = {}
    st = SentenceTransformer(path, device="cpu")
    engines["sentence-transformers float32"] = lambda t: st.encode(t, batch_size=len(t), convert_to_tensor=True)
    if args.st_bf16:
        st16 = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.bfloat16})
        engines["sentence-transformers bfloat16"] = lambda t: st16.encode(t, batch_size=len(t), convert_to_tensor=True)
    llms = {}
    for dtype in args.dtype:
        # sentence-transformers' threads (torch's default), fixed: the adaptive count would read
        # the other engine's rounds as load.
        llm = llms[dtype] = LLM(path, runner="pooling", dtype=dtype, num_threads=torch.get_num_threads())
        resolved = llm.llm_engine.config.dtype if dtype != "auto" else "auto"
        engines[f"tokenloom {resolved}"] = lambda t, llm=llm: llm.embed(t, use_tqdm=False)

    # Same vectors (float32 against float32) before timing anything.
    if "float32" in llms:
        want = st.encode(texts[:4], convert_to_tensor=True).float()
        got = torch.tensor([o.outputs.embedding for o in llms["float32"].embed(texts[:4], use_tqdm=False)])
        print(f"float32 check: min cosine {torch.nn.functional.cosine_similarity(got, want).min():.7f}")
    for fn in engines.values():  # warm-up
        fn(texts)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, fn in engines.items():
            times[name].append(timed(fn, texts))
    base = statistics.median(times["sentence-transformers float32"])
    print(f"\n| engine | texts/s (median of {args.rounds}) | vs sentence-transformers float32 |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {len(texts) / med:.1f} | {base / med:.2f}x |")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
