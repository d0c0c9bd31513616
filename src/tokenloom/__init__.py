"""tokenloom: an LLM inference engine with vLLM's V1 execution path and a ledger of where every
request's time went."""
from tokenloom.lora_request import LoRARequest
from tokenloom.pooling_params import PoolerConfig, PoolingParams
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine", "AsyncLLM", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "PoolingParams", "PoolerConfig",
           "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]


def __getattr__(name: str):  # lazy: `import tokenloom` must stay cheap (no torch import)
    if name == "LLM":
        from tokenloom.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
                "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
                "ScoringRequestOutput"):
        from tokenloom import outputs

        return getattr(outputs, name)
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from tokenloom.entrypoints import engine_args

        return getattr(engine_args, name)
    if name in ("BeamSearchOutput", "BeamSearchSequence"):
        from tokenloom.entrypoints import beam_search

        return getattr(beam_search, name)
    if name == "LLMEngine":
        from tokenloom.engine.llm_engine import LLMEngine

        return LLMEngine
    # vLLM V1's `AsyncLLMEngine` is an alias of its AsyncLLM; so is tokenloom's.
    if name in ("AsyncLLMEngine", "AsyncLLM"):
        from tokenloom.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
