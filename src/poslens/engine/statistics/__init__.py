"""Statistics on the hook engine, one class per file (see docs/architecture.md, "Add a statistic")."""

from poslens.engine.statistics.activation_norm import ActivationNorm

__all__ = ["ActivationNorm"]
