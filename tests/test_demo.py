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


def test_train_refuses_bad_arguments_naming_them():
    """y shorter than x trained on its rows alone, lr=inf or 0 and epochs=-1 returned a model
    silently, batch_size=0, float and out-of-range labels failed in torch ("split_size can only be
    0", "expected target dtype to be Long", "Target 5 is out of bounds")."""
    x, y = torch.randn(20, 4), torch.arange(20) % 3
    model = demo.mlp(hidden=8, inputs=4, classes=3)
    with pytest.raises(ValueError, match="^x holds 20 samples but y holds 10 labels"):
        demo.train(model, x, y[:10], epochs=1)
    for lr in (float("inf"), float("nan"), 0, -1.0):
        with pytest.raises(ValueError, match="^lr must be a positive finite number"):
            demo.train(model, x, y, lr=lr)
    with pytest.raises(ValueError, match="^epochs must be a non-negative integer, got -1"):
        demo.train(model, x, y, epochs=-1)
    with pytest.raises(ValueError, match="^batch_size must be a positive integer, got 0"):
        demo.train(model, x, y, batch_size=0)
    with pytest.raises(ValueError, match=r"^y holds labels outside 0..2: 5 at sample 0"):
        demo.train(model, x, torch.full((20,), 5), epochs=1)
    with pytest.raises(ValueError, match="^y must hold integer class labels, got 0.5"):
        demo.train(model, x, y + 0.5, epochs=1)
    assert not demo.train(model, x, y.float(), epochs=1).training  # integral floats are labels


@pytest.mark.parametrize("training", [False, True])
def test_a_failed_train_leaves_the_model_in_its_mode(training):
    """The model was switched to training mode before a failure (here, inputs of the wrong
    width) and left there."""
    model = demo.mlp(hidden=8, inputs=4, classes=3).train(training)
    with pytest.raises(RuntimeError):
        demo.train(model, torch.randn(6, 5), torch.arange(6) % 3, epochs=1)
    with pytest.raises(ValueError):
        demo.train(model, torch.randn(6, 4), torch.full((6,), 3), epochs=1)
    assert all(m.training == training for m in model.modules())


def test_digits_and_mlp_refuse_bad_sizes():
    with pytest.raises(ValueError, match="^n_train must be a positive integer, got 1.5"):
        demo.digits(1.5)
    for hidden in (-1, 0):
        with pytest.raises(ValueError, match=f"^hidden must be a positive integer, got {hidden}"):
            demo.mlp(hidden)
    with pytest.raises(ValueError, match="^depth must be a positive integer, got 0"):
        demo.mlp(depth=0)
