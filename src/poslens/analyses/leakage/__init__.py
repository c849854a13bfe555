"""Absolute-position leakage in RoPE models (Ruscio, Nanni & Silvestri 2026): metrics, the mask-only
counterfactual, interventions and nulls with paired contrasts, the predecessor's test, the parameter-free split,
position 0 and sinks, and the `poslens leakage` pipeline (docs/leakage.md)."""
