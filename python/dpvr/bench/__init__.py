"""Benchmarks behind ``dpvr bench``: every figure is a ratio measured in one run on one machine."""

# The step benchmark's cases (:mod:`.step`), named here so that the command line lists them without importing
# the benchmark (and the gradient layers) at every ``dpvr`` call.
CASES = ("mlp", "cnn", "transformer", "lstm", "gpt2")
# The cases that grow (``dpvr bench step --scale``; not in the default run): ~10^7 parameters each, and a
# GPT-2-style decoder at three sequence lengths; then GPT-2 small's shape (~1.24 * 10^8) at two lengths.
SCALE_CASES = ("mlp-wide", "resnet", "gpt2-1e7-t128", "gpt2-1e7-t512", "gpt2-1e7-t1024", "gpt2-1e8-t128",
               "gpt2-1e8-t512")
# What ``--scale`` runs without ``--case``: the ~10^8 cases take too long for it, and run one at a time.
SCALE_DEFAULT = tuple(c for c in SCALE_CASES if not c.startswith("gpt2-1e8"))
