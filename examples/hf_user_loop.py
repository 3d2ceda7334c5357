"""A Hugging Face model trained by its user's own loop over ``deeppool.parallelize``.

A tiny GPT-2 (``transformers``' ``GPT2LMHeadModel`` from a config: no download; tied embeddings,
dropout 0.1) learns to continue counting sequences. This file is a model file too, so it plans as one:

    deeppool plan examples/hf_user_loop.py --gpus 2 --batch 8 --device-model a100 --out hf-plan.json
    deeppool run --script examples/hf_user_loop.py hf-plan.json      # or: torchrun --nproc-per-node 2 ...

The loop is the one a Hugging Face user writes (AdamW, a linear warm-up schedule from
``transformers``, the model's own loss from ``labels``); ``bp.step`` takes the batch dict as the
model's keyword arguments, and ``loss_fn=None`` takes the model's ``output.loss``.
"""

import os

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

VOCAB, TOKENS, STEPS = 64, 16, int(os.environ.get("HF_LOOP_STEPS", "30"))


def model() -> nn.Module:
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)


def counting(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences ``s, s+1, s+2, ...`` (mod the vocabulary) from random starts: a pattern to learn."""
    starts = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    return (starts + torch.arange(TOKENS)) % VOCAB


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    ids = counting(batch_size, torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def train() -> None:
    import deeppool

    plan = deeppool.Plan.load(os.environ.get("DEEPPOOL_PLAN", "hf-plan.json"))
    torch.manual_seed(0)
    bp = deeppool.parallelize(model(), plan)
    opt = torch.optim.AdamW(bp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=STEPS)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    for step in range(STEPS):
        ids = counting(plan.global_batch, data)
        loss = bp.step({"input_ids": ids, "labels": ids})
        bp.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if bp.is_logging_rank and (step % 10 == 0 or step == STEPS - 1):
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    if bp.is_logging_rank:
        plain = model()
        plain.load_state_dict(bp.state_dict())  # the checkpoint is the Hugging Face model's own
        plain.save_pretrained(os.environ.get("HF_LOOP_OUT", "hf-trained"))
        print("saved with save_pretrained", flush=True)


if __name__ == "__main__":
    train()
