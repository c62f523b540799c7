"""loraplex engine. `from engine import LLM, SamplingParams, StructuredOutputsParams`."""
from ipc.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # NOTE: LLM pulls in torch and transformers; import it lazily so light users of engine.* stay light.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
