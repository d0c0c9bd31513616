"""LoRA adapters on the server, as vLLM serves them: `--lora-modules name=path` makes each adapter
a model of its own name (a request's `model` picks it; /v1/models lists it with the base model as
its `parent`), and with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (vLLM's switch; or
TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING) POST /v1/load_lora_adapter and /v1/unload_lora_adapter add
and remove them while it runs. An adapter's config is checked when it is named (its rank against
--max-lora-rank, its options); the engine core loads its weights on its first request."""
from __future__ import annotations

import itertools
from typing import Any

from starlette.responses import Response

from tokenloom import envs
from tokenloom.entrypoints.openai.file_io import run_file_io
from tokenloom.entrypoints.openai.protocol import OpenAIServingError, _Request, bad_request
from tokenloom.lora_request import LoRARequest
from tokenloom.model.lora_config import read_adapter_config


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed() -> bool:
    return envs.runtime_lora_updating()


def check_lora_modules(modules: dict[str, str], enable_lora: bool, max_lora_rank: int, served: list[str]) -> None:
    """--lora-modules checked before anything starts: LoRA on, names free, configs readable."""
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    for name, path in modules.items():
        if name in served:
            raise ValueError(f"--lora-modules: {name!r} is already the served model's name.")
        read_adapter_config(path, max_lora_rank)


class LoRAModules:
    """The adapters the server serves, by name (`requests`, shared with every endpoint)."""

    def __init__(self, engine: Any, served_model_names: list[str], modules: dict[str, str]) -> None:
        self.engine = engine
        self.served = served_model_names
        self.requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        check_lora_modules(modules, engine.config.enable_lora, engine.config.max_lora_rank, served_model_names)
        for name, path in modules.items():
            self.requests[name] = LoRARequest(name, next(self._ids), path)

    def _check_allowed(self) -> None:
        if not runtime_updates_allowed():
            raise OpenAIServingError("Loading and unloading LoRA adapters at run time is off: start the server with "
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true to allow it.", 403, "invalid_request_error",
                                     None, "runtime_lora_updating_off")
        if not self.engine.config.enable_lora:
            raise bad_request("LoRA adapters need the server started with --enable-lora.")

    async def load(self, name: str, path: str) -> Response:
        self._check_allowed()
        self._check_name_free(name)
        # The adapter's id, never reused: a new adapter under an old name gets its own prefix cache.
        # Its config is read (and cached under this id) on a thread of its own: a read that blocks
        # (a hung mount) must hold neither the event loop nor the tokenizer pool.
        lora = LoRARequest(name, next(self._ids), path)
        try:
            await run_file_io(self.engine.input_processor.check_lora, lora, path=path, param="lora_path")
        except ValueError as e:
            raise bad_request(str(e).replace("lora_request.lora_path", "lora_path"), param="lora_path") from None
        self._check_name_free(name)  # again: another load may have taken it meanwhile
        self.requests[name] = lora
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    def _check_name_free(self, name: str) -> None:
        if not name or name in self.served or name in self.requests:
            raise bad_request(f"The adapter name {name!r} is already served (or empty); unload it first.",
                              param="lora_name")

    def unload(self, name: str) -> Response:
        self._check_allowed()
        if name not in self.requests:
            raise OpenAIServingError(f"The LoRA adapter {name!r} is not served.", 404, "not_found_error", "lora_name",
                                     "lora_not_found")
        del self.requests[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
