"""The hand-written Eagle3 forward (pdstack.tiny_model.eagle3) against vLLM's own.

The draft's lm_head is fitted through a plain-PyTorch copy of vLLM's Eagle3
forward. Were the copy to drift from vLLM (a norm, the rotary embedding, the
attention, the residuals), the head would be fitted to a model vLLM does not
run and the probes would detect nothing. So vLLM's Eagle3LlamaForCausalLM is
built here in-process on CPU from the generated checkpoint (vLLM's config
resolution and weight loader), fed the target hidden states, tokens and
positions the copy is fed, with vLLM's CPU attention over a paged KV cache,
and both must agree within float32 tolerance and propose the same tokens.

This pins the draft model. What vLLM's proposer feeds it (the token shift, the
second step's hidden state) and the aux hidden states of vLLM's target are
pinned end to end only: the real servers accept the fitted draft on the probes
(e2e/test_spec_decode.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch

from pdstack import tiny_model as tm
from pdstack.tiny_model.target import TargetTrace

# Probe groups (prompt lengths) compared: under one KV block, several blocks,
# and a long prompt. The 1024-token group only adds minutes of target decoding.
GROUP_LENGTHS = (16, 48, 256)
BLOCK_SIZE = 32  # CPU_ATTN's native block size; the math does not depend on it
# Measured: max |vLLM - copy| / max |copy| <= 1.5e-4 (first pass 5e-5; the
# second step compounds the first pass's differences). float32 sums run in a
# different order in oneDNN's linears and the attention kernel. A drift moves
# outputs by O(1) (see test_the_pin_detects_a_drift).
REL_TOL = 1e-3
DRIFT_MIN_REL = 0.1


@dataclasses.dataclass(frozen=True)
class Outputs:
    """One draft pass over a probe group, laid out as eagle3.DraftPass."""

    first_normed: torch.Tensor  # [B, T - start, H]
    first_prenorm: torch.Tensor  # [B, T - start, H]
    second_normed: torch.Tensor  # [B, T - 1 - start, H]
    first_logits: torch.Tensor  # [B, T - start, V]
    second_logits: torch.Tensor  # [B, T - 1 - start, V]


@dataclasses.dataclass(frozen=True)
class Group:
    trace: TargetTrace
    start: int
    vllm: Outputs


class VllmDraft:
    """vLLM's Eagle3 draft with one paged KV cache of a batch of sequences."""

    def __init__(self, config: Any, model: Any, batch: int, seq_len: int) -> None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self.config, self.model = config, model
        context = config.compilation_config.static_forward_context
        (self.layer_name,) = context  # the draft's single attention layer
        self.layer = context[self.layer_name]
        kv_heads, head_dim = tm.params.DRAFT_NUM_KV_HEADS, tm.params.DRAFT_HEAD_DIM
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=kv_heads,
            head_size=head_dim,
            dtype=torch.float32,
        )
        builder_cls = self.layer.get_attn_backend().get_builder_cls()
        self.builder = builder_cls(spec, [self.layer_name], config, torch.device("cpu"))
        blocks = -(-seq_len // BLOCK_SIZE)
        # CPU_ATTN's layout: [blocks, kv_heads, block_size, 2 * head_dim].
        self.layer.kv_cache = torch.zeros(
            batch * blocks, kv_heads, BLOCK_SIZE, 2 * head_dim
        )
        self.block_table = torch.arange(batch * blocks, dtype=torch.int32)
        self.block_table = self.block_table.view(batch, blocks)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the batch: per sequence the queries at `positions`
        [B, Tq] (contiguous, the last one ends the sequence so far); embeds and
        hidden [B, Tq, H]. Returns (normed, prenorm) [B, Tq, H]."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        batch, q_len = positions.shape
        blocks = self.block_table.gather(1, (positions // BLOCK_SIZE).int())
        slots = (blocks.long() * BLOCK_SIZE + positions % BLOCK_SIZE).flatten()
        starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
        seq_len = int(positions[0, -1]) + 1
        common = CommonAttentionMetadata(
            query_start_loc=starts,
            query_start_loc_cpu=starts,
            seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
            num_reqs=batch,
            num_actual_tokens=batch * q_len,
            max_query_len=q_len,
            max_seq_len=seq_len,
            block_table_tensor=self.block_table,
            slot_mapping=slots,
            causal=True,
        )
        metadata = self.builder.build(common_prefix_len=0, common_attn_metadata=common)
        with set_forward_context(
            {self.layer_name: metadata},
            self.config,
            slot_mapping={self.layer_name: slots},
        ):
            normed, prenorm = self.model(
                input_ids=None,
                positions=positions.flatten(),
                hidden_states=hidden.flatten(0, 1),
                inputs_embeds=embeds.flatten(0, 1),
            )
        return normed.view(batch, q_len, -1), prenorm.view(batch, q_len, -1)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(normed.flatten(0, 1))
        return logits.view(*normed.shape[:-1], -1)


def vllm_outputs(
    draft: VllmDraft, embed: torch.Tensor, trace: TargetTrace, start: int
) -> Outputs:
    """The passes eagle3.draft_first_pass and draft_second_step compute, run
    through vLLM's draft (see their docstrings for the inputs)."""
    batch, seq_len = trace.tokens.shape
    next_tokens = torch.cat([trace.tokens[:, 1:], trace.greedy[:, -1:]], dim=1)
    hidden = draft.model.combine_hidden_states(trace.aux.flatten(0, 1))
    positions = torch.arange(seq_len).expand(batch, -1)
    normed, prenorm = draft.forward(
        embed[next_tokens], hidden.view(batch, seq_len, -1), positions
    )
    normed, prenorm = normed[:, start:], prenorm[:, start:]
    # The second step at j is a decode at position j + 1, which writes its KV
    # over the first pass's at j + 1. Walking j downwards, each step overwrites
    # only a slot that no later (smaller) j reads.
    steps = {}
    for j in range(seq_len - 2, start - 1, -1):
        steps[j], _ = draft.forward(
            embed[trace.greedy[:, j + 1 : j + 2]],
            prenorm[:, j - start : j - start + 1],
            torch.full((batch, 1), j + 1),
        )
    second = torch.cat([steps[j] for j in range(start, seq_len - 1)], dim=1)
    return Outputs(normed, prenorm, second, draft.logits(normed), draft.logits(second))


@contextlib.contextmanager
def vllm_draft_model(models: tm.TinyModels) -> Iterator[tuple[Any, Any]]:
    """vLLM's config for target + Eagle3 draft, as the server resolves it, and
    the draft model from vLLM's loader, in a one-process gloo world."""
    from vllm import distributed
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    config = EngineArgs(
        model=str(models.target),
        dtype=tm.DTYPE,
        speculative_config={
            "method": "eagle3",
            "model": str(models.draft),
            "num_speculative_tokens": 2,
        },
        enforce_eager=True,
        max_model_len=2048,
    ).create_engine_config()
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(config):
        distributed.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp}/dist",
            backend="gloo",
        )
        try:
            distributed.initialize_model_parallel(1, 1)
            # As vLLM's CPU worker does: there is no accelerator cache to empty.
            with mock.patch.object(torch.accelerator, "empty_cache", lambda: None):
                model = get_model(
                    vllm_config=config,
                    model_config=config.speculative_config.draft_model_config,
                )
            yield config, model
        finally:
            distributed.destroy_model_parallel()
            distributed.destroy_distributed_environment()


@pytest.fixture(scope="module")
def groups(
    models: tm.TinyModels, target: torch.nn.Module, embed: torch.Tensor
) -> dict[int, Group]:
    """What the fit saw, the target's greedy trace of each compared group, and
    vLLM's draft passes over it."""
    probes = tm.load_probes(models)
    traces = {}
    for length in GROUP_LENGTHS:
        prompts = torch.tensor([p.prompt for p in probes if len(p.prompt) == length])
        with tm.cache.deterministic_torch(), torch.no_grad():
            trace = tm.target.greedy_trace(target, prompts, tm.params.PROBE_MAX_TOKENS)
        traces[length] = trace
    out = {}
    with vllm_draft_model(models) as (config, model), torch.no_grad():
        for length, trace in traces.items():
            draft = VllmDraft(config, model, *trace.tokens.shape)
            start = length - 1
            out[length] = Group(trace, start, vllm_outputs(draft, embed, trace, start))
    return out


def against_the_copy(
    group: Group, weights: dict[str, torch.Tensor], embed: torch.Tensor
) -> tuple[Outputs, dict[str, float]]:
    """The copy's passes over the group, and max |vLLM - copy| / max |copy|
    per field."""
    with torch.no_grad():
        first = tm.eagle3.draft_first_pass(weights, embed, group.trace, group.start)
        second = tm.eagle3.draft_second_step(weights, embed, group.trace, first)
    head = weights["lm_head.weight"]
    copy = Outputs(
        first.normed, first.prenorm, second, first.normed @ head.T, second @ head.T
    )
    errors = {}
    for field in dataclasses.fields(Outputs):
        got, want = getattr(group.vllm, field.name), getattr(copy, field.name)
        errors[field.name] = ((got - want).abs().max() / want.abs().max()).item()
    return copy, errors


@pytest.mark.parametrize("length", GROUP_LENGTHS)
def test_vllm_draft_matches_the_copy_on_the_probes(
    groups: dict[int, Group],
    weights: dict[str, torch.Tensor],
    embed: torch.Tensor,
    length: int,
) -> None:
    group = groups[length]
    copy, errors = against_the_copy(group, weights, embed)
    assert max(errors.values()) <= REL_TOL, errors
    # The proposals themselves, greedy drafts of both positions. Measured: the
    # copy's smallest top-2 logit margin here is 0.055, differences <= 4.5e-3.
    for field in ("first_logits", "second_logits"):
        vllm_tokens = getattr(group.vllm, field).argmax(-1)
        assert torch.equal(vllm_tokens, getattr(copy, field).argmax(-1)), field


ATTEND = tm.eagle3._attend


def _attend_with_other_gqa_grouping(
    q: torch.Tensor, k: torch.Tensor, *args: Any, **kw: Any
) -> torch.Tensor:
    """_attend with query head h reading kv head h % kv_heads (`repeat`)
    instead of vLLM's h // (heads / kv_heads) (`repeat_interleave`)."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    perm = torch.arange(heads).view(heads // kv_heads, kv_heads).T.flatten()
    out = ATTEND(q[..., perm, :], k, *args, **kw).unflatten(-1, (heads, -1))
    fixed = torch.empty_like(out)
    fixed[..., perm, :] = out
    return fixed.flatten(-2)


DRIFTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "no rotary embedding": lambda mp: mp.setattr(
        tm.eagle3, "_rope_neox", lambda x, positions: x
    ),
    "rope_theta": lambda mp: mp.setattr(tm.params, "DRAFT_ROPE_THETA", 5e5),
    "GQA head grouping": lambda mp: mp.setattr(
        tm.eagle3, "_attend", _attend_with_other_gqa_grouping
    ),
}


@pytest.mark.parametrize("drift", DRIFTS)
def test_the_pin_detects_a_drift(
    groups: dict[int, Group],
    weights: dict[str, torch.Tensor],
    embed: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    drift: str,
) -> None:
    """Negative control: the copy, changed as a drift from vLLM would change
    it, no longer matches."""
    DRIFTS[drift](monkeypatch)
    _, errors = against_the_copy(groups[GROUP_LENGTHS[1]], weights, embed)
    assert max(errors.values()) > DRIFT_MIN_REL, errors
