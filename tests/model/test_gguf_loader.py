"""Dequantizing a GGUF's tensors (model/gguf_loader.py) for the float path."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from kquants import quantize

from tokenloom.model import gguf_loader


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("shape", [(37, 512), (512,)])
def test_dequantized_in_chunks_as_in_one_go(qtype, shape, monkeypatch):
    """The loader dequantizes a few rows at a time (a whole table at once held several copies of
    it); the values are the same as gguf's in one call, across chunks of 5 rows with 2 left over."""
    raw = quantize(np.random.default_rng(0).standard_normal(shape).astype(np.float32), qtype)
    monkeypatch.setattr(gguf_loader, "_DEQUANT_CHUNK_BYTES", 5 * 512 * 4)
    got = gguf_loader._dequantize_in_chunks(raw, qtype)
    expected = dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got, expected)


def test_ggml_type_table_is_gguf_pys():
    """tokenloom's own copy of the GGML type ids and block sizes (ops/ggml_types: importing gguf-py
    costs every GGUF-reading process tens of MB) is the file format's as gguf-py has it."""
    import gguf

    from tokenloom.ops import ggml_types

    assert {t.name: int(t) for t in ggml_types.GGMLQuantizationType} == {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {int(k): v for k, v in ggml_types.GGML_QUANT_SIZES.items()} == \
        {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


def test_reading_a_gguf_config_and_tokenizer_leaves_gguf_py_unimported():
    """The caller's process reads the model's config and tokenizer from the GGUF header without
    importing gguf-py, whose package init pulls in mistral_common and more (tens of MB resident)."""
    import subprocess
    import sys

    code = ("import sys\nfrom tokenloom.model.source import default_model_path, load_model_config, load_tokenizer\n"
            "p = default_model_path(); load_model_config(p); load_tokenizer(p)\n"
            "print(sorted(m for m in ('gguf', 'mistral_common', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_released_tensor_pages_leave_the_process_and_read_back_the_same(tmp_path):
    """The loader unmaps each tensor's file pages once it holds its own copy (`GGUFFile.release`):
    the file's bytes stop counting in the process's resident memory, and a tensor read again
    has the same bytes."""
    import gguf

    from tokenloom.model.gguf_file import read_gguf

    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(1)
    for i in range(4):  # 4 x 512 KiB
        w.add_tensor(f"t{i}", rng.standard_normal((256, 512), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_gguf(path)

    def resident_kib() -> int:  # of this file's mapping
        rss, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and " " in line and "-" in line.split()[0]:
                    inside = line.rstrip().endswith(path)
                elif inside and line.startswith("Rss:"):
                    rss += int(line.split()[1])
        return rss

    copies = {n: np.array(g.raw(info)) for n, info in g.tensors.items()}  # every page read
    data_kib = sum(info.nbytes for info in g.tensors.values()) // 1024
    before = resident_kib()
    for info in g.tensors.values():
        g.release(info)
    after = resident_kib()
    assert before >= data_kib and after < before - data_kib // 2
    assert all(np.array_equal(g.raw(info), copies[n]) for n, info in g.tensors.items())
