"""trainstream.prototype: features not yet shown to win in a same-run GPU A/B are off by default, each a wrap()
option whose default is its `off` value, and the options table in docs/options.md says so."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import trainstream
from trainstream._options import WrapOptions
from ts_testing import tiny_llama

OPTIONS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "options.md"


def test_every_prototype_is_an_option_off_by_default():
    defaults = {f.name: f.default for f in dataclasses.fields(WrapOptions)}
    for feature in trainstream.prototype.FEATURES:
        assert feature.option in defaults, feature.option
        assert defaults[feature.option] == feature.off, feature.option
        assert feature.what and feature.graduates_when
    assert trainstream.prototype.feature("peer").off is False
    with pytest.raises(KeyError, match="not a prototype feature"):
        trainstream.prototype.feature("quantize")


def test_the_options_page_lists_each_prototype_with_its_default():
    text = OPTIONS.read_text()
    for feature in trainstream.prototype.FEATURES:
        row = re.search(rf"^\| `{feature.option}` \|[^|]*\| `([^`]*)` \|(.*)$", text, re.M)
        assert row is not None, feature.option
        assert row.group(1) == repr(feature.off).replace("'", '"'), feature.option
        if feature.option != "recompute_variant":  # its row describes both values; the prototype is one of them
            assert "Prototype, off by default" in row.group(2), feature.option
        assert f"`{feature.option}`" in text.split("#### Prototype features")[1].split("###")[0]


def test_the_mapped_adamw_trial_starts_only_when_asked():
    for asked in (False, True):
        model, _ = trainstream.wrap(tiny_llama(), lr=1e-3, mapped_trial=asked)
        session = model._trainstream_session
        session._start_mapped_trial(room=1 << 40)  # what offload="auto" calls when the state stays on the host
        assert (session.trial is not None) is asked
        session.trial = None
        trainstream.unwrap(model)
    with pytest.raises(ValueError, match="mapped_trial"):
        trainstream.wrap(tiny_llama(), mapped_trial="yes")
