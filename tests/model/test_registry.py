"""The model registry is the one table of what runs: docs/models.md and README's table are
generated from it (stale copies fail here), the config readers take their architecture names
from it, and every entry's class exists and builds."""
from __future__ import annotations

import subprocess
import sys

from tokenloom.model import registry
from tokenloom.model.registry import (GGUF_ARCHITECTURES, HF_ARCHITECTURES, MODELS_PAGE, README,
                                      TEXT_GENERATION_MODELS, models_page_markdown, readme_with_table)


def test_models_page_and_readme_table_are_current():
    stale = "run `python -m tokenloom.model.registry`"
    assert MODELS_PAGE.read_text() == models_page_markdown(), f"docs/models.md is stale: {stale}"
    assert README.read_text() == readme_with_table(README.read_text()), f"README.md's model table is stale: {stale}"
    for hf in TEXT_GENERATION_MODELS:
        assert f"| `{hf}` |" in MODELS_PAGE.read_text()


def test_every_entry_names_a_class_that_exists():
    for hf, entry in TEXT_GENERATION_MODELS.items():
        cls = registry.model_class(entry.architecture)
        assert cls.__name__ == entry.class_name, hf
        assert HF_ARCHITECTURES[hf] == entry.architecture
        for name in entry.pooling:
            assert HF_ARCHITECTURES[name] == entry.architecture
    assert GGUF_ARCHITECTURES["llama"] == "llama"  # Mistral's GGUFs say llama too: Llama's entry reads them


def test_registry_imports_no_torch():
    # The caller's process reads configs through the table; torch is the engine core's.
    code = "import sys, tokenloom.model.registry, tokenloom.model.hf_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
