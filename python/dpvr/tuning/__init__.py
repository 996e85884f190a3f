"""Private hyper-parameter search inside the privacy budget.

:func:`tune` selects the best of a random number of full private runs with the random-stopping method of
Papernot and Steinke (ICLR 2022): the number of trials is drawn from a truncated negative binomial or a
Poisson distribution and only the best trial is released, so the whole search is one dp_accounting
``RepeatAndSelectDpEvent``, calibrated to the target ``(epsilon, delta)``. The trials must be independent runs
(:mod:`dpvr.tuning.independence` refuses one that shares state with an earlier trial, before it runs), and the
number of trials must stay secret: ``constant_time=True`` keeps the running time from revealing it.
"""

from .search import Trial, TuningResult, epsilon_of, search_event, tune
from .trials import DISTRIBUTIONS, TrialCount, truncated_negative_binomial_mean

__all__ = [
    "DISTRIBUTIONS",
    "Trial",
    "TrialCount",
    "TuningResult",
    "epsilon_of",
    "search_event",
    "truncated_negative_binomial_mean",
    "tune",
]
