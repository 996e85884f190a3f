"""Issue 48, item 5: settings that were accepted and ignored, or refused with a message about something
else, now refused naming the setting and what it takes.

Before: ``clipping=False`` and ``clipping="per_layer"`` on Poisson DP-SGD were accepted and ignored,
``clip=[...]`` raised a bare ``'>' not supported``, DIFF2 with one ``clip`` number complained about its
restart default, and ``double-spider`` warned that the loader's batch size becomes the expected batch size
(it uses none).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpvr

N = 64
G = torch.Generator().manual_seed(0)
X = torch.randn(N, 3, generator=G)
Y = (X[:, 0] > 0).long()
DATA = TensorDataset(X, Y)


def _dpsgd(**kw):
    return dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), DATA, algorithm="dp-sgd", epsilon=1.0,
                             batch_size=8, steps=2, lr=0.1, **{"clip": 1.0, **kw})


@pytest.mark.parametrize("sampling", ["poisson", "wor", "full"])
def test_clipping_false_is_refused_outside_the_cyclic_run(sampling: str) -> None:
    with pytest.raises(ValueError, match="clipping=False: only sampling='cyclic' takes it"):
        _dpsgd(clipping=False, sampling=sampling)


def test_an_unknown_clipping_policy_is_refused_not_ignored() -> None:
    # clipping="per_layer" and "adaptive" are implemented (tests/optim/test_clipping_per_layer.py,
    # _adaptive.py)
    with pytest.raises(ValueError, match="clipping: True or 'flat' .*'per_layer' .*'adaptive'.* got 'layer'"):
        _dpsgd(clipping="layer")


@pytest.mark.parametrize("clip", [[1.0, 2.0], (1.0,), {"gradient": 1.0}, "1.0"])
def test_a_clip_that_is_not_one_number_names_clip(clip) -> None:
    with pytest.raises(TypeError, match="clip: clipping=True clips each record's whole gradient .* one"):
        _dpsgd(clip=clip)


def test_clipping_true_and_cyclic_clipping_false_still_run() -> None:
    assert _dpsgd(clipping=True).algorithm.clipping is True
    trainer = dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), DATA, algorithm="last-iterate",
                                epsilon=4.0, batch_size=8, epochs=1, lr=0.01, clip=1.0, weak_convexity=1.0,
                                smoothness=1.0, clipping=False)
    assert trainer.algorithm.clipping is False


@pytest.mark.parametrize("algorithm", ["diff2", "private-diff"])
def test_a_scalar_clip_on_a_per_stream_algorithm_says_it_takes_a_mapping(algorithm: str) -> None:
    with pytest.raises(ValueError, match=r"clip: .* takes a mapping: clip=\{\"") as err:
        kw = {"steps": 4} if algorithm == "diff2" else {"steps": 4, "batch_size": 8}
        criterion = nn.CrossEntropyLoss()
        if algorithm == "private-diff":
            from dpvr.objectives import AUCMargin

            criterion = AUCMargin(positive_ratio=0.5)
        dpvr.make_private(nn.Linear(3, 1), criterion, DATA, algorithm=algorithm, epsilon=1.0, lr=0.1,
                          clip=1.0, **kw)
    assert "restart: not given" not in str(err.value)
    if algorithm == "diff2":
        assert '{"restart": C1, "difference": C2' in str(err.value)


def test_the_loader_warning_is_true_for_a_per_stream_algorithm() -> None:
    loader = DataLoader(DATA, batch_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(TypeError, ValueError):  # the settings are beside the point: it warns first
            dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), loader, algorithm="double-spider",
                              epsilon=1.0, steps=2, clip={})
    said = [str(w.message) for w in caught if "DataLoader's sampler" in str(w.message)]
    assert said and all("becomes the expected batch size" not in s for s in said)
    assert "its batch size is not used" in said[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), loader, algorithm="dp-sgd", epsilon=1.0,
                          steps=2, lr=0.1, clip=1.0)
    assert any("becomes the expected batch size" in str(w.message) for w in caught)


def test_dp_gd_lists_a_missing_clip_like_dp_sgd() -> None:
    # DPGD's constructor takes DPSGD's settings as **kwargs: read from its signature, it needed nothing, and a
    # missing clip surfaced as the constructor's TypeError after the run was set up.
    with pytest.raises(ValueError, match="2 problems") as err:
        dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), DATA, algorithm="dp-gd", epsilon=1.0,
                          steps=0, lr=0.1)
    assert "clip: 'dp-gd' needs this setting" in str(err.value)
    assert "steps: the number of steps must be a whole number >= 1, got 0" in str(err.value)


@pytest.mark.parametrize(("algorithm", "home"), [("diff2", "DIFF2"), ("private-diff", "PrivateDiff")])
def test_the_per_stream_clip_messages_name_the_class_where_it_lives(algorithm: str, home: str) -> None:
    from dpvr.objectives import AUCMargin

    criterion = AUCMargin(positive_ratio=0.5) if algorithm == "private-diff" else nn.CrossEntropyLoss()
    kw = {"steps": 4} if algorithm == "diff2" else {"steps": 4, "batch_size": 8}
    for clip in ({"clip": 1.0}, {}):  # a number where a mapping is taken; no clip at all
        with pytest.raises(ValueError) as err:
            dpvr.make_private(nn.Linear(3, 1), criterion, DATA, algorithm=algorithm, epsilon=1.0, lr=0.1,
                              **clip, **kw)
        assert f"(see dpvr.algorithms.{home})" in str(err.value) and "dpvr.optim" not in str(err.value)
