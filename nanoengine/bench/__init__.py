"""Benchmarks: workloads, the transformers peer, hardware ceilings, JSON results. Chapter 08."""
