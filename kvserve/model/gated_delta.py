"""Gated DeltaNet's token mixing as plain tensor code, in float32: the causal depthwise conv that continues from a
conv tail, and the gated delta rule in two forms that continue from a recurrent state — chunked for prompt chunks
(a few matmuls per 64 tokens) and recurrent for decode (one update per token, many sequences in one call).

The rule, per value head, with state S (value_dim x key_dim), decay g_t <= 0 (log space) and rate beta_t:
    S' = exp(g_t) S;   u_t = beta_t (v_t - S' k_t);   S_t = S' + u_t k_t^T;   o_t = S_t q_t
with q and k L2-normalized and q scaled by key_dim ** -0.5 (qk_norm_and_scale). S is held as the state cache holds
it (kv/state_cache.py): [..., value_dim, key_dim], the transpose of transformers' [..., key_dim, value_dim]; conv
tails as [..., kernel - 1, channels], oldest input first."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.kv.state_cache import delta_rule_step_

CHUNK_TOKENS = 64  # the chunked form's block of tokens: one triangular solve and a few matmuls each


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C, T] new inputs, tail: [B, K-1, C] the inputs before them (zeros at a sequence's start), weight:
    [C, K]. Returns silu(conv) [B, C, T] and the new tail [B, K-1, C]. `lengths` [B]: each sequence's real inputs,
    the rest of its T padding (its outputs there are not meant; its tail ends at its last real input)."""
    full = torch.cat([tail.transpose(1, 2).to(x.dtype), x], dim=-1)
    out = F.conv1d(full, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0])
    kept = tail.shape[1]
    if lengths is None:
        return F.silu(out), full[..., full.shape[-1] - kept :].transpose(1, 2)
    ends = (lengths[:, None] + torch.arange(kept, device=x.device))[:, None, :].expand(-1, x.shape[1], -1)
    return F.silu(out), full.gather(-1, ends).transpose(1, 2)


