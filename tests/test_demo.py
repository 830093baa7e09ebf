import copy

import pytest
import torch

from ntk import demo


def _data():
    d = demo.digits(n_train=96)
    return d.x_train, d.y_train


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_checkpoints_are_the_states_of_one_run():
    x, y = _data()
    torch.manual_seed(3)
    init = demo.mlp(hidden=16)
    recipe = dict(epochs=6, batch_size=32, seed=5)
    states = demo.train_checkpoints(copy.deepcopy(init), x, y, count=3, **recipe)
    assert len(states) == 3
    # the last checkpoint is the model `train` gives; each earlier one is a shorter run's end
    for k, state in enumerate(states, start=1):
        shorter = demo.train(copy.deepcopy(init), x, y, **dict(recipe, epochs=2 * k))
        assert _same(state, shorter.state_dict())
    assert not _same(states[0], states[-1])


def test_train_checkpoints_leaves_the_model_trained_in_eval_mode():
    x, y = _data()
    model = demo.mlp(hidden=8)
    states = demo.train_checkpoints(model, x, y, count=2, epochs=3)
    assert not model.training
    assert _same(states[-1], model.state_dict())
    # copies, not views of the live parameters
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(states[-1]["0.weight"], model[0].weight)


@pytest.mark.parametrize("count", [0, 4])
def test_train_checkpoints_rejects_a_count_outside_the_epochs(count):
    x, y = _data()
    with pytest.raises(ValueError, match="count must be between 1 and epochs"):
        demo.train_checkpoints(demo.mlp(hidden=8), x, y, count=count, epochs=3)
