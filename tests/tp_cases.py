"""Tiny Hugging Face GPT-2, Llama and BERT models for the tensor-parallel tests (built locally, no hub):
frozen and tied parameters, a loss on the logits, batches split over dp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

import zfunc as zf

VOCAB, SEQ, BATCH = 64, 8, 4


def make_model(kind: str, vocab: int = VOCAB, heads: int = 4, kv_heads: int = 2):
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    if kind == "gpt2":  # tied wte / lm_head; the position embedding frozen
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=2, n_head=heads,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        model.transformer.wpe.weight.requires_grad_(False)
    elif kind == "llama":  # grouped-query attention: 4 heads, 2 key/value heads; untied head; a frozen norm
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                                       max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    elif kind == "bert":  # masked LM: decoder tied to the word embeddings; the pooler-free MLM head
        cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=heads,
                                      intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0,
                                      attention_probs_dropout_prob=0, pad_token_id=0)
        model = transformers.BertForMaskedLM(cfg)
        model.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)
    else:
        raise ValueError(kind)
    return model


def make_step(kind: str, opt: str = "clip", **model_kwargs):
    """``(apply_fn, train_step, state)`` for a fresh tiny model (the same on every rank)."""
    model = make_model(kind, **model_kwargs)
    apply_fn, params = zf.functional(model)

    extra = {} if kind == "bert" else {"use_cache": False}  # (a cache would be replayed by checkpoint's recompute)

    def loss_fn(params, batch):
        logits = apply_fn(params, input_ids=batch["x"], **extra).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2, weight_decay=0.1)) \
        if opt == "clip" else zf.optim.adamw(1e-2, weight_decay=0.1)
    ties, blocks = params.ties, params.blocks
    params = {k: v.clone() for k, v in params.items()}  # (steps update in place: keep the module's own intact)
    return apply_fn, train_step, zf.TrainState.create(params, tx, ties=ties, blocks=blocks)


def batch(i: int, dp_rank: int = 0, dp: int = 1) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    full = {"x": x, "y": torch.roll(x, -1, 1)}
    return {k: v.chunk(dp)[dp_rank] for k, v in full.items()}


def reference(kind: str, steps: int, opt: str = "clip") -> dict:
    _, step, state = make_step(kind, opt)
    for i in range(steps):
        state, _ = step(state, batch(i))
    return {k: v.detach().clone() for k, v in state.params.items()}
