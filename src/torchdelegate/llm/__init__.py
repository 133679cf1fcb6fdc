"""Language models on loaded programs: generating tokens with their ``prefill`` and ``decode``."""

from torchdelegate.llm.generation import Generation, GenerationStats, Generator, Sampling

__all__ = ["Generation", "GenerationStats", "Generator", "Sampling"]
