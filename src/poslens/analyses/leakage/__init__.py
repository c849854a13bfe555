"""Absolute-position leakage in RoPE models (Ruscio, Nanni & Silvestri 2026): metrics, the predecessor's test, the
parameter-free split, position 0 and sinks, interventions, and the `poslens leakage` pipeline (docs/leakage.md)."""
