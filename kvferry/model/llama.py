"""Decoder-only transformer covering the Llama, Qwen2 and Qwen3 families.

The families differ only in small switches, read from :class:`~kvferry.config.ArchConfig`:

* Llama: ``attention_bias`` biases q/k/v/o, ``mlp_bias`` biases the MLP.
* Qwen2: q/k/v always biased, o never (as in HF's ``Qwen2Attention``).
* Qwen3: per-head RMSNorm on q and k before rotary; ``attention_bias`` biases q/k/v/o.

Parameters keep Hugging Face names except two fusions, which the loader assembles from the HF
tensors: ``self_attn.qkv_proj`` (q, k, v stacked along the output dim) and
``mlp.gate_up_proj`` (gate then up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.config import ArchConfig
from kvferry.model.attention import Attention
from kvferry.model.forward_context import active_hidden_states_capture
from kvferry.model.layers import (
    GatedMLP,
    Linear,
    LinearKernel,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    weight_of,
)
from kvferry.model.parallel import all_gather_last_dim, tp_size
from kvferry.model.tp_layers import RowParallelLinear, VocabParallelEmbedding
from kvferry.native.fused_ops import FusedOps


class DecoderAttention(nn.Module):
    fused: FusedOps | None = None

    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        # This rank's heads: q/k/v are column-parallel, o_proj row-parallel (tp_layers).
        self.num_heads = cfg.num_attention_heads // tp_size()
        self.num_kv_heads = cfg.num_key_value_heads // tp_size()
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = True if cfg.family == "qwen2" else cfg.attention_bias
        o_bias = False if cfg.family == "qwen2" else cfg.attention_bias
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.family == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # One fused call can norm and rotate q and k (both norms share the config's eps).
        self.fusable_qk_norm = self.qk_norm and self.head_dim <= 1024
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layer_name=f"model.layers.{layer_idx}.self_attn.attn",
            sliding_window=cfg.layer_sliding_window(layer_idx),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``keep``: the rows whose output is wanted (every row's K/V still reach the cache).
        ``x`` may have rows past the step's tokens (``cos``' rows), which only pad the GEMMs."""
        n = cos.shape[0]
        qkv = self.qkv_proj(x)
        if qkv.shape[0] != n:
            qkv = qkv[:n]
        v = qkv[:, self.q_size + self.kv_size :]
        fused = self.fused
        if (
            self.fusable_qk_norm
            and fused is not None
            and qkv.dtype in fused.DTYPES
            and qkv.is_cpu
            and cos.dtype == qkv.dtype
        ):
            qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
            q_norm, k_norm = self.q_norm, self.k_norm
            fused.qk_norm_rotary_(
                qk, self.num_heads, weight_of(q_norm), weight_of(k_norm), q_norm.eps, cos, sin
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        elif self.qk_norm:
            q_raw = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
            k_raw = qkv[:, self.q_size : self.q_size + self.kv_size]
            q = apply_rotary(self.q_norm(q_raw), cos, sin, self.fused)
            k = apply_rotary(
                self.k_norm(k_raw.view(n, self.num_kv_heads, self.head_dim)),
                cos,
                sin,
                self.fused,
            )
        else:
            # q and k heads sit side by side in qkv, so one rotary call covers both.
            qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
            qk = apply_rotary(qk, cos, sin, self.fused)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, keep)
        if keep is not None:
            if out.shape[0] == 0:  # no row wanted (a prefill chunk that samples nothing)
                return out.new_empty(0, self.o_proj.out_features)
        elif x.shape[0] != n:
            out = F.pad(out, (0, 0, 0, x.shape[0] - n))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inter = cfg.intermediate_size // tp_size()
        self.mlp = GatedMLP(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.mlp.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_out, residual)``; their sum is the layer's output. Deferring the add
        lets the next layer's norm fuse it. ``keep`` (row indices): only those rows' outputs,
        in that order."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos, sin, keep)
        if keep is not None:
            residual = residual[keep]
            if h.shape[0] == 0:
                return h, residual
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    # Set by a device backend whose GEMMs slow down at some row counts: a step of at least
    # ``pad_min_rows`` tokens (and at most ``pad_max_rows``, None: any) runs its layers on
    # zero rows appended up to a multiple of ``row_multiple`` (the tokens' own rows are
    # computed as without them).
    row_multiple: int | None = None
    pad_min_rows: int = 0
    pad_max_rows: int | None = None

    def __init__(self, cfg: ArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        # Built for the loader to fill (on the meta device): an explicit weight skips the
        # random init, whose meta-device decomposition is slow enough to dominate start-up.
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        n, multiple = x.shape[0], self.row_multiple
        top = self.pad_max_rows
        if multiple and n % multiple and n >= self.pad_min_rows and (top is None or n <= top):
            x = F.pad(x, (0, 0, 0, multiple - n % multiple))
        residual: torch.Tensor | None = None
        capture = active_hidden_states_capture()
        last = len(self.layers) - 1
        # A capture of the last layer's output wants every row: the rows are picked after it.
        late = capture is not None and capture.wants(len(self.layers))
        for i, layer in enumerate(self.layers):
            if capture is not None:
                capture.record(i, x[:n], None if residual is None else residual[:n])
            keep = output_rows if i == last and not late else None
            x, residual = layer(x, residual, cos, sin, keep)
        if output_rows is None or late:
            x, residual = x[:n], None if residual is None else residual[:n]
        if capture is not None:
            capture.record(len(self.layers), x, residual)
        if late and output_rows is not None:
            x = x[output_rows]
            residual = None if residual is None else residual[output_rows]
        if x.shape[0] == 0:
            return x
        if residual is None:
            return self.norm(x)  # type: ignore[no-any-return]
        return self.norm.add_norm(x, residual)[0]


class CausalLM(nn.Module):
    """A causal language model over the flattened tokens of one engine step.

    ``forward(input_ids, positions)`` takes ``[num_tokens]`` long tensors (``positions`` are
    absolute positions in each request's sequence) and returns the final hidden states
    ``[num_tokens, hidden_size]``, or with ``output_rows`` (a long tensor of flat token indices)
    those rows' alone, in that order: the last layer then runs its attention (from each
    chunk's first such row on), output projection and MLP for them only, since no other
    row's last-layer output is read (every row's K/V still reach the cache). It must run
    inside ``set_forward_context``: the attention layers read the step's metadata and KV
    caches from it. ``compute_logits(hidden)`` returns
    fp32 ``[n, vocab_size]``. ``layer_names`` lists the attention layers, in order, as they
    key ``ForwardContext.kv_caches``.

    ``max_positions`` (default: the config's ``max_position_embeddings``) sizes the rotary
    tables; positions must be below it.
    """

    def __init__(self, cfg: ArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        # Set by a device backend, like Linear.kernel, for the logits product.
        self.logits_kernel: LinearKernel | None = None
        if not cfg.tie_word_embeddings:
            rows = self.model.embed_tokens.num_embeddings  # this rank's vocabulary rows
            self.lm_head = Linear(cfg.hidden_size, rows, bias=False)
        self.layer_names: list[str] = [
            f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)
        ]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, output_rows)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        if self.logits_kernel is not None:
            logits = self.logits_kernel(hidden, weight, None)
        else:
            logits = F.linear(hidden, weight)
        if tp_size() > 1:  # vocab-parallel: every rank gets the full row
            logits = all_gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits.float()
