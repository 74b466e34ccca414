"""chunkcache: LLM serving with position-independent chunk KV reuse and KV-cache-aware routing."""

from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing it lazily keeps `import chunkcache.router` light.
    if name == "LLM":
        from chunkcache.llm import LLM

        return LLM
    raise AttributeError(name)
