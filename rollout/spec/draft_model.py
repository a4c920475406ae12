"""DFlash and DSpark drafters: block-diffusion draft models that read the target's hidden states.

A drafter turns the target hidden states of a few target layers (`target_layer_ids`, each the
output of that decoder layer) into a context sequence (`fc` + `hidden_norm`), caches that
context's keys/values per draft layer, and drafts a whole block in one forward: the block
`[anchor, MASK, ..., MASK]` at its true positions attends, without a causal mask, to the valid
context keys and to the block's own keys; the final norm and an LM head give logits for the
block_size - 1 positions after the anchor. DFlash borrows the target's embeddings and LM head;
DSpark has its own, plus a low-rank Markov head (logits of position i get
`markov_w2(markov_w1[token at i - 1])`) and a confidence head
(`sigmoid(proj([hidden_i || markov_w1[token at i - 1]]))`, the predicted chance that the
drafted token is accepted). Parameter names follow the published checkpoint layout
(`fc`, `hidden_norm`, `layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`,
`layers.N.mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, `norm`,
`markov_head.markov_w1/markov_w2`, `confidence_head.proj`, `embed_tokens`, `lm_head`).
Loading, saving and the fit checks against a target live in `rollout.spec.draft_loader`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollout.engine.model import DecoderLayer, ModelConfig, RMSNorm, RotaryEmbedding
from rollout.errors import InvalidArgument

DRAFT_KINDS = ("dflash", "dspark")


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a drafter. `backbone` describes the draft decoder layers (a Qwen3 config whose
    `num_hidden_layers` is the number of draft layers); `target_hidden_size` and
    `num_target_layers` are the hidden size and depth of the target whose layers feed `fc`
    (input width `len(target_layer_ids) * target_hidden_size`); `markov_rank` is 0 for DFlash
    and > 0 for DSpark."""

    kind: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    num_target_layers: int
    backbone: ModelConfig
    markov_rank: int = 0

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS:
            raise InvalidArgument("kind", f"must be one of {DRAFT_KINDS}, got {self.kind!r}")
        if self.block_size < 2:
            raise InvalidArgument("block_size", f"must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InvalidArgument("mask_token_id", f"{self.mask_token_id} is outside [0, {self.vocab_size})")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise InvalidArgument("target_layer_ids", f"must be non-empty, >= 0: {self.target_layer_ids}")
        if max(self.target_layer_ids) >= self.num_target_layers:
            raise InvalidArgument("target_layer_ids", f"{list(self.target_layer_ids)} out of range for a target "
                                                      f"with num_target_layers={self.num_target_layers}")
        if (self.kind == "dspark") != (self.markov_rank > 0):
            raise InvalidArgument("markov_rank", f"must be > 0 exactly for dspark, got {self.markov_rank}")
        if self.backbone.model_type != "qwen3":
            raise InvalidArgument("backbone", "draft layers are Qwen3 layers (q_norm / k_norm)")

    @property
    def context_size(self) -> int:
        """Width of the concatenated target hidden states that `fc` reads."""
        return len(self.target_layer_ids) * self.target_hidden_size

    hidden_size = property(lambda self: self.backbone.hidden_size)
    num_layers = property(lambda self: self.backbone.num_hidden_layers)
    num_heads = property(lambda self: self.backbone.num_attention_heads)
    num_kv_heads = property(lambda self: self.backbone.num_key_value_heads)
    head_dim = property(lambda self: self.backbone.head_dim)
    intermediate_size = property(lambda self: self.backbone.intermediate_size)
    vocab_size = property(lambda self: self.backbone.vocab_size)
    rms_norm_eps = property(lambda self: self.backbone.rms_norm_eps)
    rope_theta = property(lambda self: self.backbone.rope_theta)


def _block_attention(layer: DecoderLayer, x: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor],
                     k_ctx: Tensor, v_ctx: Tensor, visible: Tensor) -> Tensor:
    """Attention of N query groups over [their context K/V || their own K/V], no causal mask.

    x: [N, Q, H] normed hidden; positions: [N, Q]; cos_sin: per flattened query;
    k_ctx/v_ctx: [N, C, Hkv, D]; visible: [N, Q, C + Q] bool. Returns [N, Q, H].
    """
    attn = layer.self_attn
    N, Q, _ = x.shape
    q, k, v = attn.project_qkv(x.flatten(0, 1), positions.flatten(), cos_sin)  # q: [N*Q, Hq, D]
    k = torch.cat([k_ctx.to(k.dtype), k.unflatten(0, (N, Q))], dim=1)  # k: [N, C+Q, Hkv, D]
    v = torch.cat([v_ctx.to(v.dtype), v.unflatten(0, (N, Q))], dim=1)
    out = F.scaled_dot_product_attention(
        q.unflatten(0, (N, Q)).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=visible[:, None], enable_gqa=attn.num_heads != attn.num_kv_heads,
    )  # out: [N, Hq, Q, D]
    return attn.o_proj(out.transpose(1, 2).flatten(2))


