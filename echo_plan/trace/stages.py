"""The first and last pipeline stage's own modules: the embedding, and the output + loss.

After Megatron-LM's ``LanguageModelEmbedding`` and ``GPTModel`` output path: the word embedding
is vocab-parallel; without a learned position embedding and with sequence parallelism its partial
sums are reduce-scattered straight into sequence shards, otherwise they are all-reduced, the
position embedding added, and (with sequence parallelism) the result split into shards. The output
stage applies the final norm, gathers the sequence shards (or marks the f-conjugate), projects to
this rank's vocabulary shard and computes the vocab-parallel cross-entropy in fp32. With the
stack's hidden dropout the embedding output goes through dropout (Megatron's embedding_dropout).
"""

from __future__ import annotations

import torch
from torch import nn

from echo_plan.specs import ModelSpec, PositionEmbedding, SoftwareSpec
from echo_plan.trace import kernels, linears, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.layers import VocabParallelEmbedding, make_norm, padded_vocab, vocab_parallel_cross_entropy
from echo_plan.trace.loss_kernels import te_cross_entropy


class EmbeddingStage(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec) -> None:
        super().__init__()
        self.dropout_p = stack.hidden_dropout
        tp = group.size if group else 1
        self.group, self.sp = group, sequence_parallel
        self.word = VocabParallelEmbedding(padded_vocab(model.vocab_size, tp), model.hidden_size, group, dtype)
        learned = model.position_embedding is PositionEmbedding.LEARNED
        self.position = nn.Embedding(model.seq_length, model.hidden_size, dtype=dtype, _weight=torch.empty(
            model.seq_length, model.hidden_size, dtype=dtype)) if learned else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s] -> [s(/tp), b, h]
        partial = self.word(ids).transpose(0, 1).contiguous()
        if self.position is None and self.sp:
            x = parallel.reduce_scatter_to_sp(partial, self.group)
        else:
            x = parallel.reduce_from_tp(partial, self.group)
            if self.position is not None:
                positions = torch.arange(ids.shape[1], device=ids.device)
                x = x + self.position(positions).unsqueeze(1)
            x = parallel.scatter_to_sp(x, self.group) if self.sp else x
        return kernels.dropout(x, self.dropout_p)


class OutputStage(nn.Module):
    """Final norm, output projection and loss. With tied embeddings the projection reuses the word
    embedding (``shared_weight``): Megatron-LM keeps a copy on the last stage when pp > 1."""

    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec) -> None:
        super().__init__()
        tp = group.size if group else 1
        self.group, self.sp = group, sequence_parallel
        self.accumulate_unfused = not stack.gradient_accumulation_fusion
        self.norm = make_norm(model.norm, model.hidden_size, dtype, stack.fused_norm)  # outside the compiled blocks
        self.output_weight = nn.Parameter(
            torch.empty(padded_vocab(model.vocab_size, tp) // tp, model.hidden_size, dtype=dtype))
        self.shared_weight = model.tied_embeddings
        # a compiled loss runs as TE's does here: two passes over the bf16 logits forward, one backward, the bf16
        # logits kept (it writes a new gradient, not over them: memory.yaml's transient)
        self.te_loss = stack.cross_entropy.keeps_logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # x: [s(/tp), b, h], labels [b, s]
        x = self.norm(x)
        logits = linears.column_parallel_linear(x, self.output_weight, None, self.group, self.sp,
                                                 self.accumulate_unfused)
        target = labels.transpose(0, 1).contiguous()
        if self.te_loss:  # Transformer Engine's kernels on the bf16 logits (loss_kernels.py)
            return te_cross_entropy(logits, target, self.group).mean()
        return vocab_parallel_cross_entropy(logits.float(), target, self.group).mean()

    def owned_parameters(self) -> int:
        """Parameters this stage adds to the model (the tied projection belongs to the embedding)."""
        return sum(p.numel() for n, p in self.named_parameters() if not (self.shared_weight and n == "output_weight"))
