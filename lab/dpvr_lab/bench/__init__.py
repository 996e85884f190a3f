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
# The cases at the sizes users train on a GPU (``dpvr bench step --real``): GPT-2 small as a language
# model (T = 512, B = 16 and 32), ResNet-18 with GroupNorm on 32x32 images (B = 256 and 1024), a BERT-base
# classifier (T = 128, B = 32). ``--reduced`` runs each with the same architecture at a small size (CPU
# tests, dry runs).
REAL_CASES = ("gpt2-small-b16", "gpt2-small-b32", "resnet18-b256", "resnet18-b1024", "bert-base-b32")