def _layer_forward(layer: DecoderLayer, h: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor],
                   k_ctx: Tensor, v_ctx: Tensor, visible: Tensor) -> Tensor:
    """One pre-norm draft layer; the context K/V bypass `input_layernorm` (they are projected
    from the already normalised context). h: [N, Q, H] -> [N, Q, H]."""
    x = layer.input_layernorm(h)
    h = h + _block_attention(layer, x, positions, cos_sin, k_ctx, v_ctx, visible)
    return h + layer.mlp(layer.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Low-rank bigram correction: previous token -> rank-r embedding -> logit bias."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """[hidden || Markov embedding] -> acceptance logit."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)


@dataclass(frozen=True)
class TargetHeads:
    """The target's embedding table and output head, borrowed (not owned) by a DFlash drafter."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class DraftModel(nn.Module):
    """A DFlash or DSpark drafter (see the module docstring). `shared` holds the target's
    embedding / LM head for DFlash; DSpark owns `embed_tokens` and `lm_head`."""

    def __init__(self, config: DraftConfig, shared: TargetHeads | None = None):
        super().__init__()
        cfg = self.config = config
        self.fc = nn.Linear(cfg.context_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        bb = cfg.backbone
        self.rotary = RotaryEmbedding(bb.head_dim, bb.max_position_embeddings, bb.rope_theta, bb.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(bb, self.rotary) for _ in range(bb.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.kind == "dspark":
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
            self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.markov_rank)
            self.shared = TargetHeads(self.embed_tokens, self.lm_head)
        elif shared is None:
            raise InvalidArgument("shared", "a dflash drafter needs the target's embed_tokens and lm_head")
        else:
            self.shared = shared

    # ---- the context: target hidden states -> per-layer keys/values -------------------------

    def project_context(self, target_aux: Tensor) -> Tensor:
        """target_aux: [..., len(ids) * Ht] (target layers' outputs, concatenated). Returns [..., H]."""
        return self.hidden_norm(self.fc(target_aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """ctx: [..., H] projected context; positions: [...]. Returns per draft layer (k, v),
        each [..., Hkv, D], k normed and roped at `positions`."""
        flat, flat_pos = ctx.flatten(0, -2), positions.flatten()  # flat: [T, H]
        cos_sin = self.rotary.cos_sin(flat_pos, flat.dtype)
        kv = [layer.self_attn.project_kv(flat, flat_pos, cos_sin) for layer in self.layers]
        return [(k.view(*ctx.shape[:-1], *k.shape[1:]), v.view(*ctx.shape[:-1], *v.shape[1:])) for k, v in kv]

    # ---- the block -------------------------------------------------------------------------

    def block_hidden(self, block_ids: Tensor, block_positions: Tensor, ctx_k: list[Tensor],
                     ctx_v: list[Tensor], ctx_lens: Tensor) -> Tensor:
        """Draft hidden states of S blocks over padded per-sequence contexts.

        block_ids, block_positions: [S, B]; ctx_k[l], ctx_v[l]: [S, C, Hkv, D] (context K/V of
        draft layer l, valid in the first ctx_lens[s] rows); ctx_lens: [S].
        Returns the final-normed hidden states [S, B, H].
        """
        S, B = block_ids.shape
        C = ctx_k[0].shape[1]
        ctx_ok = torch.arange(C, device=block_ids.device)[None, :] < ctx_lens[:, None]  # [S, C]
        visible = torch.cat([ctx_ok, ctx_ok.new_ones(S, B)], dim=1)[:, None, :].expand(S, B, C + B)
        return self._run_layers(self.embed(block_ids), block_positions, ctx_k, ctx_v, visible)

    def embed(self, token_ids: Tensor) -> Tensor:
        """token_ids: [...]. Returns [..., H] in the drafter's dtype."""
        return self.shared.embed_tokens(token_ids).to(self.fc.weight.dtype)

    def _run_layers(self, h: Tensor, positions: Tensor, ctx_k: list[Tensor], ctx_v: list[Tensor],
                    visible: Tensor) -> Tensor:
        cos_sin = self.rotary.cos_sin(positions.flatten(), h.dtype)  # each [N*Q, D/2]
        for layer, k, v in zip(self.layers, ctx_k, ctx_v, strict=True):
            h = _layer_forward(layer, h, positions, cos_sin, k, v, visible)
        return self.norm(h)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., H]. Returns float32 logits [..., V] (target head for DFlash, own for DSpark)."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: Tensor) -> Tensor:
        """`logits` in the head's dtype (half the bytes for a CUDA graph's static output)."""
        head = self.shared.lm_head
        return head(hidden.to(head.weight.dtype))

    # ---- DSpark heads ------------------------------------------------------------------------

    def markov_bias(self, prev_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """prev_tokens: [...] (the token before each drafted position). Returns the logit bias
        [..., V] float32 and the Markov embedding [..., r]."""
        emb = self.markov_head.markov_w1(prev_tokens)
        return self.markov_head.markov_w2(emb).float(), emb

    def confidence_logit(self, hidden: Tensor, markov_emb: Tensor) -> Tensor:
        """hidden: [..., H]; markov_emb: [..., r]. Returns the acceptance logit [...] float32."""
        proj = self.confidence_head.proj
        x = torch.cat([hidden.float(), markov_emb.float()], dim=-1)
        return F.linear(x, proj.weight.float(), proj.bias.float()).squeeze(-1)

    def confidence(self, hidden: Tensor, markov_emb: Tensor) -> Tensor:
        """hidden: [S, H]; markov_emb: [S, r]. Returns the probability of acceptance [S]."""
        return torch.sigmoid(self.confidence_logit(hidden, markov_emb))

    # ---- dense training-time forward -------------------------------------------------------

    def train_hidden(self, target_aux: Tensor, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """Blocks at many anchors of whole sequences in one forward (the training layout).

        target_aux: [Bt, L, n*Ht]; input_ids: [Bt, L]; anchors: [Bt, A] with
        0 <= a <= L - block_size. The block at anchor a is [x_a, MASK * (B-1)] at positions
        a..a+B-1; it sees context positions < a and its own block. Returns [Bt, A, B-1, H],
        the hidden states that predict tokens a+1..a+B-1.
        """
        Bt, L = input_ids.shape
        A, B = anchors.shape[1], self.config.block_size
        offs = torch.arange(B, device=anchors.device)
        positions = (anchors[:, :, None] + offs).flatten(1)  # positions: [Bt, A*B]
        block_ids = torch.full_like(positions, self.config.mask_token_id)
        block_ids[:, ::B] = input_ids.gather(1, anchors)
        ctx = self.project_context(target_aux)  # ctx: [Bt, L, H]
        kv = self.context_kv(ctx, torch.arange(L, device=ctx.device).expand(Bt, L))
        ctx_ok = torch.arange(L, device=anchors.device) < anchors.repeat_interleave(B, 1)[:, :, None]
        blk = torch.arange(A * B, device=anchors.device) // B
        same_block = (blk[:, None] == blk[None, :]).expand(Bt, A * B, A * B)
        visible = torch.cat([ctx_ok, same_block], dim=2)  # visible: [Bt, A*B, L + A*B]
        ctx_k, ctx_v = [k for k, _ in kv], [v for _, v in kv]
        h = self._run_layers(self.embed(block_ids), positions, ctx_k, ctx_v, visible)
        return h.view(Bt, A, B, -1)[:, :, 1:]

    def train_logits(self, target_aux: Tensor, input_ids: Tensor, anchors: Tensor,
                     prev_tokens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits [Bt, A, B-1, V] (float32) of the dense training forward (see `train_hidden`).

        For DSpark, `prev_tokens` [Bt, A, B-1] are the tokens before each predicted position
        (teacher forcing: the anchor, then the labels); the Markov bias is added and the
        confidence logits [Bt, A, B-1] are returned too (None for DFlash).
        """
        hidden = self.train_hidden(target_aux, input_ids, anchors)
        logits = self.logits(hidden)
        if self.config.kind != "dspark":
            return logits, None
        if prev_tokens is None:
            raise InvalidArgument("prev_tokens", "dspark training needs the previous token of each position")
        bias, emb = self.markov_bias(prev_tokens)
        return logits + bias, self.confidence_logit(hidden, emb)
