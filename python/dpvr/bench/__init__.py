"""Benchmarks behind ``dpvr bench``: every figure is a ratio measured in one run on one machine."""
