"""Optimal multi-draft acceptance bounds (`bounds`) and their measurement on real models
(`measure`, `plots`; the `specula analyze acceptance` command)."""
