"""Run by a vLLM environment's python for `bench throughput --baseline vllm`: imports only vllm
and the standard library (not tokenloom). Argument: a JSON file with the model directory, engine
options and prompts (token ids). Prints one line: the result prefix and a JSON object."""
import json
import sys
import time


def main() -> None:
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
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(4, spec["output_len"]), ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["warmup"]], warm, use_tqdm=False)
    runs = []
    for prompt_set in spec["prompt_sets"]:  # fresh prompts each time: no prefix-cache hits
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_set]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("TOKENLOOM_VLLM_RESULT " + json.dumps({"elapsed_runs_s": runs, "num_output_tokens": num_out}),
          flush=True)


if __name__ == "__main__":
    main()
