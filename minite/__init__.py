"""miniTE: reinforcement learning of LLMs with native NVFP4 on sampler and learner."""

__version__ = "0.1.0"
