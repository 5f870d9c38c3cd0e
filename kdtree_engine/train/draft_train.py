"""DFlash drafter training against a frozen target (the recipe of the DFlash paper, batched).

One training sequence of S tokens gives many blocks: anchors a_1..a_n are drawn at random in
[1, S - B]; block j is [token at a_j, MASK x (B-1)] at positions a_j .. a_j+B-1. Every block's
queries attend to the fused target context features (fc + hidden_norm of the concatenated outputs of
the target layers ``target_layer_ids``) at positions strictly before a_j, projected by each layer's
k_proj/v_proj (+ k_norm, + rope), and to all positions of their own block (non-causal); blocks do not
see each other. The output at block position k (1..B-1) predicts the token at a_j + k through the
target's frozen lm_head; the block tokens are embedded by the target's frozen embedding.

Labels are the target's greedy predictions: label(t) = argmax of the target's logits at t-1, with
the target run on the sequence itself. Sequences are a mix of (a) target continuations: a data
prefix followed by the target's own greedy (or sampled) continuation, the situation the drafter
serves at decode time, where these labels are exactly the tokens greedy decoding commits; and (b)
random windows of the training data. Loss: cross-entropy at k = 1..B-1 weighted by exp(-(k-1)/gamma).

The trainable module is a :class:`kdtree_engine.model.dflash.DFlashDrafter` (float32 master
weights); :func:`draft_hidden` is its batched, differentiable forward over many blocks and equals
``DFlashDrafter.forward`` block by block.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..draft_config import DraftConfig
from ..kernels.reference import rotate_half
from ..model.dflash import DFlashDrafter, rope_tables
from .data import random_windows
from .target_train import TrainModel, autocast, generate, lr_at, make_optimizer


def feature_layer_ids(num_target_layers: int, k: int = 4) -> tuple[int, ...]:
    """k target layers spread evenly over [0, L-2] (the last layer excluded)."""
    top = num_target_layers - 2
    if top + 1 <= k:
        return tuple(range(max(1, top + 1)))
    return tuple(sorted({int(math.floor(i * top / (k - 1) + 0.5)) for i in range(k)}))


def demo_draft_config(tcfg: ModelConfig, mask_token_id: int, *, tiny: bool = False) -> DraftConfig:
    if tiny:
        return DraftConfig(hidden_size=tcfg.hidden_size, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=16,
                           mask_token_id=mask_token_id, target_layer_ids=feature_layer_ids(tcfg.num_hidden_layers, 3),
                           num_target_layers=tcfg.num_hidden_layers, vocab_size=tcfg.vocab_size,
                           rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=tcfg.max_position_embeddings)
    return DraftConfig(hidden_size=tcfg.hidden_size, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=16,
                       mask_token_id=mask_token_id, target_layer_ids=feature_layer_ids(tcfg.num_hidden_layers, 4),
                       num_target_layers=tcfg.num_hidden_layers, vocab_size=tcfg.vocab_size,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=tcfg.max_position_embeddings)


def new_drafter(cfg: DraftConfig, seed: int, device: torch.device, std: float = 0.02) -> DFlashDrafter:
    """Float32 trainable drafter: normal(0, std) linears (residual outputs scaled down), unit norms."""
    d = DFlashDrafter(cfg, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    resid = std / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
    d.to(device)
    d.device = device
    d.requires_grad_(True)
    return d


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d]; cos/sin [B, T, d] or [T, d] (rotate-half, as the drafter)."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * c + rotate_half(x) * s


def draft_hidden(drafter: DFlashDrafter, feats: torch.Tensor, block_embeds: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Differentiable drafter forward over many blocks.

    feats [B, S, K*H]: target features of positions 0..S-1; block_embeds [B, n, Bk, D]: target
    embeddings of [token at anchor, MASK...]; anchors [B, n] (block j at positions anchors+0..Bk-1).
    Returns the final-normed hidden states [B, n, Bk, D].
    """
    cfg = drafter.cfg
    B, S, _ = feats.shape
    _, n, Bk, D = block_embeds.shape
    Q = n * Bk
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev = feats.device
    ctx = drafter.hidden_norm(drafter.fc(feats))  # [B, S, D]
    q_pos = (anchors.unsqueeze(-1) + torch.arange(Bk, device=dev)).reshape(B, Q)  # [B, Q]
    cos_q, sin_q = rope_tables(q_pos, d, cfg.rope_theta, torch.float32)  # [B, Q, d]
    cos_c, sin_c = rope_tables(torch.arange(S, device=dev), d, cfg.rope_theta, torch.float32)  # [S, d]
    # visibility [B, 1, Q, S+Q]: context strictly before the block's anchor; own block only
    blk = torch.arange(Q, device=dev) // Bk
    see_ctx = torch.arange(S, device=dev).view(1, 1, S) < anchors.repeat_interleave(Bk, dim=1).unsqueeze(-1)
    see_blk = (blk.unsqueeze(1) == blk.unsqueeze(0)).unsqueeze(0).expand(B, Q, Q)
    mask = torch.cat([see_ctx, see_blk], dim=-1).unsqueeze(1)
    h = block_embeds.reshape(B, Q, D).float()
    rep = H // Hkv
    for layer in drafter.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = _rope(a.q_norm(a.q_proj(x).view(B, Q, H, d)).float(), cos_q, sin_q)
        kb = _rope(a.k_norm(a.k_proj(x).view(B, Q, Hkv, d)).float(), cos_q, sin_q)
        vb = a.v_proj(x).view(B, Q, Hkv, d)
        kc = _rope(a.k_norm(a.k_proj(ctx).view(B, S, Hkv, d)).float(), cos_c, sin_c)
        vc = a.v_proj(ctx).view(B, S, Hkv, d)
        k = torch.cat([kc, kb], dim=1).transpose(1, 2)  # [B, Hkv, S+Q, d]
        v = torch.cat([vc, vb], dim=1).transpose(1, 2)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        q = q.transpose(1, 2)  # [B, H, Q, d]
        dt = v.dtype
        o = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v, attn_mask=mask, scale=1.0 / math.sqrt(d))
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, Q, H * d)).float()
        h = h + layer.mlp(layer.post_attention_layernorm(h)).float()
    return drafter.norm(h).view(B, n, Bk, D)


