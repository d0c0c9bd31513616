"""Hub ids: a model or tokenizer named as on the Hugging Face Hub, downloaded with huggingface_hub.

`org/name` is a repo of an HF model (config.json, safetensors, tokenizer); `org/name-GGUF:Q4_K_M`
picks that repo's GGUF of one quantization by its file name, as llama.cpp's `-hf repo:quant` does
(default Q4_K_M, else the repo's first GGUF); `org/name-GGUF/file.gguf` names one file. A split
GGUF (`-00001-of-00003`) is fetched whole.

Only the files the engine reads are fetched (allow_patterns): config, generation config,
tokenizer, sentence-transformers pooling files, and safetensors (never .bin) or the one GGUF; no
weights at all for `load_format="dummy"`. huggingface_hub does the rest: its cache ($HF_HUB_CACHE,
$HF_HOME, or `download_dir`), the token ($HF_TOKEN, `hf auth login`, or `hf_token`), progress bars,
resumed downloads, and the cache alone under HF_HUB_OFFLINE=1.

The caller's front end resolves hub ids once, before the engine core starts
(`fetch_model_files`), so the core only ever reads local paths.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from tokenloom import envs
from tokenloom.model.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

# org/name, optionally :TAG (a GGUF's quantization) or /path/to/file.gguf. Hub names are letters,
# digits, '-', '_' and '.', and neither part starts with '.' or '-'.
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART}?)(?::(?P<tag>[A-Za-z0-9_.-]+)|/(?P<file>[^:]+\.gguf))?$",
                     re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's default for `-hf repo` without a tag

# What the engine reads from a model directory besides its weights.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "tekken.json", "chat_template.jinja",
                   "chat_template.json")
# sentence-transformers' description of how an embedding model pools (model/pooling_config.py).
POOLING_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "*_Pooling/config.json")


@dataclass(frozen=True)
class HubId:
    repo: str
    tag: str | None = None  # a GGUF's quantization, e.g. Q4_K_M
    filename: str | None = None  # one file of the repo


def parse_hub_id(name: str | None) -> HubId | None:
    """The hub id `name` spells, or None when it is no hub id: unset, an existing path, or not
    of the form org/name[:TAG | /file.gguf]."""
    if name is None or os.path.exists(os.path.expanduser(name)) or name.startswith(("/", ".", "~")):
        return None
    match = _HUB_ID.match(name)
    if match is None or match["repo"].lower().endswith(".gguf"):  # a GGUF path that does not exist
        return None
    return HubId(match["repo"], match["tag"], match["file"])


def fetch_model_files(config: Any) -> None:
    """Downloads (or finds in the cache) what the hub ids of `config.model` and `config.tokenizer`
    name, and rewrites both to local paths, in place; then clears `config.hf_token`, which the
    engine core does not need. A local path is left as it is, so a second call does nothing."""
    token = config.hf_token
    model_id = parse_hub_id(config.model)
    if model_id is not None:
        config.model = download(config.model, model_id, revision=config.revision, token=token,
                                cache_dir=config.download_dir, load_format=config.load_format)
    tokenizer_id = parse_hub_id(config.tokenizer)
    if tokenizer_id is not None:
        config.tokenizer = download(config.tokenizer, tokenizer_id, revision=config.tokenizer_revision, token=token,
                                    cache_dir=config.download_dir, tokenizer_only=True)
    elif (config.tokenizer is None and model_id is not None and config.tokenizer_revision is not None
          and config.tokenizer_revision != config.revision):
        # The model's own tokenizer, at another revision (vLLM's tokenizer_revision).
        config.tokenizer = download(model_id.repo, HubId(model_id.repo), revision=config.tokenizer_revision,
                                    token=token, cache_dir=config.download_dir, tokenizer_only=True)
    config.hf_token = None


def download(name: str, hub_id: HubId, *, revision: str | None = None, token: str | bool | None = None,
             cache_dir: str | None = None, load_format: str = "auto", tokenizer_only: bool = False) -> str:
    """The local path of what `hub_id` names: the snapshot folder of an HF repo, or the (first)
    GGUF file; only the files the engine reads are fetched. A ModelNotFoundError of one line says
    what went wrong (missing repo, gated repo, unknown revision, nothing loadable, offline)."""
    from huggingface_hub import snapshot_download

    options = dict(revision=revision, token=token, cache_dir=cache_dir or envs.hf_hub_cache(),
                   endpoint=envs.hf_endpoint())
    offline = envs.hf_hub_offline()
    with _one_line_errors(name, revision, offline, options["cache_dir"]):
        files = _cached_files(hub_id.repo, options) if offline else _repo_files(hub_id.repo, options)
        picked, target = pick_files(name, hub_id, files, load_format=load_format, tokenizer_only=tokenizer_only)
        folder = snapshot_download(hub_id.repo, allow_patterns=picked, local_files_only=offline, **options)
    logger.info("%s: %s", name, folder)
    return os.path.join(folder, target) if target else folder


def _repo_files(repo: str, options: dict[str, Any]) -> list[str]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=options["endpoint"], token=options["token"])
    return api.list_repo_files(repo, revision=options["revision"])


def _cached_files(repo: str, options: dict[str, Any]) -> list[str]:
    """The files of `repo` at the revision that the cache holds (HF_HUB_OFFLINE=1): no pattern
    matches, so huggingface_hub returns the snapshot folder without checking it is complete."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo, allow_patterns=[], local_files_only=True, **options)
    found = []
    for root, _, names in os.walk(folder, followlinks=True):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f.replace(os.sep, "/") for f in found)