def conv_step_(x: torch.Tensor, tail: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x [B, C], tail [B, K-1, C] updated in place to end at x, taps [K, C] (the conv
    weight transposed, contiguous). Returns silu(conv) [B, C]. A tap at a time, each a contiguous [B, C] slice of the
    tail times a contiguous row of taps."""
    out = torch.addcmul(x * taps[-1], tail[:, 0], taps[0])
    for k in range(1, tail.shape[1]):
        out.addcmul_(tail[:, k], taps[k])
    for k in range(tail.shape[1] - 1):  # shift the tail by one input (each tap reads the next before it changes)
        tail[:, k].copy_(tail[:, k + 1])
    tail[:, -1].copy_(x)
    return F.silu(out)


def qk_norm_and_scale(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k L2-normalized over the head dim in float32 (eps 1e-6 inside the root), q scaled by head_dim ** -0.5."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. q, k: [B, T, H, Dk] (normalized and scaled), v: [B, T, H, Dv], g, beta: [B, T, H],
    state: [B, H, Dv, Dk]. Returns o [B, T, H, Dv] and the final state, all float32; the caller's state is kept."""
    state = state.float().clone(memory_format=torch.contiguous_format)
    return recurrent_gated_delta_rule_(q, k, v, g, beta, state), state


def recurrent_gated_delta_rule_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state: torch.Tensor,
                                step: Callable[..., tuple[torch.Tensor, torch.Tensor]] = delta_rule_step_
                                ) -> torch.Tensor:
    """recurrent_gated_delta_rule updating `state` (float32, contiguous: e.g. a view of the state cache's slots) in
    place; returns o. A decode token's cost is reading and writing the states (many MiB per sequence): `step`
    (kv/state_cache.py) reads S q and S k, updates them and returns S q and u, and o = S_t q = exp(g) S q + (k.q) u
    follows."""
    batch, heads, dv, dk = state.shape
    flat = state.view(batch * heads, dv, dk)
    outs = []
    for t in range(q.shape[1]):
        decay, rate = g[:, t].float().exp().reshape(-1), beta[:, t].float().reshape(-1)
        q_t, k_t = (x[:, t].float().reshape(-1, dk).contiguous() for x in (q, k))
        v_t = v[:, t].float().reshape(-1, dv).contiguous()
        read_q, u = step(flat, q_t, k_t, v_t, decay, rate)
        k_dot_q = (k_t * q_t).sum(-1, keepdim=True)
        outs.append((decay[:, None] * read_q).addcmul_(k_dot_q, u).view(batch, heads, dv))
    return torch.stack(outs, dim=1)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None, chunk_tokens: int = CHUNK_TOKENS,
                             lengths: torch.Tensor | None = None, in_place: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule a block of `chunk_tokens` at a time (the last block may be shorter); same shapes as
    recurrent_gated_delta_rule. Heads go first inside: [B, H, T, D]. `lengths` [B]: sequences of different lengths
    in one call, each padded to T; a padded token decays and updates nothing (g and beta taken as 0 there) and its
    output means nothing; a block is computed only for the sequences that reach into it (0 for the others).
    `in_place`: `state` (float32 and contiguous, the caller's own copy) becomes the final state, saving a pass over
    it per block; otherwise the caller's state is kept. `state` None: every sequence starts from zeros (prompts
    that start their sequences), whose first block then neither reads a state nor decays one."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    if state is not None:
        state = state.float() if in_place else state.float().clone(memory_format=torch.contiguous_format)
    if lengths is not None:
        real = (torch.arange(q.shape[2], device=q.device) < lengths[:, None])[:, None, :]  # [B, 1, T]
        g, beta = g * real, beta * real
    outs = []
    for start in range(0, q.shape[2], chunk_tokens):
        block = slice(start, start + chunk_tokens)
        parts = (q[:, :, block], k[:, :, block], v[:, :, block], g[:, :, block], beta[:, :, block])
        if state is None:  # every sequence reaches into the first block, and a padded one's state stays zeros
            out, state = _chunk_(*parts, None)
            outs.append(out)
        elif lengths is None or bool((lengths > start).all()):
            outs.append(_chunk_(*parts, state)[0])
        else:  # the sequences that end before this block keep their state
            active = (lengths > start).nonzero().squeeze(1)
            out, ongoing = parts[2].new_zeros(parts[2].shape), state[active]
            out[active] = _chunk_(*(x[active] for x in parts), ongoing)[0]
            state[active] = ongoing
            outs.append(out)
    return torch.cat(outs, dim=2).transpose(1, 2), state


def _chunk_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of L tokens from `state`, which it leaves at the block's end (in place); returns the outputs and the
    state. With c the cumulative decay inside the block, decay(t, s) = exp(c_t - c_s) and the new values u of every
    token solve (I + A) u = beta (v - exp(c) S0 k), A[t, s] = beta_t decay(t, s) k_t.k_s for s < t: one unit
    lower-triangular solve instead of L sequential updates. The state ([B, H, Dv, Dk]) is read by one matmul for keys
    and queries together. `state` None: S0 = 0, nothing to read, and the state at the block's end is made new."""
    length = q.shape[2]
    c = g.cumsum(-1)  # [B, H, L]
    earlier = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
    # decay between positions, masked before exp so that the upper triangle cannot overflow
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~earlier, float("-inf")).exp()
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * decay  # A, strictly lower
    within = (q @ k.transpose(-1, -2)) * decay.masked_fill(torch.eye(length, dtype=torch.bool, device=q.device), 1.0)
    ends = k * (c[..., -1:] - c).exp()[..., None]  # each key decayed from its token to the block's end
    if state is None:
        u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
        return within @ u, u.transpose(-1, -2) @ ends
    # exp(c) S0 k and exp(c) S0 q of every token, as rows
    read = (c.exp().repeat(1, 1, 2)[..., None] * torch.cat([k, q], dim=2)) @ state.transpose(-1, -2)
    rhs = beta[..., None] * (v - read[:, :, :length])
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = torch.baddbmm(read[:, :, length:].flatten(0, 1), within.flatten(0, 1), u.flatten(0, 1)).view_as(u)
    flat = state.view(-1, *state.shape[-2:])
    flat.mul_(c[..., -1].exp().reshape(-1, 1, 1)).baddbmm_(u.transpose(-1, -2).flatten(0, 1), ends.flatten(0, 1))
    return out, state
