"""diffstage stage runtime: a vLLM-Omni-style diffusion engine serving real diffusers pipelines."""

__version__ = "0.1.0"