def pick_files(name: str, hub_id: HubId, files: list[str], *, load_format: str = "auto",
               tokenizer_only: bool = False) -> tuple[list[str], str]:
    """(the repo files to fetch, the path inside the snapshot to load: "" for the folder).
    Raises ModelNotFoundError when the repo has nothing the engine loads."""
    metadata = [f for f in files if _is_metadata(f, tokenizer_only)]
    if tokenizer_only:
        if not any(f in ("tokenizer.json", "tokenizer.model", "tekken.json") for f in metadata):
            raise ModelNotFoundError(f"{name}: no tokenizer files (tokenizer.json) in the repo")
        return metadata, ""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    safetensors = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if hub_id.filename is not None or hub_id.tag is not None or load_format == "gguf" or (ggufs and not safetensors
                                                                                          and load_format != "dummy"):
        gguf = _pick_gguf(name, hub_id, files, ggufs)
        return _split_parts(gguf, files), gguf
    if "config.json" not in files:
        raise ModelNotFoundError(f"{name}: no loadable weights (no config.json with *.safetensors, and no *.gguf) in "
                                 "the repo")
    if load_format == "dummy":
        return metadata, ""
    if not safetensors:
        bins = [f for f in files if f.endswith(".bin") and "/" not in f]
        raise ModelNotFoundError(f"{name}: no loadable weights: no *.safetensors in the repo"
                                 + (" (only PyTorch .bin files, which tokenloom does not load)" if bins else ""))
    if len(safetensors) > 1:
        # Mistral's repos ship its own single-file format beside the HF shards: the shards are read.
        safetensors = [f for f in safetensors if not f.startswith("consolidated")] or safetensors
    index = [f for f in files if f == "model.safetensors.index.json"]
    return metadata + index + safetensors, ""


def _is_metadata(path: str, tokenizer_only: bool) -> bool:
    if tokenizer_only:
        return path in TOKENIZER_FILES or path == "config.json"
    return path in CONFIG_FILES or path in TOKENIZER_FILES or any(fnmatch.fnmatch(path, p) for p in POOLING_FILES)


