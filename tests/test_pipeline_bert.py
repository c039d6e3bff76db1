"""BERT under pipeline: a tiny masked LM (decoder tied to the word embeddings, a frozen token-type embedding,
clipping by the global norm) pipelined over pp2, over tp2 x pp2 and over pp2 x dp2 (shard stage 1, with
checkpoint and mixed_precision inside) equals the plain step element-wise."""

from __future__ import annotations

import pytest
import torch

import zfunc as zf
from tests.tp_cases import SEQ, VOCAB, make_model
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import checkpoint, mixed_precision, pipeline, shard, tensor_parallel, tp_plan

STEPS, BATCH, MICRO, MASK_ID, MASKED = 2, 4, 2, 3, 2


def make_step():
    """``(apply_fn, train_step, state)``: the masked-LM loss Hugging Face computes from ``labels``."""
    model = make_model("bert")
    apply_fn, params = zf.functional(model)

    def loss_fn(params, batch):  # (the mask and token types are computed with outside the blocks, on every stage)
        return apply_fn(params, input_ids=batch["x"], attention_mask=batch["mask"], token_type_ids=batch["types"],
                        labels=batch["y"]).loss

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2, weight_decay=0.1))
    state = zf.TrainState.create({k: v.clone() for k, v in params.items()}, tx, ties=params.ties, blocks=params.blocks)
    return apply_fn, train_step, state


def batch(i: int) -> dict:
    """Tokens with ``MASKED`` positions of each row replaced by the mask token; labels -100 (ignored) elsewhere
    (every row has as many labelled tokens, so the mean over micro-batches' mean losses is the batch's); an
    attention mask padding every other row; two segments of token types."""
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
    where = torch.stack([torch.randperm(SEQ, generator=g)[:MASKED] for _ in range(BATCH)])
    masked = torch.zeros(BATCH, SEQ, dtype=torch.bool).scatter_(1, where, True)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1::2, -2:] = 0  # every other row padded at its end
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ)  # a second segment: the frozen embedding's row 1
    return {"x": torch.where(masked, MASK_ID, tokens), "y": torch.where(masked, tokens, -100), "mask": mask,
            "types": types}


def plain() -> dict:
    _, step, state = make_step()
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, batch(i))
        losses.append(float(metrics["loss"]))
    return {"params": {k: v.detach().clone() for k, v in state.params.items()}, "losses": losses}


def pipelined(tp: int, dp: int = 1) -> dict:
    """pp2 (with tp2 inside, or shard stage 1 over dp2 outside and recompute and fp32 mixed precision inside)."""
    mesh = make_mesh(dp=dp, pp=2, tp=tp)
    apply_fn, step, state = make_step()
    if tp > 1:
        step = tensor_parallel(step, tp_plan(apply_fn), mesh)
    if dp > 1:
        step = checkpoint(mixed_precision(step, "fp32"))
    stacked = pipeline(step, micro_batches=MICRO, mesh=mesh)
    if dp > 1:
        stacked = shard(stacked, stage=1, mesh=mesh)
    state = stacked.init(state)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for i in range(STEPS):
        state, metrics = stacked(state, {k: v.chunk(dp)[dp_rank] for k, v in batch(i).items()})
        losses.append(float(metrics["loss"]))
    return {"params": stacked.gather(state), "losses": losses, "keys": sorted(state.params),
            "tied": (metrics["pp_tied_sent"], metrics["pp_tied_received"])}


def check(outs: list, pp_rank_of: list, dp: bool = False) -> None:
    ref = plain()
    assert "bert.embeddings.token_type_embeddings.weight" not in ref["params"]  # frozen: a constant of the model
    for rank, out in enumerate(outs):
        assert out["params"].keys() == ref["params"].keys()
        for key, want in ref["params"].items():  # (tolerance: Adam on gradients summed in another order)
            torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=2e-5,
                                       msg=lambda m, rank=rank, key=key: f"rank {rank} {key}: {m}")
        if not dp:  # (under dp each rank's loss is its own half of the batch's)
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        # The word embeddings are the first stage's; the tied decoder on the last stage borrows them each step
        # (the weight sent one way, its gradient back: one send and one receive on each pipeline rank).
        first = pp_rank_of[rank] == 0
        assert ("bert.embeddings.word_embeddings.weight" in out["keys"]) == first
        assert ("cls.predictions.transform.dense.weight" in out["keys"]) == (not first)
        assert out["tied"] == (1, 1)


def test_bert_masked_lm_pp2_equals_the_plain_step():
    check(run_distributed(pipelined, 2, 1), [0, 1])


@pytest.mark.slow
def test_bert_masked_lm_tp2_x_pp2_equals_the_plain_step():
    check(run_distributed(pipelined, 4, 2), [0, 0, 1, 1])


@pytest.mark.slow
def test_bert_masked_lm_pp2_x_dp2_under_shard_with_recompute_equals_the_plain_step():
    check(run_distributed(pipelined, 4, 1, 2), [0, 1, 0, 1], dp=True)
