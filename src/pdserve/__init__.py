"""pdserve: an LLM serving engine built around disaggregated prefill/decode."""

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.frontend.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model code; import it only when asked for
    if name == "LLM":
        from pdserve.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
