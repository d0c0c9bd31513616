"""Run by a llama-cpp-python environment's python for `bench latency|throughput --baseline
llamacpp`: imports only llama_cpp and the standard library (not tokenloom).

Argument: a JSON file with the model path and options. Then one JSON command per stdin line, one
JSON answer per stdout line (prefixed), so the caller can alternate its own iterations with ours:
  {"prompts": [[ids], ...], "output_len": n} -> per prompt, one after another (llama-cpp-python
      runs one sequence at a time): prefill_s (to the first token), decode_s (the rest), e2e_s
  {"prompts": [[ids], ...], "output_len": n, "batched": true} -> all prompts at once through
      llama.cpp's batch API (one sequence id each, one llama_decode per step, as llama.cpp's
      `batched` example and llama-server's parallel slots run them): one record for the batch
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


class _Batched:
    """A context with one KV sequence per prompt, reused across commands of the same size."""

    def __init__(self, llama_cpp, llm, n_seq: int, n_ctx_seq: int, n_threads: int) -> None:
        self.l = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq
        params.n_batch = max(n_seq * n_ctx_seq, 512)  # every prompt's tokens in one llama_decode
        params.n_ubatch = 512
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = n_threads
        self.model = llm._model.model
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)

    def _decode(self, entries: list) -> None:
        """entries: (token, pos, seq, wants_logits) -> one llama_decode."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.l.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        import numpy as np

        ptr = self.l.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: list, output_len: int) -> dict:
        self.l.llama_memory_clear(self.l.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        self._decode(entries)
        last = [i for i, e in enumerate(entries) if e[3]]
        toks = [self._argmax(i) for i in last]
        first = time.perf_counter()
        pos = [len(p) for p in prompts]
        for _ in range(output_len - 1):
            self._decode([(t, pos[s], s, True) for s, t in enumerate(toks)])
            toks = [self._argmax(i) for i in range(len(prompts))]
            pos = [q + 1 for q in pos]
        end = time.perf_counter()
        return {"prefill_s": first - start, "decode_s": end - first, "e2e_s": end - start,
                "num_output_tokens": output_len * len(prompts)}


def main() -> None:
    import llama_cpp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["n_threads"],
                          n_threads_batch=spec["n_threads"], n_batch=512, seed=spec["seed"], verbose=False)
    print(PREFIX + json.dumps({"version": llama_cpp.__version__}), flush=True)
    batched: dict = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("batched"):
            prompts, n = cmd["prompts"], cmd["output_len"]
            if len(prompts) not in batched:
                batched[len(prompts)] = _Batched(llama_cpp, llm, len(prompts), spec["n_ctx"], spec["n_threads"])
            out = {"runs": [batched[len(prompts)].generate(prompts, n)]}
        elif cmd.get("memory"):
            out = {"rss_bytes": _status_bytes("VmRSS"), "peak_rss_bytes": _status_bytes("VmHWM")}
        else:
            out = {"runs": [_generate(llm, p, cmd["output_len"]) for p in cmd["prompts"]]}
        print(PREFIX + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
