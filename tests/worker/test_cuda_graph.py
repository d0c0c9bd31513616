"""CUDA graphs of decode steps, checked without a GPU: the batch sizes captured, when an engine
stays eager, the padding rows a replay adds, and the runner's graph path end to end with each
graph standing in as an eager forward over what it would read (the staged buffers and the plans
made for max_model_len) on the Triton kernels under TRITON_INTERPRET. The capture and the
replays themselves run in tests/entrypoints/test_llm_cuda.py on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.attention.triton_backend import TritonAttentionBackend
from tokenloom.config import EngineConfig
from tokenloom.worker import cuda_graph
from tokenloom.worker.cuda_graph import DecodeGraphs, capture_sizes, why_eager
from tokenloom.worker.model_runner import _StagedInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import byte_vocab, tiny_gguf  # noqa: E402

CUDA = torch.device("cuda")


def test_capture_sizes_cover_every_decode_batch():
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_sizes(100)[-2:] == [96, 100]  # the largest batch has a graph of its own size
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1]
    assert capture_sizes(4096)[-1] == 512 and capture_sizes(0) == []


@pytest.mark.parametrize("fields, backend, reason", [
    ({}, TritonAttentionBackend(), None),
    ({"enforce_eager": True}, TritonAttentionBackend(), "enforce_eager"),
    ({"compile": True}, TritonAttentionBackend(), "compile"),
    ({"enable_lora": True}, TritonAttentionBackend(), "LoRA"),
    ({"runner": "pooling"}, TritonAttentionBackend(), "a pooling runner"),
    ({}, TorchAttentionBackend(), "the torch attention backend plans on the host"),
])
def test_why_an_engine_runs_its_decode_steps_eagerly(fields, backend, reason):
    assert why_eager(EngineConfig(device="cuda", **fields), CUDA, backend) == reason
    assert why_eager(EngineConfig(**fields), torch.device("cpu"), backend) == "not on CUDA"


def test_padding_rows_read_one_key_and_write_nothing():
    """A decode step of 3 requests staged into the graph of 8: rows 3..7 are token 0 at position
    0 with one query token each, a context of one key in block 0, and slot -1 (no KV write);
    the step's own rows are untouched."""
    cpu = torch.device("cpu")
    staged = {name: _StagedInput(shape, dtype, cpu) for name, shape, dtype in (
        ("input_ids", (16,), torch.int64), ("positions", (16,), torch.int64),
        ("query_start_loc", (17,), torch.int32), ("seq_lens", (16,), torch.int32))}
    block_tables = [_StagedInput((16, 4), torch.int32, cpu) for _ in range(2)]
    slot_mappings = [_StagedInput((16,), torch.int64, cpu) for _ in range(2)]
    for s in (*staged.values(), *block_tables, *slot_mappings):
        s.np[...] = 7  # stale values of an earlier step
    staged["query_start_loc"].np[:4] = [0, 1, 2, 3]
    graphs = DecodeGraphs(None, [], TritonAttentionBackend(), [], 16, 1024, [1, 2, 4, 8],
                          staged["input_ids"], staged["positions"], staged["query_start_loc"], staged["seq_lens"],
                          block_tables, slot_mappings)
    assert [graphs.size_for(n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    graphs.pad(3, 8)
    assert staged["input_ids"].np[:8].tolist() == [7, 7, 7] + [0] * 5
    assert staged["positions"].np[:8].tolist() == [7, 7, 7] + [0] * 5
    assert staged["query_start_loc"].np[:9].tolist() == list(range(9))
    assert staged["seq_lens"].np[:8].tolist() == [7, 7, 7] + [1] * 5
    for bt, sm in zip(block_tables, slot_mappings):
        assert (bt.np[3:8, 0] == 0).all() and (bt.np[:3] == 7).all()
        assert sm.np[:8].tolist() == [7, 7, 7] + [-1] * 5
    assert (staged["seq_lens"].np[8:] == 7).all()  # past the graph's size: left alone


def test_triton_graph_plan_holds_for_the_longest_context():
    """The plan a graph captures is a decode plan for max_model_len, whatever the capture's
    padding lengths say: split-KV where that length asks for it, the window where it exceeds it."""
    from tokenloom.attention.metadata import AttentionMetadata

    z = torch.zeros(9, dtype=torch.int32)
    meta = AttentionMetadata(num_actual_tokens=8, num_reqs=8, max_query_len=1, max_seq_len=4096,
                             query_start_loc=z, seq_lens=z[:8], block_table=z[:8].view(8, 1),
                             slot_mapping=z[:8].long(), block_size=16, sliding_window=512)
    plan = TritonAttentionBackend().prepare_for_cuda_graph(meta)
    assert plan.decode_only and not plan.prefill_only_no_context
    assert plan.max_seq_len == 4096 and plan.sliding_window == 512
    assert plan.query_start_loc_cpu.tolist() == list(range(9))
    meta.max_seq_len = 256
    assert TritonAttentionBackend().prepare_for_cuda_graph(meta).sliding_window is None
    np.testing.assert_array_equal(plan.seq_lens.numpy(), np.zeros(8))


class _EagerReplays(DecodeGraphs):
    """A graph's stand-in where there is no CUDA: the same warm-up per size (padding rows, plans
    for max_model_len, one forward), the same start-up check, and a replay that runs the forward
    eagerly on the arguments a graph would have captured."""

    def capture(self) -> None:
        for size in reversed(self.sizes):
            args = self._warm_up(size)
            self.graphs[size] = (None, args, args[-1])
            if size in (self.sizes[0], self.sizes[-1]):
                self._check(size, args)

    def replay(self, size: int) -> torch.Tensor:
        self.num_replays += 1
        return self.model(*self.graphs[size][1])


@pytest.mark.parametrize("max_model_len, path", [pytest.param(1024, "split_kv", marks=pytest.mark.slow), (512, "unified")])
def test_graph_steps_compute_what_eager_steps_compute(tmp_path, monkeypatch, max_model_len, path):
    """Decode steps through the graph path (padded to the captured sizes) give the torch
    backend's tokens and logprobs. At max_model_len 1024 the graphs hold split-KV decode with two
    partitions (the 600-token prompt's replies read both), at 512 the unified kernel. Three
    requests replay the graph of 4: one padding row."""
    from tokenloom import LLM, SamplingParams

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", _EagerReplays)
    # As if on CUDA: the torch backend's engine still says it plans on the host.
    monkeypatch.setattr(cuda_graph, "why_eager", lambda config, device, backend: why_eager(config, CUDA, backend))
    model = tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.F32, seed=11)
    g = torch.Generator().manual_seed(5)
    lens = (1, 40, 600) if max_model_len == 1024 else (1, 40, 130)
    prompts = [{"prompt_token_ids": torch.randint(0, len(byte_vocab()), (n,), generator=g).tolist()} for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    runs = {}
    for backend in ("triton", "torch"):
        with LLM(model, dtype="float32", kv_cache_dtype="float32", quantization=None, multiprocess=False,
                 max_model_len=max_model_len, max_num_seqs=4, kv_cache_memory_bytes=16 << 20,
                 attention_backend=backend) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[backend] = [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                             for o in outs]
            graphs = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.graphs
            if backend == "triton":
                assert llm.llm_engine.info.cuda_graphs == "decode batches of 1-4 requests (3 sizes)"
                assert graphs.num_replays >= 4 and 4 in graphs.graphs  # 3 requests: the graph of 4
                assert {p.paths[(4, 2)][0] for _, _, plans in graphs.graphs.values() for p in plans} == {path}
            else:
                assert graphs is None
    for (tokens, lps), (ref_tokens, ref_lps) in zip(runs["triton"], runs["torch"]):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


class _StaleReplays(_EagerReplays):
    """A graph that does not read its inputs again: every replay returns what the capture saw."""

    def _warm_up(self, size: int) -> tuple:
        args = super()._warm_up(size)
        self.__dict__.setdefault("stale", {})[size] = self.model(*args).clone()
        return args

    def replay(self, size: int) -> torch.Tensor:
        return self.stale[size]


def test_a_graph_that_replays_stale_inputs_leaves_the_engine_eager(tmp_path, monkeypatch, caplog):
    """The start-up check replays the largest and smallest graphs after changing their inputs:
    one that answers with what it captured is dropped, logged, and the steps run eagerly."""
    from tokenloom import LLM, SamplingParams

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", _StaleReplays)
    monkeypatch.setattr(cuda_graph, "why_eager", lambda config, device, backend: why_eager(config, CUDA, backend))
    model = tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.F32, seed=11)
    with caplog.at_level("ERROR", logger="tokenloom.worker.cuda_graph"), \
            LLM(model, dtype="float32", quantization=None, multiprocess=False, max_model_len=64, max_num_seqs=2,
                kv_cache_memory_bytes=4 << 20, attention_backend="triton") as llm:
        assert llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.graphs is None
        assert llm.llm_engine.info.cuda_graphs == ""
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert "replays other hidden states than the eager forward" in caplog.text
