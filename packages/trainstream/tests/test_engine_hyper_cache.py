"""The gradient hook's hyper-parameters are checked once per distinct set of values (HyperCache): a
scheduler's new lr is used at once, and a value that compares equal to a checked one but is not valid
(``True == 1``) or cannot be hashed is still refused, naming the group."""

from __future__ import annotations

import pytest
import torch
from trainstream.engine.slots import ParamSlot
from trainstream.engine.updates import HyperCache, hyper_of


def _slot(**group):
    values = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, **group}
    return ParamSlot(param=torch.nn.Parameter(torch.zeros(3)), index=0, group=values)


def test_equal_values_share_one_checked_hyper_and_a_new_lr_is_seen():
    cache = HyperCache()
    slot = _slot()
    first = cache.get(slot, 1.0, 7)
    assert first == hyper_of(slot, 1.0, 7)
    assert cache.get(_slot(), 1.0, 7) is first  # another group with the same values: no new check
    slot.group["lr"] = 5e-4  # a scheduler's step
    assert cache.get(slot, 1.0, 7).lr == 5e-4
    assert cache.get(slot, 0.5, 7).grad_scale == 0.5 and cache.get(slot, 1.0, 8).seed != first.seed


@pytest.mark.parametrize(("key", "checked", "bad", "message"), [
    ("lr", 1, True, "lr=True is not valid"),
    ("weight_decay", 0, False, "weight_decay=False is not valid"),
    ("betas", (0.9, 0.999), [0.9, True], "betas[1]=True is not valid"),
    ("lr", 1e-3, float("nan"), "lr=nan is not valid"),
    ("betas", (0.9, 0.999), ([0.9], 0.999), "betas[0]=[0.9] is not valid"),  # unhashable: checked every time
])
def test_a_bad_value_equal_to_a_checked_one_is_still_refused(key, checked, bad, message):
    cache = HyperCache()
    slot = _slot(**{key: checked})
    cache.get(slot, 1.0, 0)
    slot.group[key] = bad
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cache.get(slot, 1.0, 0)