def _pick_gguf(name: str, hub_id: HubId, files: list[str], ggufs: list[str]) -> str:
    """The GGUF file `hub_id` names: by file name, or by quantization tag as llama.cpp's -hf does
    (the tag between separators in the file name, case-insensitive; no tag: Q4_K_M, else the
    first). A split GGUF is named by its first part."""
    if hub_id.filename is not None:
        if hub_id.filename not in files:
            raise ModelNotFoundError(f"{name}: no file {hub_id.filename!r} in {hub_id.repo}"
                                     + (f" (its GGUF files: {', '.join(ggufs[:8])})" if ggufs else ""))
        return _first_part(hub_id.filename)
    if not ggufs:
        what = "no *.gguf file to pick the tag from" if hub_id.tag else "no *.gguf or *.safetensors"
        raise ModelNotFoundError(f"{name}: no loadable weights: {what} in the repo")
    tag = hub_id.tag or DEFAULT_GGUF_TAG
    matching = sorted({_first_part(f) for f in ggufs if _has_tag(f, tag)}, key=lambda f: (f.count("/"), len(f), f))
    if matching:
        return matching[0]
    if hub_id.tag is None:
        return sorted(_first_part(f) for f in ggufs)[0]
    tags = sorted({t for f in ggufs if (t := _tag_of(f))})
    raise ModelNotFoundError(f"{name}: no GGUF of quantization {tag!r} in {hub_id.repo}"
                             + (f" (it has: {', '.join(tags)})" if tags else f" (its files: {', '.join(ggufs[:8])})"))


def _stem(path: str) -> str:
    """The file's path without `.gguf` and a split suffix: where the quantization tag is."""
    return _SPLIT.sub(".gguf", path)[: -len(".gguf")]


def _has_tag(path: str, tag: str) -> bool:
    return re.search(rf"(?:^|[-._/]){re.escape(tag)}(?=[-./]|$)", _stem(path), re.IGNORECASE) is not None


_QUANT = re.compile(r"(?:^|[-._/])((?:I?Q\d+_[A-Z0-9_]+|Q\d+_\d|F16|BF16|F32|Q8_0|TQ\d_\d))(?:[-./]|$)", re.IGNORECASE)


def _tag_of(path: str) -> str | None:
    match = _QUANT.search(_stem(path))
    return match.group(1) if match else None


def _first_part(path: str) -> str:
    match = _SPLIT.search(path)
    if match is None:
        return path
    return path[: match.start()] + f"-{1:05d}-of-{match.group(2)}.gguf"


def _split_parts(first: str, files: list[str]) -> list[str]:
    """Every part of a split GGUF (`x-00001-of-00003.gguf`: x-00002, x-00003), or the one file."""
    match = _SPLIT.search(first)
    if match is None:
        return [first]
    total = int(match.group(2))
    prefix = first[: match.start()]
    parts = [f"{prefix}-{i:05d}-of-{match.group(2)}.gguf" for i in range(1, total + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise ModelNotFoundError(f"{first}: split GGUF with parts missing from the repo: {', '.join(missing)}")
    return parts


class _one_line_errors:
    """huggingface_hub's errors (multi-line, with URLs) as one ModelNotFoundError line each."""

    def __init__(self, name: str, revision: str | None, offline: bool, cache_dir: str | None) -> None:
        self.name, self.revision, self.offline, self.cache_dir = name, revision, offline, cache_dir

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, _tb: Any) -> bool:
        if error is None or isinstance(error, ModelNotFoundError):
            return False
        from huggingface_hub import errors as hub_errors

        name = self.name
        if isinstance(error, hub_errors.GatedRepoError):
            message = (f"{name}: gated repository: accept its terms on the hub and pass hf_token= (--hf-token) or "
                       "set HF_TOKEN")
        elif isinstance(error, hub_errors.RepositoryNotFoundError):
            message = (f"{name}: no such model repository on {envs.hf_endpoint() or 'the hub'} (a private one needs "
                       "hf_token= or HF_TOKEN)")
        elif isinstance(error, hub_errors.RevisionNotFoundError):
            message = f"{name}: revision {self.revision!r} does not exist in the repository"
        elif isinstance(error, hub_errors.LocalEntryNotFoundError) or (
                self.offline and isinstance(error, (hub_errors.OfflineModeIsEnabled, FileNotFoundError))):
            where = self.cache_dir or "the hub cache"
            message = (f"{name}: not in {where} at revision {self.revision or 'main'}, and HF_HUB_OFFLINE=1 allows "
                       "no download" if self.offline else
                       f"{name}: the hub cannot be reached and the files are not in {where}")
        elif isinstance(error, hub_errors.HfHubHTTPError):
            status = getattr(error.response, "status_code", "?")
            message = f"{name}: the hub answered HTTP {status}: {str(error).splitlines()[0]}"
        elif isinstance(error, OSError):
            message = f"{name}: download failed: {error}"
        else:
            return False
        raise ModelNotFoundError(message) from None
