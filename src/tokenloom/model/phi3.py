"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama decoder of llama.py, whose checkpoints store
q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, the layout our decoder computes in, so
they load as they are. The rest is configuration that llama.py and rope.py read: LongRoPE
(`rope_type: longrope`, short and long factors), partial rotary (Phi-4-mini rotates three
quarters of each head) and a sliding window over every layer where the config sets one."""
from __future__ import annotations

from tokenloom.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Llama's, with each layer's q/k/v and gate/up under their fused names."""
        shapes = super().checkpoint_shapes()
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                 ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
                block = fused.split(".")[0]
                rows = [shapes.pop(f"{p}{block}.{part}.weight") for part in parts]
                shapes[f"{p}{fused}.weight"] = (sum(r[0] for r in rows), rows[0][1])
        return shapes
