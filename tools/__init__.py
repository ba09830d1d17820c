"""Orchestration above the runtime: tools that compile, run and compare plans (compare, bench, prefetch, launch)."""
