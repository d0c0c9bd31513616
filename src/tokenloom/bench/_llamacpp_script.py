"""Run by a llama-cpp-python environment's python for `bench latency|throughput --baseline
llamacpp`: imports only llama_cpp and the standard library (not tokenloom).

Argument: a JSON file with the model path and options. Then one JSON command per stdin line, one
JSON answer per stdout line (prefixed), so the caller can alternate its own iterations with ours:
  {"prompts": [[ids], ...], "output_len": n} -> per prompt, one after another (llama-cpp-python
      runs one sequence at a time): prefill_s (to the first token), decode_s (the rest), e2e_s
  {"memory": true} -> this process's resident memory (VmRSS, VmHWM) in bytes
"""
import json
import sys
import time

PREFIX = "TOKENLOOM_LLAMACPP "


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _generate(llm, prompt: list, output_len: int) -> dict:
    start = time.perf_counter()
    first = None
    n = 0
    # temp=0 is greedy; tokens are taken until output_len whatever they are (ignore_eos).
    for _tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n >= output_len:
            break
    end = time.perf_counter()
    return {"prefill_s": first - start, "decode_s": end - first, "e2e_s": end - start, "num_output_tokens": n}


def main() -> None:
    import llama_cpp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["n_threads"],
                          n_threads_batch=spec["n_threads"], n_batch=512, seed=spec["seed"], verbose=False)
    print(PREFIX + json.dumps({"version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("memory"):
            out = {"rss_bytes": _status_bytes("VmRSS"), "peak_rss_bytes": _status_bytes("VmHWM")}
        else:
            out = {"runs": [_generate(llm, p, cmd["output_len"]) for p in cmd["prompts"]]}
        print(PREFIX + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
