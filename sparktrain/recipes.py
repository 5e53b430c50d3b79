"""Example ``train_fn``\\ s for :func:`sparktrain.run`, importable on every executor
(``sparktrain.run("sparktrain.recipes:digits_train_fn", df, ...)``): how your own loop
looks with ``ctx``. ``jobs/run_digits.py`` and ``jobs/run_transformer.py`` run them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sparktrain.models import mlp, sequence_transformer
from sparktrain.task.run_context import RunContext


def digits_train_fn(ctx: RunContext) -> dict[str, Any]:
    """The digits MLP, data parallel, resumable, with the config's schedule, precision,
    accumulation, clipping and early stopping."""
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    model = mlp(64, (128,), 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model, optimizer = ctx.distributed(model, optimizer)
    start, state = 0, ctx.restore()
    if state is not None:  # a restarted stage continues here
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, cfg.epochs):
        model.train()
        loss_sum, rows = 0.0, 0
        for batch in ctx.batches(epoch):
            with ctx.autocast():
                loss = F.cross_entropy(model(batch.x), batch.y.long())
            ctx.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loss_sum, rows = loss_sum + loss.item() * len(batch), rows + len(batch)
        ctx.report({"loss": loss_sum / rows, **ctx.evaluate(model, ["accuracy", "log_loss"])})
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        ctx.checkpoint(state)
        if ctx.should_stop:
            break
    return {"model": model.state_dict(), "history": ctx.history}


def transformer_train_fn(ctx: RunContext) -> dict[str, Any]:
    """A transformer encoder over a variable-length ``tokens`` column (declared
    ``feature_shapes = {tokens = [-1]}``, so batches carry ``tokens_mask``); reports the
    validation accuracy and AUC every epoch."""
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    model = sequence_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    model, optimizer = ctx.distributed(model, optimizer)
    for epoch in range(cfg.epochs):
        model.train()
        for batch in ctx.batches(epoch):
            with ctx.autocast():
                logits = model(batch.inputs["tokens"], batch.masks["tokens"])
                loss = F.cross_entropy(logits, batch.y.long())
            ctx.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        ctx.report({"loss": loss.item(), **ctx.evaluate(model, ["accuracy", "auc"])})
        if ctx.should_stop:
            break
    return {"model": model.state_dict(), "history": ctx.history}
