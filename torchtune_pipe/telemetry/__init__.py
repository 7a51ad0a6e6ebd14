"""Telemetry: what a running pipeline measures, per stage and per process, and the memory of
its process tree."""
