"""Refitting the draft's lm_head to the target's greedy continuations of the
probe set (see the package docstring for why)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdstack.tiny_model import params
from pdstack.tiny_model.draft import draft_config, init_draft_weights
from pdstack.tiny_model.eagle3 import draft_first_pass, draft_second_step
from pdstack.tiny_model.target import TargetTrace, greedy_trace
from pdstack.tiny_model.tokenizer import special_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast


def probe_group(
    tokenizer: PreTrainedTokenizerFast, length: int, count: int, gen: torch.Generator
) -> torch.Tensor:
    """`count` prompts of `length` tokens: BOS, then alternately an English
    window of the corpus and uniformly random tokens. [count, length]"""
    import torch

    bos = tokenizer.convert_tokens_to_ids(params.BOS_TOKEN)
    corpus = torch.tensor(tokenizer(params.CORPUS, add_special_tokens=False).input_ids)
    # Tiled so windows longer than the corpus still read as running text.
    corpus = corpus.repeat(length // len(corpus) + 2)
    low = len(params.SPECIAL_TOKENS)  # special tokens were added first: ids 0..2
    rows = []
    for i in range(count):
        if i % 2 == 0:
            start = int(torch.randint(0, len(corpus) - length, (1,), generator=gen))
            body = corpus[start : start + length - 1]
        else:
            body = torch.randint(low, len(tokenizer), (length - 1,), generator=gen)
        rows.append(torch.cat([torch.tensor([bos]), body]))
    return torch.stack(rows)


def draft_training_set(
    w: dict[str, torch.Tensor], embed: torch.Tensor, trace: TargetTrace, start: int
) -> tuple[torch.Tensor, ...]:
    """(features, labels, weights) at the decode positions j >= start.

    Position 0 at j predicts the target's greedy token after j+1; position 1
    (given position 0 was accepted) the one after that. Earlier positions are
    left out: vLLM only verifies drafts made after the prompt."""
    import torch

    first = draft_first_pass(w, embed, trace, start)
    second = draft_second_step(w, embed, trace, first)
    f0 = first.normed[:, :-1].flatten(0, 1)
    y0 = trace.greedy[:, start + 1 :].flatten()
    f1 = second[:, :-1].flatten(0, 1)
    y1 = trace.greedy[:, start + 2 :].flatten()
    weights = torch.cat(
        [torch.ones(len(y0)), torch.full((len(y1),), params.FIT_STEP2_WEIGHT)]
    )
    return torch.cat([f0, f1]), torch.cat([y0, y1]), weights


def fit_lm_head(
    features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Ridge regression onto one-hot labels, then full-batch Adam on weighted
    cross-entropy: ridge gets the directions, CE sharpens the argmax."""
    import torch

    onehot = torch.nn.functional.one_hot(labels, vocab).float()
    wf = features * weights[:, None]
    gram = features.T @ wf + params.FIT_RIDGE * torch.eye(features.shape[1])
    head = torch.linalg.solve(gram, wf.T @ onehot).T.contiguous()  # [V, H]
    head.requires_grad_(True)
    opt = torch.optim.Adam([head], lr=params.FIT_CE_LR)
    for _ in range(params.FIT_CE_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            features @ head.T, labels, reduction="none"
        )
        (loss * weights).sum().div(weights.sum()).backward()
        opt.step()
    return head.detach()


def _accuracy(
    head: torch.Tensor, features: torch.Tensor, labels: torch.Tensor
) -> float:
    return ((features @ head.T).argmax(-1) == labels).float().mean().item()


def build_draft(
    model: Any, tokenizer: PreTrainedTokenizerFast, progress: Callable[[str], None]
) -> tuple[dict, dict, list[dict], dict]:
    """Random Eagle3 draft with its lm_head refit to the target's greedy tokens
    on the probe set. Returns (config, weights, probes, fit report)."""
    import torch

    config = draft_config(len(tokenizer), special_ids(tokenizer))
    weights = init_draft_weights(config)
    embed = model.get_input_embeddings().weight.detach()
    # The fixed probe set: one [count, length] group per PROBE_GROUPS entry,
    # greedy-continued by the target and turned into draft training samples.
    gen = torch.Generator().manual_seed(params.SEED + 2)
    samples, probes = [], []
    for length, count in params.PROBE_GROUPS:
        prompts = probe_group(tokenizer, length, count, gen)
        progress(
            f"  probes: {len(prompts)} x {prompts.shape[1]} tokens "
            f"+ {params.PROBE_MAX_TOKENS} greedy"
        )
        start = prompts.shape[1] - 1
        with torch.no_grad():
            trace = greedy_trace(model, prompts, params.PROBE_MAX_TOKENS)
            samples.append(draft_training_set(weights, embed, trace, start))
        probes += [
            {"prompt": p.tolist(), "greedy": c.tolist()}
            for p, c in zip(prompts, trace.greedy[:, start:-1], strict=True)
        ]
    feats, labels, sample_w = map(torch.cat, zip(*samples, strict=True))
    progress(f"  fitting draft lm_head on {len(labels)} samples")
    head = fit_lm_head(feats, labels, sample_w, config["draft_vocab_size"])
    weights["lm_head.weight"] = head
    is_first = sample_w == 1.0
    report = {
        "samples": len(labels),
        "train_acc_pos0": _accuracy(head, feats[is_first], labels[is_first]),
        "train_acc_pos1": _accuracy(head, feats[~is_first], labels[~is_first]),
    }
    return config, weights, probes, report
