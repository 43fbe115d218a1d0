"""Orchestration over calibrate, evaluate and report: sweeps (calibrate once per recipe, evaluate every cell)
and sensitivity (per-layer KL damage of a format)."""
