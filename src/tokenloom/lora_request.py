"""vLLM's `LoRARequest`: which LoRA adapter a request runs with.

`lora_int_id` identifies the adapter (two requests with the same id share its loaded weights and
their prefix-cache blocks; 0 is not an adapter), `lora_name` is what the server calls it, and
`lora_path` is a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).
A msgspec struct: it crosses to the engine core with the request.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, kw_only=False, omit_defaults=True):  # type: ignore[call-arg]
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # vLLM's older name for lora_path, and its cap on the adapter's rank-independent state: taken
    # so that vLLM's calls construct, not used.
    lora_local_path: str | None = None
    long_lora_max_len: int | None = None
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_path and self.lora_local_path:
            msgspec.structs.force_setattr(self, "lora_path", self.lora_local_path)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_request.lora_path must name a PEFT adapter directory.")

    # vLLM's property names.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
