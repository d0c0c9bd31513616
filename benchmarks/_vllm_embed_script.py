"""Run by a vLLM environment's python for `benchmarks/embed.py --vllm-python`: imports only vllm
and the standard library. Argument: a JSON file with the model directory and dtype. Loads the
model as an embedding model (runner="pooling"), answers one line, then per stdin line
{"prompts": [[ids], ...]} one timed `LLM.embed` over them: elapsed_s and the vectors."""
import json
import sys
import time

PREFIX = "VLLM_EMBED "


def main() -> None:
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    llm.embed([TokensPrompt(prompt_token_ids=[1, 2, 3])], use_tqdm=False)
    print(PREFIX + json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)["prompts"]]
        start = time.perf_counter()
        outs = llm.embed(prompts, use_tqdm=False)
        elapsed = time.perf_counter() - start
        print(PREFIX + json.dumps({"elapsed_s": elapsed, "vectors": [o.outputs.embedding for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
