"""Simulated GPUs: cost models of GPU decoding and training (`profiles.py`) that the `sim` engine and the
`sim` training backend run behind the real interfaces, so the control plane can be measured at cluster scale
on a laptop (docs/simulation.md)."""
