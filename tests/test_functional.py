import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.models import TinyLM, lm_loss, make_batch


def test_params_are_trainable_unique_names():
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    assert "embed.weight" in params and "head.weight" not in params  # tied: one entry
    assert "frozen_scale" not in params  # frozen: carried by the module
    assert params["embed.weight"].data_ptr() == model.embed.weight.data_ptr()  # no copy
    assert apply_fn.aliases["head.weight"] == "embed.weight"


def test_apply_matches_eager():
    torch.manual_seed(0)
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    batch = make_batch()
    torch.testing.assert_close(apply_fn(params, batch["x"]), model(batch["x"]), rtol=0, atol=0)


def test_value_and_grad_matches_backward_elementwise():
    torch.manual_seed(0)
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    batch = make_batch()
    loss, grads = zf.value_and_grad(lm_loss(apply_fn))(params, batch)
    ref = F.cross_entropy(model(batch["x"]).flatten(0, 1), batch["y"].flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=0)
    named = dict(model.named_parameters())
    assert set(grads) == set(params)
    for name, g in grads.items():
        # tied weight: the gradient sums both uses, exactly as eager
        torch.testing.assert_close(g, named[name].grad, rtol=1e-6, atol=1e-7)
    assert model.frozen_scale.grad is None


def test_tied_weights_train_as_one_parameter():
    torch.manual_seed(0)
    model, eager = TinyLM(), TinyLM()
    eager.load_state_dict(model.state_dict())
    apply_fn, params = zf.functional(model)
    params = {k: v.clone() for k, v in params.items()}
    opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    vg = zf.value_and_grad(lm_loss(apply_fn))
    for i in range(3):
        batch = make_batch(seed=i)
        _, grads = vg(params, batch)
        params = {k: params[k] - 0.5 * grads[k] for k in params}
        opt.zero_grad()
        F.cross_entropy(eager(batch["x"]).flatten(0, 1), batch["y"].flatten()).backward()
        opt.step()
    for name, p in eager.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[apply_fn.aliases[name]], p.detach(), rtol=1e-6, atol=1e-7)


def test_has_aux_and_grad():
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    batch = make_batch()

    def loss_fn(p, b):
        logits = apply_fn(p, b["x"])
        return F.cross_entropy(logits.flatten(0, 1), b["y"].flatten()), {"logits_mean": logits.mean()}

    (loss, aux), grads = zf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert not loss.requires_grad and not aux["logits_mean"].requires_grad
    grads2, aux2 = zf.grad(loss_fn, has_aux=True)(params, batch)
    for k in grads:
        torch.testing.assert_close(grads[k], grads2[k], rtol=0, atol=0)


def test_unused_parameter_gets_zero_grad():
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(2, 2)})
    apply_fn, params = zf.functional(model)
    _, grads = zf.value_and_grad(lambda p, x: (x @ p["used.weight"].T).sum())(params, torch.ones(4, 3))
    assert torch.count_nonzero(grads["unused.weight"]) == 0


def test_non_scalar_loss_is_a_clear_error():
    apply_fn, params = zf.functional(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="scalar"):
        zf.value_and_grad(lambda p, x: apply_fn(p, x))(params, torch.ones(4, 3))
    with pytest.raises(TypeError, match="scalar tensor"):
        zf.value_and_grad(lambda p, x: 1.0)(params, torch.ones(4, 3))


def test_params_mismatch_is_a_clear_error():
    apply_fn, params = zf.functional(TinyLM())
    bad = dict(params)
    bad.pop("final_norm.bias")
    bad["blocks.0.up.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as err:
        apply_fn.check_params(bad)
    assert "final_norm.bias" in str(err.value) and "blocks.0.up.weight" in str(err.value)
    with pytest.raises(ValueError, match="lack"):
        apply_fn(bad, make_batch()["x"])


def test_buffers_update_like_eager_and_are_explained_under_torch_func():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    apply_fn, params = zf.functional(model)
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    before = model[1].running_mean.clone()
    zf.value_and_grad(lambda p, x: apply_fn(p, x).square().mean())(params, torch.randn(8, 3))
    assert not torch.equal(before, model[1].running_mean)  # as loss.backward() would
    with pytest.raises(RuntimeError, match="eval mode"):  # torch.func forbids mutating captured buffers
        torch.func.grad(lambda p, x: apply_fn(p, x).square().mean())(params, torch.randn(8, 3))


def test_value_and_grad_under_vmap_per_example_grads():
    model = nn.Linear(3, 2)
    apply_fn, params = zf.functional(model)
    x = torch.randn(5, 3)
    per_example = torch.func.vmap(lambda xi: zf.grad(lambda p, v: apply_fn(p, v).square().sum())(params, xi))(x)
    for i in range(5):
        expected = zf.grad(lambda p, v: apply_fn(p, v).square().sum())(params, x[i])
        torch.testing.assert_close(per_example["weight"][i], expected["weight"])


def test_one_definition_of_the_blocks():
    from tests.models import Block
    from zfunc.functional import find_blocks, select_blocks
    model = TinyLM(depth=4)
    assert select_blocks(model) == [f"blocks.{i}" for i in range(4)]
    _, params = zf.functional(model)
    assert params.blocks == [f"blocks.{i}" for i in range(4)]  # recorded for shard, which has no model
    assert zf.TrainState.create(params, zf.optim.sgd(0.1)).blocks == tuple(params.blocks)
    assert select_blocks(model, Block) == [f"blocks.{i}" for i in range(4)]
    # Blocks need not be identical; nested containers are not blocks; containers are never blocks.
    sizes = {"emb.w": 1, **{f"layers.{i}.attn.w": 1 for i in range(3)}, "layers.1.attn.b": 1,
             **{f"layers.{i}.moe.experts.{e}.w": 1 for i in range(3) for e in range(8)}, "head.w": 1}
    assert find_blocks(sizes) == ["layers.0", "layers.1", "layers.2"]
    assert find_blocks({f"stack.{i}.{j}.w": 1 for i in range(2) for j in range(2)}) == \
        ["stack.0.0", "stack.0.1", "stack.1.0", "stack.1.1"]
    assert find_blocks({"enc.0.w": 1, "enc.1.w": 1, "dec.0.w": 1, "dec.1.w": 1}) == ["enc.0", "enc.1", "dec.0", "dec.1"]
    assert find_blocks({"a.w": 1, "b.w": 1}) == []
    assert select_blocks(model, lambda n: n == "blocks.1") == ["blocks.1"]
    with pytest.raises(AttributeError):
        select_blocks(model, ["blocks.9"])


def test_block_hooks_run_once_per_forward_under_block_transforms():
    from tests.models import TinyLM, lm_loss, make_batch
    from zfunc.transforms import checkpoint

    torch.manual_seed(0)
    model = TinyLM()
    calls = []
    model.blocks[1].register_forward_hook(lambda m, i, o: calls.append(1))
    apply_fn, params = zf.functional(model)

    def step(state, batch):
        loss, grads = zf.value_and_grad(lm_loss(apply_fn))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    stepped = checkpoint(step)
    state = stepped.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    stepped(state, make_batch(8))
    assert len(calls) == 1  # not again inside the wrapper, nor in the backward recompute
