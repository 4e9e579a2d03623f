"""find_blocks picks the repeated layer stack."""

import torch
import trainstream
from ts_testing import tiny_llama


def test_finds_the_decoder_layers_of_a_llama():
    model = tiny_llama(layers=3)
    blocks = trainstream.find_blocks(model)
    assert blocks == list(model.model.layers)


def test_prefers_the_stack_with_more_parameters_and_ignores_mixed_lists():
    small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(8)])
    big = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(2)])
    mixed = torch.nn.ModuleList([torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128)])
    model = torch.nn.ModuleDict({"small": small, "big": big, "mixed": mixed})
    assert trainstream.find_blocks(model) == list(big)
    assert trainstream.find_blocks(torch.nn.Linear(3, 3)) == []
