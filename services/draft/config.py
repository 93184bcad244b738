"""The draft service's config (``python -m services.draft``)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import ServiceConfig
from shared.spec.factory import DEFAULT_DRAFTER


@dataclass(frozen=True, slots=True)
class DraftConfig(ServiceConfig):
    """The draft service (``services/draft``): proposes tokens for decode workers of ``model``."""

    ID_PREFIX = "draft"
    model: str = ""  # the target model (GGUF file or HF folder; "" = default SmolLM2): its id names the subject
    drafter: str = DEFAULT_DRAFTER  # prompt_lookup | self:<layers> | a smaller model's path (same vocabulary)
    window: int = 128  # a model drafter attends the last window..window+stride tokens (KV kept across steps)
    dtype: str = "auto"
    threads: int = 0  # 0 = all CPUs this process may use
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    drain_grace_s: float = 5.0

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)  # slots=True rebuilds the class: no zero-argument super()
        if self.window < 1 or self.threads < 0 or self.heartbeat_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("invalid draft service config")
