"""Run by a vLLM environment's python for `bench throughput --baseline vllm`: imports only vllm
and the standard library (not tokenloom).

Argument: a JSON file with the model directory, engine options and the warm-up prompts (token
ids). The model is loaded and warmed up, then one line answers (prefixed JSON, with vLLM's
version); then one JSON command per stdin line, one answer per stdout line, so that the caller
can alternate its own timed runs with these:
  {"prompts": [[ids], ...]} -> one timed generate() over all of them: elapsed_s, num_output_tokens
The process ends when stdin closes.
"""
import json
import sys
import time

PREFIX = "TOKENLOOM_VLLM_RESULT "


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"],
        # The workload's length: vLLM refuses to start when the model's whole context (131,072 for
        # Llama 3 shapes) does not fit its KV cache space.
        max_model_len=spec["max_model_len"],
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(4, spec["output_len"]), ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["warmup"]], warm, use_tqdm=False)
    print(PREFIX + json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:  # fresh prompts each time: no prefix-cache hits
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(PREFIX + json.dumps({"elapsed_s": elapsed, "num_output_tokens": num_out}), flush=True)


if __name__ == "__main__":
    main()
