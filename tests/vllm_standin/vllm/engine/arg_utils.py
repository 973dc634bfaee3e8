"""``vllm.engine.arg_utils.EngineArgs`` of vLLM 0.32.0: the method the plugin wraps in vLLM's main process.

vLLM's ``create_engine_config`` builds a ``VllmConfig``, whose ``ModelConfig`` needs a model on disk; this
stand-in's builds a namespace holding the one value the plugin reads from it, the served model name, by
vLLM's rule (``vllm.config.model.get_served_model_name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass
class EngineArgs:
    """The arguments of ``vllm serve``, as far as the served model name goes."""

    model: str = "Qwen/Qwen3-0.6B"
    served_model_name: str | list[str] | None = None

    def create_engine_config(self, usage_context: Any = None, headless: bool = False) -> Any:
        """Create the VllmConfig."""
        served_model_name = self.served_model_name
        if isinstance(served_model_name, list):
            served_model_name = served_model_name[0] if served_model_name else None
        return SimpleNamespace(model_config=SimpleNamespace(served_model_name=served_model_name or self.model))