@torch.no_grad()
def target_features(target: TrainModel, ids: torch.Tensor, layer_ids: tuple[int, ...], *,
                    with_logits: bool = False):
    """ids [B, S] -> (features [B, S, K*H], greedy [B, S]: greedy[:, t] = argmax logits[:, t-1], greedy[:, 0] = -1)
    (+ the target's logits [B, S, V] with ``with_logits``)."""
    with autocast(ids.device):
        logits, aux = target(ids, aux_layers=layer_ids)
    greedy = torch.full_like(ids, -1)
    greedy[:, 1:] = logits[:, :-1].argmax(-1)
    return (aux, greedy, logits) if with_logits else (aux, greedy)


def sample_anchors(B: int, S: int, Bk: int, n: int, lo: torch.Tensor | int, gen: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    """[B, n] distinct anchors per row, uniform in [lo, S-Bk] (lo per row or scalar; fewer slots repeat)."""
    lo_t = torch.as_tensor(lo, device=device).expand(B).clamp(1, S - Bk)
    span = (S - Bk + 1) - lo_t  # [B]
    r = torch.rand(B, S, generator=gen, device=device)
    valid = torch.arange(S, device=device).unsqueeze(0) < span.unsqueeze(1)
    r = r.masked_fill(~valid, -1.0)
    idx = r.topk(min(n, S), dim=1).indices[:, :n]  # [B, n]
    idx = torch.remainder(idx, span.unsqueeze(1))  # rows with fewer valid slots than n repeat
    return idx + lo_t.unsqueeze(1)


def block_logits(drafter: DFlashDrafter, target: TrainModel, feats: torch.Tensor, ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [B, n, Bk-1, V] for positions anchor+1 .. anchor+Bk-1."""
    cfg = drafter.cfg
    Bk = cfg.block_size
    B, n = anchors.shape
    block = torch.full((B, n, Bk), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)
    emb = target.embed_tokens(block).detach()
    h = draft_hidden(drafter, feats, emb, anchors)
    return target.lm_head(h[:, :, 1:])  # frozen, shared


def block_labels(greedy: torch.Tensor, anchors: torch.Tensor, Bk: int) -> torch.Tensor:
    pos = anchors.unsqueeze(-1) + torch.arange(1, Bk, device=anchors.device)  # [B, n, Bk-1]
    return greedy.gather(1, pos.view(pos.shape[0], -1)).view(pos.shape)


def position_weights(Bk: int, gamma: float, device: torch.device) -> torch.Tensor:
    return torch.exp(-(torch.arange(1, Bk, device=device, dtype=torch.float32) - 1) / gamma)  # [Bk-1]


def draft_loss(logits: torch.Tensor, labels: torch.Tensor, wpos: torch.Tensor, target_logits: torch.Tensor | None,
               anchors: torch.Tensor, soft_weight: float) -> torch.Tensor:
    """Position-weighted CE on the target's greedy tokens, plus ``soft_weight`` x the CE to the target's
    full distribution at the same positions (logits [B, n, Bk-1, V]; target_logits [B, S, V])."""
    B, n, K, V = logits.shape
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, n, K]
    if target_logits is not None and soft_weight > 0:
        # the target's distribution for the token at anchor + k comes from its logits at anchor + k - 1
        pos = (anchors.unsqueeze(-1) + torch.arange(K, device=anchors.device)).view(B, n * K)
        tl = target_logits.gather(1, pos.unsqueeze(-1).expand(B, n * K, V)).view(B, n, K, V)
        soft = -(torch.softmax(tl.float(), dim=-1) * logp).sum(-1)  # [B, n, K]
        ce = (1 - soft_weight) * ce + soft_weight * soft
    return (ce * wpos).sum() / (wpos.sum() * B * n)


# ---- training -----------------------------------------------------------------------------------

@dataclass
class DraftTrainSettings:
    minutes: float = 7.0  # whole phase: continuation pool + training
    max_steps: int | None = None
    batch: int = 128  # sequences per step (steps are launch-bound on an H200: 64 and 32 cost the same)
    seq_len: int = 512
    blocks_per_seq: int = 64
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float = 7.0
    soft_weight: float = 0.5  # share of the loss on the target's full distribution (rest: its argmax)
    pool_seqs: int = 12288  # target continuations generated before training (the time share may cut it)
    pool_time_frac: float = 0.2  # at most this share of the phase for the pool
    gen_batch: int = 4096  # generation is launch-bound: wide batches are nearly free
    prefix_lens: tuple[int, ...] = (64, 32, 128, 16)  # first batch: 64 (the held-out prompts' length)
    sample_every: int = 4  # every 4th pool batch is sampled at temperature 1 (the rest greedy)
    pool_step_frac: float = 0.8  # share of steps on pool sequences (the rest on data windows)
    seed: int = 0


@dataclass
class DraftResult:
    drafter: DFlashDrafter
    steps: int
    seconds: float
    pool_seqs: int
    pool_seconds: float
    curve: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    eval_continuations: torch.Tensor | None = None


@torch.no_grad()
def continuation_pool(target: TrainModel, stream: torch.Tensor, n_seqs: int, seq_len: int,
                      prefix_lens: tuple[int, ...], sample_every: int, gen_batch: int, device: torch.device,
                      seed: int, deadline: float | None = None, extra_prompts: torch.Tensor | None = None,
                      log: Callable[[str], None] = print) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Data prefixes + target continuations [N, seq_len] (on device).

    Batch i uses prefix length prefix_lens[i % len]; it is sampled at temperature 1 when
    i % sample_every == sample_every - 1, else greedy. ``extra_prompts`` [m, prefix_lens[0]] ride along
    in the first (greedy) batch; their continuations are returned separately.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    dg = torch.Generator(device=device).manual_seed(seed + 1)
    stream = stream.to(device)
    seqs = []
    extra = None
    made, i = 0, 0
    while made < n_seqs:
        b = min(gen_batch, n_seqs - made)
        P = prefix_lens[i % len(prefix_lens)]
        temp = 1.0 if sample_every and i % sample_every == sample_every - 1 else 0.0
        prompts = random_windows(stream, b, P, g)
        m = 0
        if i == 0 and extra_prompts is not None:
            m = extra_prompts.shape[0]
            prompts = torch.cat([prompts, extra_prompts.to(device)])
        try:
            out = generate(target, prompts, seq_len - P, temperature=temp, gen=dg)
        except torch.OutOfMemoryError:
            if gen_batch <= 64:
                raise
            gen_batch //= 2
            torch.cuda.empty_cache()
            log(f"drafter: out of memory generating; batch now {gen_batch}")
            continue
        if m:
            extra, out = out[b:], out[:b]
        seqs.append(out)
        made += b
        i += 1
        if deadline is not None and time.perf_counter() > deadline:
            log(f"drafter: continuation pool stopped by its time share at {made} sequences")
            break
    return torch.cat(seqs), extra


def train_drafter(target: TrainModel, dcfg: DraftConfig, train_stream: torch.Tensor, s: DraftTrainSettings,
                  device: torch.device, log: Callable[[str], None] = print,
                  eval_prompts: torch.Tensor | None = None) -> DraftResult:
    """Continuation pool, then drafter steps until ``s.minutes`` (whole phase) or ``s.max_steps``."""
    t0 = time.perf_counter()
    budget = s.minutes * 60.0
    timed = s.max_steps is None
    target.eval().requires_grad_(False)
    torch.manual_seed(s.seed)
    stream = train_stream.to(device)
    pool, eval_cont = continuation_pool(
        target, stream, s.pool_seqs, s.seq_len, s.prefix_lens, s.sample_every, s.gen_batch, device,
        s.seed + 11, deadline=t0 + s.pool_time_frac * budget if timed else None, extra_prompts=eval_prompts,
        log=log)
    if device.type == "cuda":
        torch.cuda.synchronize()
    pool_s = time.perf_counter() - t0
    log(f"drafter: continuation pool {pool.shape[0]} x {s.seq_len} tokens in {pool_s:.1f}s")

    drafter = new_drafter(dcfg, s.seed + 5, device)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, target layers "
        f"{list(dcfg.target_layer_ids)}, {s.batch} sequences x {s.blocks_per_seq} blocks of {dcfg.block_size} a step")
    opt = make_optimizer(drafter, s.lr, s.weight_decay, s.betas, device)
    layer_ids = dcfg.target_layer_ids
    Bk = dcfg.block_size
    wpos = position_weights(Bk, s.gamma, device)
    coin = torch.Generator().manual_seed(s.seed + 7)  # CPU: which source each step (no device sync)
    dg = torch.Generator(device=device).manual_seed(s.seed + 9)
    total = s.max_steps if not timed else 10**9
    sched_total = total if not timed else 10**6
    log_every = max(1, total // 10) if not timed else 0
    curve: list[dict] = []
    step = 0
    ema_loss = torch.zeros((), device=device)
    ema_acc = torch.zeros((), device=device)
    mark = (0, t0)
    while step < total:
        if float(torch.rand((), generator=coin)) < s.pool_step_frac:
            rows = torch.randint(0, pool.shape[0], (s.batch,), generator=dg, device=device)
            ids = pool[rows]  # anchors anywhere: data prefix and continuation
        else:
            ids = random_windows(stream, s.batch, s.seq_len, dg)
        lr = lr_at(step, sched_total, s)
        for gp in opt.param_groups:
            gp["lr"] = lr
        try:
            feats, greedy, tlogits = target_features(target, ids, layer_ids, with_logits=True)
            anchors = sample_anchors(ids.shape[0], s.seq_len, Bk, s.blocks_per_seq, 1, dg, device)
            labels = block_labels(greedy, anchors, Bk)
            with autocast(device):
                logits = block_logits(drafter, target, feats, ids, anchors)
            loss = draft_loss(logits, labels, wpos, tlogits, anchors, s.soft_weight)
            del tlogits
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError:
            if s.batch <= 8 or step > 0:
                raise
            feats = greedy = tlogits = logits = loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            s.batch //= 2
            log(f"drafter: out of memory at the first step; batch now {s.batch} sequences")
            continue
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), s.grad_clip)
        opt.step()
        with torch.no_grad():
            acc1 = (logits[:, :, 0].argmax(-1) == labels[:, :, 0]).float().mean()
            ema_loss = loss.detach() if step == 0 else 0.95 * ema_loss + 0.05 * loss.detach()
            ema_acc = acc1 if step == 0 else 0.95 * ema_acc + 0.05 * acc1
        step += 1
        elapsed = time.perf_counter() - t0
        if timed and step in (20, 80):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == 80:
                rate = (now - mark[1]) / (step - mark[0])
                total = max(step + 1, int(step + (budget - (now - t0)) / rate))
                sched_total = total
                log_every = max(1, total // 12)
                log(f"drafter: {rate * 1000:.1f} ms/step -> {total} steps")
            mark = (step, now)
        over = timed and elapsed > budget
        if (log_every and step % log_every == 0) or step == total or over:
            lv, el, ea = float(loss.detach()), float(ema_loss), float(ema_acc)
            curve.append({"step": step, "seconds": round(elapsed, 2), "lr": lr, "loss": lv, "loss_ema": el,
                          "acc1_ema": ea})
            log(f"drafter step {step}/{total if total < 10**9 else '?'} {elapsed:6.1f}s lr {lr:.2e} "
                f"loss {lv:.3f} (ema {el:.3f}) pos-1 acc (ema) {ea:.3f}")
        if over:
            log(f"drafter: time box reached at step {step}")
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    drafter.requires_grad_(False).eval()
    return DraftResult(drafter=drafter, steps=step, seconds=time.perf_counter() - t0, pool_seqs=pool.shape[0],
                       pool_seconds=pool_s, curve=curve, settings=asdict(s), eval_continuations=eval_cont)


@torch.no_grad()
def evaluate_drafter(drafter: DFlashDrafter, target: TrainModel, seqs: torch.Tensor, lo: torch.Tensor | int,
                     device: torch.device, blocks_per_seq: int = 32, batch: int = 16, seed: int = 0,
                     topk: int = 4) -> dict:
    """Per-position top-1 / top-k accuracy vs the target's greedy tokens and the chain tau estimate.

    tau = 1 + mean over blocks of the number of leading positions whose draft argmax is right
    (accepted drafts + the bonus token, as greedy DFlash verification counts them).
    """
    cfg = drafter.cfg
    Bk = cfg.block_size
    dg = torch.Generator(device=device).manual_seed(seed)
    n_blocks = 0
    hit1 = torch.zeros(Bk - 1, device=device)
    hitk = torch.zeros(Bk - 1, device=device)
    accepted = 0.0
    for i in range(0, seqs.shape[0], batch):
        ids = seqs[i:i + batch].to(device)
        B, S = ids.shape
        lo_b = lo[i:i + batch].to(device) if isinstance(lo, torch.Tensor) else lo
        feats, greedy = target_features(target, ids, cfg.target_layer_ids)
        anchors = sample_anchors(B, S, Bk, blocks_per_seq, lo_b, dg, device)
        labels = block_labels(greedy, anchors, Bk)
        with autocast(device):
            logits = block_logits(drafter, target, feats, ids, anchors).float()
        top = logits.topk(topk, dim=-1).indices  # [B, n, Bk-1, k]
        right = top[..., 0] == labels
        hit1 += right.float().sum((0, 1))
        hitk += (top == labels.unsqueeze(-1)).any(-1).float().sum((0, 1))
        accepted += float(right.long().cumprod(-1).sum())
        n_blocks += B * anchors.shape[1]
    acc1 = (hit1 / n_blocks).tolist()
    acck = (hitk / n_blocks).tolist()
    return {"blocks": n_blocks, "acc_top1": [round(a, 4) for a in acc1],
            f"acc_top{topk}": [round(a, 4) for a in acck], "tau_chain": round(1.0 + accepted / n_blocks, 3)}


def export_drafter(drafter: DFlashDrafter, dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """A CPU copy in ``dtype`` for save_drafter."""
    out = DFlashDrafter(drafter.cfg, dtype=dtype, device="cpu")
    return out.load_weights((k, v.detach().cpu()) for k, v in drafter.state_dict().items())
