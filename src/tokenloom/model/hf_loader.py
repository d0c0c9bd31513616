"""HF model directories' weights: `*.safetensors` (one file or sharded with
`model.safetensors.index.json`). The config is read by hf_config.py."""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.hf_config import _read_json

_INDEX_FILE = "model.safetensors.index.json"


def _safetensors_files(directory: str) -> dict[str, str]:
    """Tensor name -> file holding it."""
    index = os.path.join(directory, _INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map") or {}
        files = {n: os.path.join(directory, f) for n, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not os.path.isfile(f):
                raise ModelNotFoundError(f"{f}: shard listed in {index} does not exist")
        return files
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise ModelNotFoundError(f"{directory}: no *.safetensors files (other weight formats are not supported)")
    files: dict[str, str] = {}
    for p in paths:
        with safe_open(p, framework="pt") as f:
            for name in f.keys():
                files[name] = p
    return files


class CheckpointTensors:
    """A safetensors checkpoint's tensors read one at a time by name (a pre-quantized checkpoint's
    codes and scales, read next to each other), each file opened once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files = _safetensors_files(directory)
        self._open: dict[str, Any] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def _file(self, name: str) -> Any:
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def dtype(self, name: str) -> str | None:
        """The stored dtype's safetensors name ("I8", "F8_E4M3", "BF16", ...); None if absent."""
        return self._file(name).get_slice(name).get_dtype() if name in self.files else None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ModelLoadError(f"{name}: missing tensor in {self.directory}")
        return self._file(name).get_tensor(name)


def iter_hf_weights(directory: str, expected: dict[str, tuple[int, ...]],
                    dtype: torch.dtype, optional: set[str] = frozenset(),  # type: ignore[assignment]
                    strip_prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in `dtype`: a float one; integer tensors, MXFP4's packed bytes, as stored)
    for every expected tensor, one file at a time. Presence and
    shapes of all tensors are checked (from the safetensors headers) before any is read.
    A checkpoint saved from the bare decoder (an HF `*Model`: `layers.0...`, not
    `model.layers.0...`) is read under the expected names; tensors in `optional` may be absent.
    `strip_prefix`: a classifier's prefix before the encoder's names (`bert.`), expected without it."""
    files = _safetensors_files(directory)
    if strip_prefix and any(n.startswith(strip_prefix) for n in files):
        stored = {n.removeprefix(strip_prefix): n for n in files}
        files = {n.removeprefix(strip_prefix): p for n, p in files.items()}
    elif not any(n.startswith("model.") for n in files) and any(n.startswith("layers.") for n in files):
        files = {f"model.{n}": p for n, p in files.items()}
        stored = {n: n.removeprefix("model.") for n in files}
    else:
        stored = {n: n for n in files}
    by_file: dict[str, list[str]] = {}
    for name, shape in expected.items():
        path = files.get(name)
        if path is None:
            if name in optional:
                continue
            raise ModelLoadError(f"{name}: missing tensor (expected shape {shape}) in {directory}")
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if stored[name] not in present:
                    raise ModelLoadError(f"{name}: missing tensor (the index names it) in {path}")
                got = tuple(f.get_slice(stored[name]).get_shape())
                if got != expected[name]:
                    raise ModelLoadError(f"{name}: expected shape {expected[name]}, got {got} in {path}")
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                t = f.get_tensor(stored[name])
                yield name, t.to(dtype) if t.is_floating_point() else t


def classifier_score_weight(directory: str, config: ModelArchConfig, embedding: torch.Tensor) -> torch.Tensor:
    """A classifier's `score` weight made from LM-head rows (config.classifier_token_ids, by
    config.classifier_method; see hf_config.CLASSIFIER_METHODS), in float32: the LM head is the
    checkpoint's `lm_head.weight`, of which only those rows are read, or the embedding of a tied
    model."""
    ids = config.classifier_token_ids
    assert ids is not None
    if config.tie_word_embeddings:
        rows = embedding[list(ids)].float()
    else:
        path = _safetensors_files(directory).get("lm_head.weight")
        if path is None:
            raise ModelLoadError(f"lm_head.weight: missing tensor in {directory} (classifier_from_token reads the "
                                 "LM head's rows of its tokens; the config says tie_word_embeddings=false)")
        with safe_open(path, framework="pt") as f:
            head = f.get_slice("lm_head.weight")
            shape = tuple(head.get_shape())
            if shape != (config.vocab_size, config.hidden_size):
                raise ModelLoadError(f"lm_head.weight: expected shape {(config.vocab_size, config.hidden_size)}, "
                                     f"got {shape} in {path}")
            rows = torch.cat([head[i:i + 1] for i in ids]).float()
    if config.classifier_method == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]  # true minus false: sigmoid of it is the pair's softmax
    return rows
