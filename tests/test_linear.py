"""The CPU matrix-product paths give nn.Linear's numbers for every batch size."""

import pytest
import torch
from torch import nn

from lifeofprompt.model.linear import FEW_ROWS, Linear, few_rows_linear, onednn_available, prepack_cpu_weights


def pair(in_features=96, out_features=160, seed=0):
    torch.manual_seed(seed)
    ours = Linear(in_features, out_features, bias=False)
    plain = nn.Linear(in_features, out_features, bias=False)
    plain.weight.data.copy_(ours.weight.data)
    return ours, plain


@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 17, 300])
@pytest.mark.parametrize("packed", [False, True])
@torch.no_grad()
def test_every_path_matches_nn_linear(rows, packed):
    ours, plain = pair()
    if packed:
        ours.prepack()
    x = torch.randn(rows, 96)
    out = ours(x)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)


def test_few_rows_path_is_the_transposed_product():
    w, x = torch.randn(7, 5), torch.randn(1, 5)
    torch.testing.assert_close(few_rows_linear(x, w), x @ w.t())


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_prepack_reports_the_copy_and_training_uses_the_weights():
    ours, plain = pair()
    assert prepack_cpu_weights(nn.Sequential(ours, nn.ReLU())) == 96 * 160 * 4
    x = torch.randn(8, 96, requires_grad=True)
    ours(x).sum().backward()               # with grad enabled the packed copy is not used
    assert ours.weight.grad is not None and x.grad is not None
    with torch.no_grad():                  # a stale packed copy is what the docs warn about: show it
        ours.weight.mul_(2)
        torch.testing.assert_close(ours(torch.ones(8, 96)), plain(torch.ones(8, 96)), rtol=1e-5, atol=1e-5)
        ours.prepack()
        torch.testing.assert_close(ours(torch.ones(8, 96)), 2 * plain(torch.ones(8, 96)), rtol=1e-5, atol=1e-4)
