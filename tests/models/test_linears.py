"""Finding and replacing a model's linear layers (`specula.models.linears`)."""

import gc
import weakref

import torch
from torch import nn

from specula.models.linears import replace_linears


class Wrapped(nn.Module):
    """A stand-in replacement that copies its layer's weight (as packing does) and keeps no reference to it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("copy", linear.weight.detach().clone())


def test_each_replaced_layer_is_freed_before_the_next_is_replaced():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))
    originals = [weakref.ref(m) for m in model.modules() if isinstance(m, nn.Linear)]
    alive_when_made = []

    def make(linear: nn.Module) -> nn.Module:
        gc.collect()
        alive_when_made.append(sum(ref() is not None for ref in originals))
        return Wrapped(linear)

    weights = [m.weight.detach().clone() for m in model.modules() if isinstance(m, nn.Linear)]
    replace_linears(model, make)
    # the layer being replaced is alive; every one replaced before it is gone (old and new weights
    # of a whole model are never held at once)
    assert alive_when_made == [3, 2, 1]
    replaced = [m for m in model.modules() if isinstance(m, Wrapped)]
    assert [torch.equal(r.copy, w) for r, w in zip(replaced, weights)] == [True] * 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_skipped_layers_stay():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    kept = model[1]
    replace_linears(model, Wrapped, skip=["1"])
    assert isinstance(model[0], Wrapped) and model[1] is kept
