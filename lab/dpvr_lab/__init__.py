"""dpvr's experiments (:mod:`dpvr_lab.experiments`) and benchmarks (:mod:`dpvr_lab.bench`).

A separate distribution (``dpvr-lab``) so that the library itself needs neither matplotlib nor scikit-learn;
``dpvr experiment``, ``dpvr bench`` and ``dpvr compare`` run this code when it is installed.
"""
